"""EXAONE 4.5 with images against transformers: a tiny random
Exaone4_5_ForConditionalGeneration (Qwen2.5-VL's tower with 2 key/value heads for 4 query
heads, windows of 4x4 merged tokens; EXAONE 4 text) and Exaone4_5_Processor
(Qwen2VLImageProcessor's Pillow backend) make the reference inputs. Two images whose
sides the processor rounds (140x168 -> 5x6 merged tokens in four windows, 150x60 -> 140x56,
5x2 in two): the prompt ids, the pixel values, the image features, the logits of the
prompt (whole, and prefilled in chunks) and 8 greedy tokens match, every token turned by
its place in the prompt (EXAONE 4.5 gives no M-RoPE positions). So do the text GGUF
(with a multi-token-prediction layer, which is skipped) and the mmproj that llama.cpp's
converter writes from the folder. Grouping the key/value heads in turn, or attending to
the whole image in every block, gives other features.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import llama_converter
import pytest
import torch
from exaone4_5_helpers import (
    IMAGE,
    greedy_tokens,
    processor_inputs,
    save_exaone4_5_dir,
    tiny_exaone4_5,
    write_text_gguf,
)
from helpers import needs_converter
from in_process import llmrun
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.exaone4_5_vision import Exaone45Vision
from llmrun.models import qwen2_vl_vision
from llmrun.qwen2_vl_images import pixel_patches
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What is in these pictures?"
SIZES = [(140, 168), (150, 60)]
TOKENS = [30, 10]


@pytest.fixture(scope="module")
def model():
    return tiny_exaone4_5()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_exaone4_5_dir(model, tmp_path_factory.mktemp("exaone4_5"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


@pytest.fixture(scope="module")
def gguf_files(model, folder, tmp_path_factory):
    """The text GGUF, and the mmproj that llama.cpp's converter (--mmproj, F32) writes."""
    out = tmp_path_factory.mktemp("exaone4_5_gguf")
    mmproj = out / "mmproj.gguf"
    llama_converter.convert([[folder, "--mmproj", "--outtype", "f32", "--outfile", mmproj]])
    return write_text_gguf(model, out / "model.gguf"), mmproj


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    return torch.cat(out.pooler_output)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_the_prompt_pixels_features_and_logits_are_transformers(
    model, engine, images, prompt, reference
):
    assert isinstance(engine.vision, Exaone45Vision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1 : start + count + 1] == [IMAGE - 2, *[IMAGE] * count, IMAGE - 1]
    assert reference["image_grid_thw"].tolist() == [[1, 10, 12], [1, 10, 4]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_planted_bugs_give_other_features(model, engine, images, reference, monkeypatch):
    """Each query head attends with its own group's key/value head (in runs, as
    transformers' repeat_kv), and the windowed blocks within their windows: key/value
    heads taken in turn, or every block over the whole image, move the features."""
    expected = image_features(model, reference)
    vision = engine.vision
    args = vars(vision.encoder.args) | {"fullatt_block_indexes": (0, 1, 2)}
    whole = qwen2_vl_vision.VisionModel(qwen2_vl_vision.EncoderArgs(**args))
    whole.load_state_dict(vision.encoder.state_dict())
    without_windows = Exaone45Vision(
        whole, vision.mean, vision.std, vision.min_pixels, vision.max_pixels
    )
    assert (torch.cat(encode(without_windows, images)) - expected).abs().max() > 1e-2
    with monkeypatch.context() as patch:
        in_turn = lambda t, n, dim: t.repeat(1, n, 1)  # noqa: E731
        patch.setattr(torch.Tensor, "repeat_interleave", in_turn)
        features = torch.cat(encode(vision, images))
    assert (features - expected).abs().max() > 1e-2


def encode(vision, images) -> list[torch.Tensor]:
    return vision_families.of_vision(vision).encode(vision, images)


@needs_converter
def test_gguf_with_the_converters_mmproj_matches_transformers(
    model, engine, gguf_files, images, prompt, reference
):
    text, mmproj = gguf_files
    assert vision_families.of_mmproj(mmproj).name == "EXAONE 4.5"
    loaded = api.load(str(text), device="cpu", mmproj=mmproj)
    assert loaded.model.args.num_hidden_layers == 2  # the MTP layer left out
    assert loaded.vision.encoder.args == engine.vision.encoder.args
    ids, prompt_images = loaded.image_prompt(
        loaded.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(loaded, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(loaded, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image_pad\|>\) for 2"):
        engine.image_prompt("<|user|>\n<vision><|image_pad|></vision>two?<|endofturn|>", images)


@needs_converter
def test_run_with_an_image_replies_as_transformers(model, folder, gguf_files, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` from the folder and from the GGUF with its
    mmproj; the folder's text alone with its usual note."""
    from PIL import Image

    image = tmp_path / "photo.png"
    image.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    text, mmproj = gguf_files
    for model_args in ([str(folder)], [str(text), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    result = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "a multimodal EXAONE 4.5; running its language model" in result.stderr

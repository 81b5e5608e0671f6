"""Cosmos3 Edge with images against transformers: a tiny random
Cosmos3EdgeForConditionalGeneration (a SigLIP 2 tower whose 6x6 table of positions each
image resamples, Qwen3.5's patch merger; a Llama-like language model with an ungated relu²
MLP turned by interleaved M-RoPE over uneven sections) saved in the Hub's layout, and
Cosmos3EdgeProcessor (Cosmos3EdgeImageProcessorPil) make the reference inputs. Two images
whose sides the processor rounds to 32 pixels (140x168 -> 8x10 patches, 4x5 merged tokens;
150x60 -> 10x4, 5x2): the prompt ids, the pixel values, the image features, the logits of
the prompt (whole, and prefilled in chunks) and 8 greedy tokens match; so do the logits of
a text-only prompt. `run --image` and `chat --image` reply with transformers' tokens; the
text alone runs with a note. The position table resampled without antialiasing, or the
M-RoPE sections taken in blocks instead of interleaved, move the features or logits.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from cosmos3_edge_helpers import processor_inputs, save_cosmos3_edge_dir, tiny_cosmos3_edge
from in_process import llmrun
from qwen2_vl_helpers import IMAGE, VISION_END, VISION_START, greedy_tokens
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.cosmos3_edge_images import pixel_patches
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.cosmos3_edge_vision import Cosmos3EdgeVision
from llmrun.models import cosmos3_edge_vision, mrope
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What is in these pictures?"
SIZES = [(140, 168), (150, 60)]
TOKENS = [20, 10]


@pytest.fixture(scope="module")
def model():
    return tiny_cosmos3_edge()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_cosmos3_edge_dir(model, tmp_path_factory.mktemp("cosmos3_edge"))


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
def expected_logits(model, reference):
    with torch.no_grad():
        return model(**reference).logits[0]


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


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert isinstance(engine.vision, Cosmos3EdgeVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1 : start + count + 1] == [VISION_START, *[IMAGE] * count, VISION_END]
    assert reference["image_grid_thw"].tolist() == [[1, 8, 10], [1, 10, 4]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected_logits[-1], atol=1e-4, rtol=0)
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8 and len(set(expected)) > 1
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected


def test_a_text_only_prompt_is_transformers(model, engine):
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_planted_bugs_move_the_features_or_logits(
    model, engine, images, prompt, reference, expected_logits, monkeypatch
):
    """The position table resampled without antialiasing; the M-RoPE sections in blocks
    (Qwen2-VL's) instead of interleaved."""
    expected = image_features(model, reference)
    family = vision_families.of_vision(engine.vision)
    interpolate = F.interpolate
    with monkeypatch.context() as patch:

        def aliased(*args, **kwargs):
            return interpolate(*args, **{**kwargs, "antialias": False})

        patch.setattr(cosmos3_edge_vision.F, "interpolate", aliased)
        features = torch.cat([t.flatten(0, 1) for t in family.encode(engine.vision, images)])
    assert (features - expected).abs().max() > 1e-2
    angles = mrope.angles
    with monkeypatch.context() as patch:
        patch.setattr(mrope, "angles", lambda *args: angles(*args[:4], interleaved=False))
        assert (logits(engine, *prompt) - expected_logits).abs().max() > 1e-2


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` from the
    folder; the folder's text alone with its usual note."""
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    image = tmp_path / "photo.png"
    image.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    options = ("--image", str(image), "-n", "8", "--temperature", "0")
    chat = llmrun("chat", str(folder), *options, input=QUESTION)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == load_tokenizer(folder).decode(expected) + "\n\n"
    result = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "a multimodal Cosmos3 Edge; running its language model" in result.stderr

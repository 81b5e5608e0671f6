"""Janus-Pro with images against transformers: a tiny random JanusForConditionalGeneration
(SigLIP tower, MLP aligner, Llama text, a minimal image-generation half) and JanusProcessor
(JanusImageProcessor's Pillow backend, Janus-Pro's default system prompt) make the
reference inputs. Two images of other aspects, one so thin that its shorter side is raised
to min_size: the prompt ids, the pixel values (resized, then padded square with the mean's
grey), the image features, the logits and 8 greedy tokens match; so does the same model as
a llama text GGUF and an mmproj GGUF laid out as llama.cpp's converter writes them (checked
against the converter itself where it is fetched). Padding before resizing fails. The
image-generation half's tensors are left out.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import llama_converter
import pytest
import torch
from helpers import needs_converter
from janus_helpers import (
    BOI,
    EOI,
    IMAGE,
    TOKENS,
    greedy_tokens,
    processor_inputs,
    save_janus_dir,
    tiny_janus,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, janus_images, vision_families
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import normalized, open_image
from llmrun.loading import safetensors_io
from llmrun.loading.gguf_io import load_tensor, read_gguf
from llmrun.loading.janus_vision import JanusVision
from llmrun.loading.loader import open_checkpoint
from llmrun.multimodal import PromptImages
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in the picture?"
# (height, width): 12x60 resized to 6x32, raised to 14x32 (min_size), padded to 32x32;
# 50x27 resized to 32x17.
SIZES = [(12, 60), (50, 27)]


@pytest.fixture(scope="module")
def model():
    return tiny_janus()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_janus_dir(model, tmp_path_factory.mktemp("janus"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


def user_text(engine, images: int) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": QUESTION}]
    return engine.render([{"role": "user", "content": content}])


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(user_text(engine, len(images)), images)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"])
    return out.pooler_output.flatten(0, 1)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt, reference):
    assert isinstance(engine.vision, JanusVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == [TOKENS, TOKENS]
    for start in prompt_images.starts:
        assert ids[start - 1 : start + TOKENS + 1] == [BOI, *[IMAGE] * TOKENS, EOI]
    assert engine.image_tokens(images[0]) == TOKENS + 2
    for image, expected in zip(images, reference["pixel_values"], strict=True):
        ours = janus_images.pixel_values(image, engine.vision)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_image_features_logits_and_tokens_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 5, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    assert len(tokens) == 8
    assert generated(engine, ids, prompt_images) == tokens


def test_padding_before_resizing_fails(model, engine, images, reference):
    """The planted bug: the thin image padded square first, then resized (JanusImageProcessor
    resizes first): other pixels, other features."""
    from PIL import Image

    vision, image = engine.vision, images[0]
    side = max(image.size)
    square = Image.new("RGB", (side, side), vision.background)
    square.paste(image, (0, (side - image.height) // 2))
    size = vision.image_size
    resized = square.resize((size, size), Image.Resampling.BICUBIC)
    pixels = normalized(resized, vision.mean, vision.std)
    assert (pixels - reference["pixel_values"][0]).abs().max() > 1e-2
    with torch.no_grad():
        planted = vision.encoder(pixels[None])[0]
    assert (planted - image_features(model, reference)[:TOKENS]).abs().max() > 1e-2


def test_the_generation_half_is_left_out(folder):
    """The VQ model and the generation embeddings, aligner and head are in the file (the
    mapped views of the language model's tensors are all the text model takes; the image
    encoder refuses any tensor it has no place for)."""
    generation = ("model.vqmodel.", "model.generation_")
    names = [
        n for f in safetensors_io.safetensors_files(folder) for n in safetensors_io.load_tensors(f)
    ]
    assert sum(n.startswith(generation) for n in names) > 50
    weights = open_checkpoint(folder).weights
    assert not [n for n in weights if "vqmodel" in n or "generation" in n or "aligner" in n]
    assert len(weights) == len([n for n in names if n.startswith("model.language_model.")])


def test_gguf_with_mmproj_matches_transformers(model, folder, images, reference, tmp_path):
    """The GGUF's SentencePiece vocabulary (stories260K's) puts a space after each special
    token, as llama.cpp does, where transformers' does not: the image tokens are laid out
    alike, and the processor's ids with the mmproj's image features give its logits and
    tokens."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)  # --outtype f32
    assert vision_families.of_mmproj(mmproj).name == "Janus-Pro"
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    # A GGUF holds no processor settings: JanusProcessor's system prompt is not added.
    assert not engine.vision.system_prompt
    ids, prompt_images = engine.image_prompt(user_text(engine, len(images)), images)
    assert janus_images.SYSTEM_PROMPT.strip() not in engine.tokenizer.decode(ids)
    for start in prompt_images.starts:
        assert ids[start - 1 : start + TOKENS + 1] == [BOI, *[IMAGE] * TOKENS, EOI]
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    expected_ids = reference["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(expected_ids) if t == IMAGE and expected_ids[i - 1] == BOI]
    at_reference = PromptImages(prompt_images.embeds, starts)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    got = logits(engine, expected_ids, at_reference)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert generated(engine, expected_ids, at_reference) == greedy_tokens(model, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)


@needs_converter
def test_the_mmproj_is_the_converters(model, folder, tmp_path):
    """llama.cpp's converter (--mmproj, default F16) on the folder writes write_mmproj's
    tensors, types and clip.* metadata."""
    out = tmp_path / "converted.gguf"
    llama_converter.convert([[folder, "--mmproj", "--outfile", out]])
    ours = read_gguf(write_mmproj(model, tmp_path / "ours.gguf"))
    theirs = read_gguf(out)
    assert sorted(theirs.tensors) == sorted(ours.tensors)
    for name, info in ours.tensors.items():
        assert theirs.tensors[name].ggml_type == info.ggml_type, name
        assert torch.equal(load_tensor(theirs, theirs.tensors[name]), load_tensor(ours, info))
    for key, value in ours.metadata.items():
        if key.startswith("clip."):
            assert theirs.metadata[key] == pytest.approx(value), key


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image_placeholder>\) for 2"):
        engine.image_prompt("<|User|>: <image_placeholder>\ntwo?\n\n<|Assistant|>:", images)


def test_the_text_alone_is_transformers_llama(model, folder):
    """Without images the folder loads its language model only, whose greedy tokens are
    transformers' JanusForConditionalGeneration's on the ids alone."""
    engine = api.load(str(folder), device="cpu")
    assert engine.vision is None
    ids = engine.tokenizer.encode(user_text(engine, 0))
    expected = greedy_tokens(model, {"input_ids": torch.tensor([ids])})
    stream = engine.generate(ids, GREEDY, 8)
    assert [r.token for r in stream if r.token is not None] == expected


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` from the folder, and the text alone with its
    usual note."""
    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "photo.png"
    image.write_bytes(picture(40, 30, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    result = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "a multimodal Janus-Pro; running its language model" in result.stderr

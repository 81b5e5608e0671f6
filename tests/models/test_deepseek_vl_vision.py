"""DeepSeek-VL with images against transformers: a tiny random
DeepseekVLForConditionalGeneration (SigLIP tower with its unused pooling head, a
Linear-GELU-Linear aligner, Llama text) and DeepseekVLProcessor (DeepseekVLImageProcessor's
Pillow backend: the longer side resized, the shorter raised to min_size, padded square with
the mean's colour) make the reference inputs, with the chat template of transformers'
Janus conversion. Two images of other aspects: the prompt ids, the pixel values, the image
features, the logits (whole and prefilled in chunks), 8 greedy tokens and a text-only
prompt match; `run --image`, `chat` and `serve` reply with transformers' tokens. An aligner
with the tower's tanh GELU (Janus-Pro's way) differs.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

from functools import partial

import pytest
import torch
from deepseek_vl_helpers import (
    IMAGE,
    PER_IMAGE,
    QUESTION,
    SIZES,
    processor_inputs,
    save_deepseek_vl_dir,
    tiny_deepseek_vl,
)
from exaone4_5_helpers import greedy_tokens
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
)
from vision_helpers import picture

from llmrun import api, janus_images, vision_families
from llmrun.errors import UnsupportedError, UsageError
from llmrun.images import open_image
from llmrun.loading import deepseek_vl_vision

pytest.importorskip("transformers")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def model():
    return tiny_deepseek_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_deepseek_vl_dir(model, tmp_path_factory.mktemp("deepseek_vl"))


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


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"])
    return out.pooler_output.flatten(0, 1)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "DeepSeek-VL"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == [PER_IMAGE, PER_IMAGE]
    for start in prompt_images.starts:
        assert ids[start : start + PER_IMAGE] == [IMAGE] * PER_IMAGE
        assert IMAGE not in (ids[start - 1], ids[start + PER_IMAGE])
    assert engine.image_tokens(images[0]) == PER_IMAGE
    for image, expected in zip(images, reference["pixel_values"], strict=True):
        ours = janus_images.pixel_values(image, engine.vision)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)
    check_text_only_prompt(model, engine, QUESTION)


def test_an_aligner_with_the_towers_tanh_gelu_differs(
    engine, images, reference, model, monkeypatch
):
    """Planted: Janus-Pro's aligner takes the tower's activation (here tanh GELU);
    DeepSeek-VL's is nn.GELU, exact."""
    tanh_gelu = partial(torch.nn.functional.gelu, approximate="tanh")
    monkeypatch.setattr(engine.vision.encoder.aligner, "act", tanh_gelu)
    ours = torch.cat(janus_images.encode(engine.vision, images))
    assert (ours - image_features(model, reference)).abs().max() > 1e-4


def test_places_must_match_the_images_and_there_is_no_mmproj(engine, images, tmp_path):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image_placeholder>\) for 2"):
        engine.image_prompt("<|User|>: <image_placeholder>two?\n\n<|Assistant|>:", images)
    with pytest.raises(UnsupportedError, match="no DeepSeek-VL projector"):
        deepseek_vl_vision.from_mmproj(tmp_path / "mmproj.gguf", 64)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    assert len(expected) == 8 and len(set(expected)) > 1
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "DeepSeek-VL")

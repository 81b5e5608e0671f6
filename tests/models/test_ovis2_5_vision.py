"""Ovis2.5 with images against transformers: a tiny random Ovis2_5ForConditionalGeneration
(ovis2_5_helpers: a NaViT SigLIP 2 of patch 8, windows of 4x4 merged tokens in its first
layer, a visual vocabulary of 36 plus 4 indicators, a Qwen3) and Ovis2_5Processor
(Ovis2_5ImageProcessorPil) make the reference inputs. Two images that fit one window
(60x50 -> 64x48, 4x3 merged tokens; 10x40, under a merged token high, -> 16x64, 1x4):
the prompt ids (start token, one image token per merged token, end token), the pixel
values, the image features, the start and end embeddings, the logits of the prompt (whole,
and prefilled in chunks) and 8 greedy tokens match; so do the logits of a text-only prompt.
A 100x120 image (96x128, 6x8 merged tokens in four windows) gives transformers' features,
which transformers 5.25 orders window by window where Ovis2.5's own code (and llmrun)
orders them row by row (llmrun.models.ovis2_5_vision). `run --image` and `chat --image`
reply with transformers' tokens; the text alone runs with a note. Start and end
embeddings swapped move the logits; every layer attending to the whole image moves the
larger image's features.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import dataclasses

import pytest
import torch
from ovis2_5_helpers import (
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    processor_inputs,
    save_ovis2_5_dir,
    tiny_ovis2_5,
)
from vision_checks import (
    CPU,
    check_logits_chunks_and_greedy,
    check_run_and_chat_with_an_image,
    check_text_only_prompt,
    image_features,
    logits,
)
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.images import open_image
from llmrun.loading.ovis2_5_vision import Ovis25Vision
from llmrun.models import ovis2_5_vision
from llmrun.ovis2_5_images import pixel_patches

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
SIZES = [(60, 50), (10, 40)]
TOKENS = [12, 4]


@pytest.fixture(scope="module")
def model():
    return tiny_ovis2_5()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_ovis2_5_dir(model, tmp_path_factory.mktemp("ovis2_5"))


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


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert isinstance(engine.vision, Ovis25Vision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == [n + 2 for n in TOKENS]
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start : start + count + 2] == [IMAGE_START, *[IMAGE] * count, IMAGE_END]
    assert reference["image_grid_thw"].tolist() == [[1, 8, 6], [1, 2, 8]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat([e[1:-1] for e in prompt_images.embeds])
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        indicators = model.model.multi_modal_projector.get_visual_indicator_features(CPU)
    for embeds in prompt_images.embeds:
        torch.testing.assert_close(embeds[[0, -1]], indicators[:2], atol=1e-6, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_larger_image_s_features_are_transformers_row_by_row(model, engine, folder):
    """transformers' features come window by window (get_vision_window_index's order);
    llmrun's row by row, as Ovis2.5's own VisualTokenizer and vLLM give them."""
    from transformers.vision_utils import get_vision_window_index

    image = open_image(picture(100, 120, 3))
    reference = processor_inputs(folder, [image], QUESTION)
    grid = reference["image_grid_thw"]
    assert grid.tolist() == [[1, 12, 16]]
    config = model.config.vision_config
    window_index, bounds = get_vision_window_index(grid, 2, config.window_size, config.patch_size)
    assert len(bounds) == 5  # four windows
    family = vision_families.of_vision(engine.vision)
    ours = family.encode(engine.vision, [image])[0][1:-1]
    expected = image_features(model, reference)
    torch.testing.assert_close(ours[window_index], expected, atol=1e-4, rtol=0)
    args = vars(engine.vision.encoder.args) | {"layer_types": ["full_attention"] * 2}
    whole = ovis2_5_vision.VisionModel(ovis2_5_vision.EncoderArgs(**args))
    whole.load_state_dict(engine.vision.encoder.state_dict())
    without_windows = dataclasses.replace(engine.vision, encoder=whole)
    features = family.encode(without_windows, [image])[0][1:-1]
    assert (features[window_index] - expected).abs().max() > 1e-2


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_swapped_start_and_end_embeddings_move_the_logits(
    engine, prompt, expected_logits, monkeypatch
):
    ids, prompt_images = prompt
    swapped = [torch.cat([e[-1:], e[1:-1], e[:1]]) for e in prompt_images.embeds]
    monkeypatch.setattr(prompt_images, "embeds", swapped)
    assert (logits(engine, ids, prompt_images) - expected_logits).abs().max() > 1e-2


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` from the
    folder; the folder's text alone with its usual note."""
    size = (60, 64)  # 4x4 merged tokens: one window
    check_run_and_chat_with_an_image(
        model, folder, tmp_path, processor_inputs, QUESTION, "Ovis2.5", size=size
    )

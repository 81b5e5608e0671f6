"""Ovis2 with images against transformers: a tiny random Ovis2ForConditionalGeneration
(ovis2_helpers: an AIMv2 ViT over 32x32 tiles, 2x2 patches a token, a visual vocabulary of
35 plus 5 indicators, a Qwen2 with a tied head) and Ovis2Processor (Ovis2ImageProcessorPil,
tiles on, up to 6) make the reference inputs. A 40x90 image cut into a thumbnail and 3x2
tiles and a 20x24 one left whole: the prompt ids (<IMG_START>, the tiles' <IMG_ATOM>s
between <IMG_GRID>, <IMG_COL> and <IMG_ROW>, <IMG_END>), the pixel values, the image
features, the logits of the prompt (whole, and prefilled in chunks) and 8 greedy tokens
match; so do the logits of a text-only prompt, and the tile grids of both of the
processor's tilings over a range of sizes. `run --image` and `chat --image` reply with
transformers' tokens; the text alone runs with a note. Markers given the atoms' embedding
move the logits; a thumbnail put last moves the features.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
from ovis2_helpers import (
    ATOM,
    INDICATORS,
    image_processor,
    processor_inputs,
    save_ovis2_dir,
    tiny_ovis2,
)
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_and_chat_with_an_image,
    check_text_only_prompt,
    logits,
)
from vision_helpers import picture

from llmrun import api, ovis2_images, vision_families
from llmrun.images import open_image
from llmrun.loading.ovis2_vision import Ovis2Vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
SIZES = [(40, 90), (20, 24)]
TILES = [7, 1]  # the thumbnail and 3x2 tiles; the whole image


@pytest.fixture(scope="module")
def model():
    return tiny_ovis2()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_ovis2_dir(model, tmp_path_factory.mktemp("ovis2"))


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


def image_features(model, pixel_values) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(pixel_values).pooler_output


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert isinstance(engine.vision, Ovis2Vision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    start, grid, col, row, end = INDICATORS
    atoms = [ATOM] * 4
    first = ids[prompt_images.starts[0] : prompt_images.starts[0] + len(prompt_images.embeds[0])]
    assert first == [start, *atoms, grid, *([*atoms, col, *atoms, row] * 3)[:-1], end]
    assert [len(e) for e in prompt_images.embeds] == [7 * 4 + 3 + 3 + 2, 4 + 3]
    encoded = vision_families.of_vision(engine.vision).encode(engine.vision, images)
    assert [len(e.tokens) for e in encoded] == TILES
    tiles = torch.cat([ovis2_images.pixel_tiles(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(tiles, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat([e.tokens for e in encoded])
    expected = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


@pytest.mark.parametrize("covering", [True, False])
def test_the_tile_grids_are_the_processor_s(engine, covering):
    from dataclasses import replace

    from PIL import Image

    vision = replace(engine.vision, use_covering_area_grid=covering)
    made = image_processor(use_covering_area_grid=covering)
    for height, width in ((20, 24), (40, 90), (90, 40), (64, 64), (33, 100), (100, 31), (70, 50)):
        image = Image.new("RGB", (width, height))
        expected = made([image])["grids"][0]
        assert list(ovis2_images.tile_grid(vision, height, width)) == list(expected), (
            height,
            width,
        )


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_move_the_logits_or_features(
    model, engine, images, prompt, reference, expected_logits, monkeypatch
):
    """The markers embedded as the first atom, or the thumbnail after the tiles."""
    ids, prompt_images = prompt
    atom = prompt_images.embeds[0][1]
    flat = [
        torch.where(torch.tensor(ids[s : s + len(e)])[:, None] == ATOM, e, atom)
        for s, e in zip(prompt_images.starts, prompt_images.embeds, strict=True)
    ]
    with monkeypatch.context() as patch:
        patch.setattr(prompt_images, "embeds", flat)
        assert (logits(engine, ids, prompt_images) - expected_logits).abs().max() > 1e-2
    tiles, _, _ = ovis2_images.pixel_tiles(images[0], engine.vision)
    with torch.no_grad():
        moved = engine.vision.encoder(torch.cat([tiles[1:], tiles[:1]]))
    expected = image_features(model, reference["pixel_values"][:7])
    assert (moved - expected).abs().max() > 1e-2


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` from the
    folder; the folder's text alone with its usual note."""
    check_run_and_chat_with_an_image(model, folder, tmp_path, processor_inputs, QUESTION, "Ovis2")

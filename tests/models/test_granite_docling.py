"""Granite Docling (transformers' granite_docling: granite-for-docling-500m's architecture)
with images against transformers: a tiny random GraniteDoclingForConditionalGeneration
(Granite text of hidden 64 in 2 layers with Granite's multipliers; Idefics3's SigLIP tower
of hidden 32 in 3 layers on 32-pixel tiles of 4-pixel patches, pixel-shuffled by 4 into 4
tokens a tile; DeepStack mergers on tower layers 0 and 2, added after decoder layers 0 and
1) whose GraniteDoclingProcessor (its Pillow image processor, GOT-OCR2 tiles of at most 6)
makes the reference inputs. The prompt ids and pixels equal the processor's for pages of
1, 2, 4 and 6 tiles; the image features and DeepStack features, the logits (with images,
through a chunked prefill, and of a text-only prompt) within 1e-4 of transformers' (logits
span about -2..4); pixels within 1e-5; 8 greedy tokens equal generate's. A 2D position embedding in vit_mae's layout
fails. The fine connector path (fine_route) and the spread rule (dense_max_patches) are
checked against the processor and the model too.
"""

import pytest
import torch
from granite_docling_helpers import (
    DENSE,
    SHAPES,
    reference_inputs,
    save_granite_docling_dir,
    tiny_granite_docling,
)
from smolvlm_helpers import IMAGE, greedy_tokens
from vision_helpers import picture

from llmrun import api, granite_docling_images
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.models import granite_docling_vision
from llmrun.sampling import SamplingParams

pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "Convert this page to docling."
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_granite_docling()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_granite_docling_dir(model, tmp_path_factory.mktemp("granite_docling"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(64, 60, 1)), open_image(picture(30, 30, 2))]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return reference_inputs(folder, images, engine.prompt_text(QUESTION, images=len(images)))


def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def logits(engine, ids, prompt_images=None) -> torch.Tensor:
    tokens = None if prompt_images is None else prompt_images.tokens(0, len(ids), CPU)
    with torch.no_grad():
        return engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], images=tokens)[0]


def expected_features(model, reference) -> torch.Tensor:
    """transformers' image features and DeepStack features side by side."""
    with torch.no_grad():
        out = model.model.get_image_features(
            reference["pixel_values"],
            reference["pixel_attention_mask"],
            tile_fine_mask=reference.get("tile_fine_mask"),
        )
    stacked = [torch.cat(f) for f in out.deepstack_features]
    return torch.cat([torch.cat(out.pooler_output), *stacked], dim=-1)


def soft_tokens(ids, prompt_images) -> torch.Tensor:
    """The prompt images' rows at <image> tokens, in order."""
    rows = [
        embeds[torch.tensor([ids[start + i] == IMAGE for i in range(len(embeds))])]
        for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True)
    ]
    return torch.cat(rows)


def check_matches_transformers(model, engine, images, reference) -> None:
    ids, prompt_images = prompt(engine, images)
    assert ids == reference["input_ids"][0].tolist()
    features = soft_tokens(ids, prompt_images)
    torch.testing.assert_close(features, expected_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split
        state = KVState(engine.model.new_cache(1, 512, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    stream = engine.generate(ids, SamplingParams(temperature=0.0), 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == greedy_tokens(model, reference)


def test_the_prompt_and_pixels_are_the_processors(engine, folder):
    text = engine.prompt_text(QUESTION, images=1)
    for (height, width), grid in SHAPES.items():
        image = open_image(picture(height, width, 3))
        expected = reference_inputs(folder, [image], text)
        ids, _ = engine.image_prompt(text, [image])
        assert ids == expected["input_ids"][0].tolist(), (height, width)
        pixels, ours = granite_docling_images.pixel_values(engine.vision, image)
        assert ours == grid
        torch.testing.assert_close(pixels, expected["pixel_values"][0], atol=1e-5, rtol=0)
        assert abs(engine.image_tokens(image) - len(ids) + len(engine.tokenizer.encode(text))) <= 2


def test_the_folder_matches_transformers(model, engine, images, reference):
    check_matches_transformers(model, engine, images, reference)
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits(engine, ids), expected, atol=1e-4, rtol=0)


def test_the_fine_path_and_the_spread_rule_match_transformers(model, images, tmp_path):
    settings = {"fine_route": True, **DENSE}
    folder = save_granite_docling_dir(model, tmp_path, **settings)
    engine = api.load(str(folder), device="cpu", vision=True)
    wide = open_image(picture(100, 250, 4))
    assert granite_docling_images.tile_grid(engine.vision, 100, 250) == (2, 5)
    pages = [images[0], wide]
    text = engine.prompt_text(QUESTION, images=len(pages))
    check_matches_transformers(
        model, engine, pages, reference_inputs(folder, pages, text, **settings)
    )


def test_a_position_embedding_in_vit_maes_layout_fails(
    model, engine, images, reference, monkeypatch
):
    table = granite_docling_vision.position_embedding

    def rows_first(dim, side):
        return table(dim, side).roll(dim // 2, -1)

    monkeypatch.setattr(granite_docling_vision, "position_embedding", rows_first)
    ids, prompt_images = prompt(engine, images)
    features = soft_tokens(ids, prompt_images)
    assert (features - expected_features(model, reference)).abs().max() > 1e-2

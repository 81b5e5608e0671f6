"""Granite Docling (ibm-granite/granite-docling-258M) with images against transformers.
The Hub's checkpoint is an Idefics3ForConditionalGeneration (model_type idefics3, Llama
text, a SigLIP tower on tiles of 512 patches of 16, pixel-shuffled by 4), and llama.cpp's
converter writes it as SmolVLM's (conversion/smolvlm.py: projector type idefics3), so it
runs on the Idefics3 code; what sets it apart from SmolVLM is the Idefics3 config and
processor and the shuffle by 4. A tiny random Idefics3ForConditionalGeneration of that
shape (tiles of 32 pixels, patches of 4, shuffled by 4: 4 tokens a tile, tied
embeddings) and transformers' Idefics3Processor make the reference: prompt ids equal,
pixels within 1e-6, image features and logits within 1e-4, 8 greedy tokens equal, from
the folder and from a text GGUF plus an mmproj GGUF. A pixel shuffle in another order
fails.

transformers' own model_type granite_docling (ibm-granite/granite-for-docling-500m:
DeepStack mergers, Granite text, GOT-OCR2 tiling) is another architecture, checked in
tests/models/test_granite_docling.py.
"""

import pytest
import torch
from helpers import randomize
from smolvlm_helpers import (
    IMAGE,
    LONGEST_EDGE,
    MEAN_STD,
    TILE,
    TILE_TOKENS,
    VOCAB,
    greedy_tokens,
    save_smolvlm_dir,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, idefics3_images, vision_families
from llmrun.images import open_image
from llmrun.models import idefics3_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
PATCH, SCALE = 4, 4
QUESTION = "Convert this page to docling."
# Resized to 64 pixels on the longest side, then cut into tiles of 32: 40x64 (height x
# width) makes 2x2 tiles, 30x90 1x2, 100x17 2x1.
SHAPES = {(40, 64): (2, 2), (30, 90): (1, 2), (100, 17): (2, 1)}


@pytest.fixture(scope="module")
def model():
    text = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    vision = dict(
        model_type="idefics3_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
    )
    config = transformers.Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=IMAGE,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    randomize(model)
    return model


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_smolvlm_dir(model, tmp_path_factory.mktemp("granite_docling"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(40, 64, 1)), open_image(picture(30, 90, 2))]


def reference_inputs(folder, images, text: str) -> dict:
    """transformers' Idefics3Processor (its Pillow image processor) on a rendered prompt."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=True,
        image_mean=MEAN_STD,
        image_std=MEAN_STD,
        max_image_size={"longest_edge": TILE},
        size={"longest_edge": LONGEST_EDGE},
        resample=1,
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor,
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        image_seq_len=TILE_TOKENS,
    )
    return dict(processor(text=text, images=images, return_tensors="pt"))


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return reference_inputs(folder, images, engine.prompt_text(QUESTION, images=len(images)))


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(
            reference["pixel_values"], reference["pixel_attention_mask"]
        )
    return torch.cat(out.pooler_output)


def soft_tokens(ids, prompt_images) -> torch.Tensor:
    """The embeddings of a prompt's <image> places, in order."""
    rows = [
        embeds[[ids[start + i] == IMAGE for i in range(len(embeds))]]
        for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True)
    ]
    return torch.cat(rows)


def check_matches_transformers(model, engine, images, reference) -> None:
    """Prompt ids, image features, logits and 8 greedy tokens as transformers'."""
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    features = soft_tokens(ids, prompt_images)
    assert features.shape == (8 * TILE_TOKENS, 64)  # 2x2 tiles, 1x2 tiles, 2 wholes
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    stream = engine.generate(ids, SamplingParams(temperature=0.0), 8, images=prompt_images)
    tokens = [r.token for r in stream if r.token is not None]
    assert tokens == greedy_tokens(model, reference)


def test_the_prompt_and_pixels_are_the_processors(engine, folder):
    assert engine.vision.tile_tokens == TILE_TOKENS
    for (height, width), grid in SHAPES.items():
        image = open_image(picture(height, width, 3))
        text = engine.prompt_text(QUESTION, images=1)
        expected = reference_inputs(folder, [image], text)
        ids, _ = engine.image_prompt(text, [image])
        assert ids == expected["input_ids"][0].tolist(), (height, width)
        pixels, ours = idefics3_images.pixel_values(engine.vision, image)
        assert ours == grid
        torch.testing.assert_close(pixels, expected["pixel_values"][0], atol=1e-6, rtol=0)


def test_the_folder_matches_transformers(model, engine, images, reference):
    check_matches_transformers(model, engine, images, reference)


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)
    assert vision_families.of_mmproj(mmproj).name == "SmolVLM/Idefics3"
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    check_matches_transformers(model, engine, images, reference)


def test_a_pixel_shuffle_in_another_order_fails(model, engine, images, reference, monkeypatch):
    def columns_first(x, scale):
        # each token a square of patches, but its scale² states gathered column by column
        batch, seq, dim = x.shape
        side = int(seq**0.5)
        x = x.view(batch, side // scale, scale, side // scale, scale, dim)
        return x.permute(0, 1, 3, 4, 2, 5).reshape(batch, seq // scale**2, dim * scale**2)

    monkeypatch.setattr(idefics3_vision, "pixel_shuffle", columns_first)
    encoded = idefics3_images.encode(engine.vision, images)
    features = torch.cat([torch.cat([e.tiles.flatten(0, 2), e.whole]) for e in encoded])
    assert (features - image_features(model, reference)).abs().max() > 1e-2

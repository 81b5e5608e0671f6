"""PaddleOCR-VL with images against transformers: a tiny random
PaddleOCRVLForConditionalGeneration (text hidden 64 in 2 layers with uneven M-RoPE sections
[2, 3, 3]; vision hidden 32 in 3 layers, a learned 4x4 position table) whose processor
(PaddleOCRVLProcessor: chat template, <|IMAGE_PLACEHOLDER|> expanded,
PaddleOCRVLImageProcessor's patches) makes the reference inputs. Two images, 56x84 (2x3
merged tokens) and 140x224 (5x8). The patches, the prompt ids, the image features, the
logits (whole, and a chunked prefill through a KV cache) and 8 greedy tokens (decoding
after the images at shifted positions) match; so does the same model as llama.cpp's
converter writes it, a paddleocr text GGUF and an mmproj GGUF.

Tolerances: 1e-4 on f32 image features (about ±3) and logits (about ±7); patches 1e-5."""

import json
import shutil

import pytest
import torch
from paddleocr_vl_helpers import (
    IMAGE,
    PROCESSOR,
    processor,
    processor_inputs,
    save_paddleocr_vl_dir,
    tiny_paddleocr_vl,
    write_mmproj,
    write_text_gguf,
)
from vision_checks import (
    check_engine_with_images,
    check_image_features_each,
    check_m_rope_greedy_then_text,
    check_m_rope_logits,
    check_mmproj_refusals,
    check_run_with_an_image,
)
from vision_helpers import picture

from llmrun import api
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading.paddleocr_vl_vision import from_mmproj
from llmrun.paddleocr_vl_images import pixel_patches

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(transformers model, its folder, an engine with the vision tower)."""
    model = tiny_paddleocr_vl()
    folder = save_paddleocr_vl_dir(model, tmp_path_factory.mktemp("paddleocr_vl"))
    return model, folder, api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(56, 84, 1)), open_image(picture(140, 224, 2))]


@pytest.fixture(scope="module")
def reference(family, images):
    return processor_inputs(family[1], images, QUESTION)


@pytest.fixture(scope="module")
def prompt(family, images):
    engine = family[2]
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def test_the_prompt_and_patches_are_the_processors(family, images, prompt, reference):
    engine = family[2]
    ids, prompt_images = prompt
    assert ids == reference.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == IMAGE != ids[i - 1]]
    assert [len(e) for e in prompt_images.embeds] == [6, 40]
    patches = [pixel_patches(image, engine.vision) for image in images]
    assert [[1, *grid] for _, *grid in patches] == reference.image_grid_thw.tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference.pixel_values.flatten(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [(20, 300), (300, 12), (600, 1000), (30, 500)])
def test_resizing_matches_the_image_processor(size, family):
    """A side shorter than a merged patch stretched first, then within the pixel limits,
    below the least (scaled up) and above the most (down)."""
    image = open_image(picture(*size, seed=3, mode="RGBA"))
    expected = processor(family[1]).image_processor(images=image, return_tensors="pt")
    patches, grid_h, grid_w = pixel_patches(image, family[2].vision)
    assert [1, grid_h, grid_w] == expected.image_grid_thw[0].tolist()
    torch.testing.assert_close(patches, expected.pixel_values.flatten(1), atol=1e-5, rtol=0)


def test_image_features_match_transformers(family, prompt, reference):
    check_image_features_each(family[0], prompt, reference)


def test_logits_with_images_match_transformers(family, prompt, reference):
    check_m_rope_logits(family[0], family[2], prompt, reference)


def test_greedy_tokens_match_transformers_and_text_after_them_too(family, prompt, reference):
    model, folder, engine = family
    check_m_rope_greedy_then_text(model, engine, prompt, reference, processor(folder), QUESTION)


def test_gguf_with_mmproj_matches_transformers(family, images, reference, tmp_path):
    model = family[0]
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    assert engine.vision.min_pixels == PROCESSOR["min_pixels"]
    check_engine_with_images(model, engine, images, reference, QUESTION)
    check_mmproj_refusals(text, mmproj, from_mmproj)


def test_the_hubs_flat_config_takes_images_the_same(family, prompt, reference, tmp_path):
    """PaddlePaddle/PaddleOCR-VL's config.json: the text fields at the top level, M-RoPE
    as rope_scaling, tie_word_embeddings false, and a head of its own, which transformers
    uses (PaddleOCRVLConfig says tied, but ties only a head equal to the embeddings)."""
    from safetensors.torch import load_file, save_file

    folder, engine = family[1:]
    old = shutil.copytree(folder, tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    scaling = {"type": "default", "rope_type": "default", "mrope_section": rope["mrope_section"]}
    flat = {**text, **config, "rope_theta": rope["rope_theta"], "rope_scaling": scaling}
    (old / "config.json").write_text(json.dumps({**flat, "tie_word_embeddings": False}))
    tensors = load_file(old / "model.safetensors")
    torch.manual_seed(5)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"]) * 0.2
    save_file(tensors, old / "model.safetensors", metadata={"format": "pt"})
    theirs = transformers.PaddleOCRVLForConditionalGeneration.from_pretrained(old).eval()
    loaded = api.load(str(old), device="cpu", vision=True)
    ids, prompt_images = prompt
    tower, expected = loaded.vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert all(torch.equal(tower[k], expected[k]) for k in expected)
    with torch.no_grad():
        forward = (torch.tensor([ids]), torch.arange(len(ids))[None])
        ours = loaded.model(*forward, images=prompt_images.tokens(0, len(ids), CPU))[0]
        logits = theirs(**reference).logits[0]
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)


def test_images_need_their_places(family, images):
    engine = family[2]
    places = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|IMAGE_PLACEHOLDER\|>\) for 2"):
        engine.image_prompt(places + "hi", images)
    text = engine.prompt_text(QUESTION, images=1) + "<|IMAGE_PLACEHOLDER|>"
    with pytest.raises(UsageError, match="marks 2 image places"):
        engine.image_prompt(text, images[:1])
    with pytest.raises(UsageError, match="at most 200 times as long as they are wide"):
        pixel_patches(open_image(picture(10, 2100, seed=5)), engine.vision)


def test_run_with_an_image_replies_as_transformers(family, tmp_path):
    check_run_with_an_image(family[0], family[1], tmp_path, processor_inputs, QUESTION)

"""Qwen2.5-VL and Qwen2-VL with images against transformers: tiny random
Qwen2_5_VLForConditionalGeneration and Qwen2VLForConditionalGeneration models (text hidden
64 in 2 layers with uneven M-RoPE sections [2, 3, 3]; vision hidden 32 in 3 blocks, Qwen2.5-VL's
second full and the others windowed over 112 pixels) whose processor (Qwen2_5_VLProcessor:
chat template, <|image_pad|> expanded, Qwen2VLImageProcessor's patches) makes the reference
inputs. Two images, 56x84 (one window of 2x3 merged tokens) and 140x224 (5x8 merged tokens
in four windows, those at the edges cut short). The patches, the prompt ids, the image
features, the logits (whole, and a chunked prefill through a KV cache) and 8 greedy tokens
(decoding after the images at shifted positions) match; so do the same models as llama.cpp's
converter writes them, a qwen2vl text GGUF and an mmproj GGUF.

Tolerances: 1e-4 on f32 image features (about ±3) and logits (about ±7); patches 1e-5."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from qwen2_vl_helpers import (
    IMAGE,
    processor,
    processor_inputs,
    save_qwen_vl_dir,
    tiny_qwen_vl,
    write_mmproj,
    write_text_gguf,
)
from vision_checks import (
    check_chat_with_an_image_in_every_turn,
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
from llmrun.loading.qwen2_vl_vision import MAX_PIXELS, MIN_PIXELS, from_mmproj
from llmrun.qwen2_vl_images import pixel_patches

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")
FAMILIES = ("qwen2_5_vl", "qwen2_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(transformers model, its folder, an engine with the vision tower)."""
    model = tiny_qwen_vl(request.param)
    folder = save_qwen_vl_dir(model, tmp_path_factory.mktemp(request.param))
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
    assert [grid for _, *grid in patches] == reference.image_grid_thw[:, 1:].tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference.pixel_values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [(600, 1000), (30, 500), (1200, 900)])
def test_resizing_matches_qwen2vl_image_processor(size, family):
    """Within the pixel limits, below the least (scaled up) and above the most (down):
    Qwen2VLImageProcessor's defaults, which an mmproj without limits of its own gets."""
    vision = dataclasses.replace(family[2].vision, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image = open_image(picture(*size, seed=3, mode="RGBA"))
    expected = processor(family[1]).image_processor(images=image, return_tensors="pt")
    patches, grid_h, grid_w = pixel_patches(image, vision)
    assert [1, grid_h, grid_w] == expected.image_grid_thw[0].tolist()
    torch.testing.assert_close(patches, expected.pixel_values, atol=1e-5, rtol=0)


def test_image_features_match_transformers(family, prompt, reference):
    check_image_features_each(family[0], prompt, reference)


def test_logits_with_images_match_transformers(family, prompt, reference):
    check_m_rope_logits(family[0], family[2], prompt, reference)


def test_greedy_tokens_match_transformers_and_text_after_them_too(family, prompt, reference):
    model, folder, engine = family
    check_m_rope_greedy_then_text(model, engine, prompt, reference, processor(folder), QUESTION)


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_with_mmproj_matches_transformers(name, images, tmp_path):
    model = tiny_qwen_vl(name)
    folder = save_qwen_vl_dir(model, tmp_path / "folder")
    reference = processor_inputs(folder, images, QUESTION)
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    check_engine_with_images(model, engine, images, reference, QUESTION)
    check_mmproj_refusals(text, mmproj, from_mmproj)


def test_a_quantized_mmproj_matches_its_dequantized_weights(family, images, tmp_path):
    """Q8_0 block matrices, as `llama-quantize` or the converter's --outtype q8_0 write
    them: the tower holds gguf's dequantization of the same blocks."""
    import gguf

    model, _, engine = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    vision = from_mmproj(write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", q8), 64)
    qkv = vision.encoder.state_dict()["blocks.0.attn.qkv.weight"]
    original = model.model.visual.blocks[0].attn.qkv.weight.detach()
    pieces = [
        gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8) for p in original.chunk(3)
    ]
    assert torch.equal(qkv, torch.from_numpy(np.concatenate(pieces)))


def test_an_older_flat_config_takes_images_the_same(family, prompt, tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's Hub config.json files: the text fields at the top
    level, M-RoPE as rope_scaling {"type": "mrope"}."""
    import shutil

    folder, engine = family[1:]
    old = shutil.copytree(folder, tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    scaling = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat = {**text, **config, "rope_theta": rope["rope_theta"], "rope_scaling": scaling}
    (old / "config.json").write_text(json.dumps(flat))
    loaded = api.load(str(old), device="cpu", vision=True)
    ids, prompt_images = prompt
    tower, expected = loaded.vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert all(torch.equal(tower[k], expected[k]) for k in expected)
    with torch.no_grad():
        forward = (torch.tensor([ids]), torch.arange(len(ids))[None])
        ours = loaded.model(*forward, images=prompt_images.tokens(0, len(ids), CPU))
        theirs = engine.model(*forward, images=prompt_images.tokens(0, len(ids), CPU))
    assert torch.equal(ours, theirs)


def test_an_older_scripts_mmproj_loads_the_same_tower(family, tmp_path):
    """MLP matrices named the other way round and feed_forward_length 0, as the files of
    the older conversion script have them (clip.cpp's is_ffn_swapped)."""
    model, _, engine = family
    vision = from_mmproj(write_mmproj(model, tmp_path / "mmproj.gguf", legacy=True), 64)
    loaded, expected = vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_images_need_their_places(family, images):
    engine = family[2]
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image_pad\|>\) for 2"):
        engine.image_prompt("<|vision_start|><|image_pad|><|vision_end|>hi", images)
    text = engine.prompt_text(QUESTION, images=1) + "<|image_pad|>"
    with pytest.raises(UsageError, match="marks 2 image places"):
        engine.image_prompt(text, images[:1])
    with pytest.raises(UsageError, match="at most 200 times as long as they are wide"):
        pixel_patches(open_image(picture(10, 2100, seed=5)), engine.vision)


def test_run_with_an_image_replies_as_transformers(family, tmp_path):
    check_run_with_an_image(family[0], family[1], tmp_path, processor_inputs, QUESTION)


def test_a_chat_with_an_image_replies_as_transformers_in_every_turn(family, tmp_path):
    check_chat_with_an_image_in_every_turn(family[0], family[1], tmp_path, processor_inputs)

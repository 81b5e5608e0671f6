"""GLM-4.1V with images against transformers: a tiny random Glm4vForConditionalGeneration
(text hidden 64 in 2 layers, half of each 32-feature head turned by M-RoPE in uneven
sections [2, 3, 3]; vision hidden 32 in 2 blocks, an 8x8 grid of learned positions) whose
processor (Glm4vProcessor: chat template, <|image|> expanded, Glm4vImageProcessor's
patches) makes the reference inputs. Two images, 56x84 (scaled up past the least pixel
count to 6x8 patches, 3x4 merged tokens) and 140x224 (5x8 merged tokens): the patches, the
prompt ids, the image features, the logits (whole, and a chunked prefill through a KV
cache) and 8 greedy tokens (decoding after the images at shifted positions) match; so do
the same model's files as llama.cpp's converter writes them, a glm4 text GGUF and an
mmproj GGUF (laid out as `convert_hf_to_gguf.py --mmproj` wrote this model's).

Tolerances: 1e-4 on f32 image features (about ±15) and logits (about ±7); patches 1e-5."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from glm4v_helpers import (
    IMAGE,
    processor,
    processor_inputs,
    save_glm4v_dir,
    tiny_glm4v,
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
from llmrun.glm4v_images import pixel_patches
from llmrun.images import open_image
from llmrun.loading.glm4v_vision import MAX_PIXELS, MIN_PIXELS, from_mmproj
from llmrun.models import glm4v_vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model():
    return tiny_glm4v()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glm4v_dir(model, tmp_path_factory.mktemp("glm4v"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(56, 84, 1)), open_image(picture(140, 224, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def test_the_prompt_and_patches_are_the_processors(engine, images, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == IMAGE != ids[i - 1]]
    assert [len(e) for e in prompt_images.embeds] == [12, 40]
    assert [engine.image_tokens(image) for image in images] == [12, 40]
    patches = [pixel_patches(image, engine.vision) for image in images]
    assert [grid for _, *grid in patches] == reference.image_grid_thw[:, 1:].tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference.pixel_values, atol=1e-5, rtol=0)


# (height, width), the processor's most pixels (None: its default).
RESIZES = [((600, 1000), None), ((20, 500), None), ((30, 30), None), ((600, 1000), 100000)]


@pytest.mark.parametrize(("size", "most"), RESIZES)
def test_resizing_matches_glm4v_image_processor(size, most, folder, engine):
    """Within the pixel limits, a side below the patch group (scaled up to it), below the
    least pixels (up), above the most (down): Glm4vImageProcessor's limits, its defaults
    (which an mmproj gets) or fewer."""
    limits = dict(min_pixels=MIN_PIXELS, max_pixels=most or MAX_PIXELS)
    vision = dataclasses.replace(engine.vision, **limits)
    image = open_image(picture(*size, seed=3, mode="RGBA"))
    made = processor(folder).image_processor
    size_kwargs = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": limits["max_pixels"]}}
    expected = made(images=image, return_tensors="pt", **size_kwargs)
    patches, grid_h, grid_w = pixel_patches(image, vision)
    assert [1, grid_h, grid_w] == expected.image_grid_thw[0].tolist()
    torch.testing.assert_close(patches, expected.pixel_values, atol=1e-5, rtol=0)


def test_image_features_match_transformers(model, prompt, reference):
    check_image_features_each(model, prompt, reference)


def test_position_embeddings_resampled_otherwise_miss(engine, images, monkeypatch):
    """The learned positions taken bilinearly, corners aligned (Qwen3-VL's way), instead
    of bicubically at the patches' centres: the features move."""
    expected = engine.encode_images(images[:1])[0]

    def bilinear(self, grid_h, grid_w):
        side = int(self.args.num_position_embeddings**0.5)
        table = self.position_embedding.weight.view(side, side, -1).permute(2, 0, 1)[None]
        resized = torch.nn.functional.interpolate(
            table, (grid_h, grid_w), mode="bilinear", align_corners=True
        )[0].permute(1, 2, 0)
        grouped = resized.reshape(grid_h // 2, 2, grid_w // 2, 2, -1).transpose(1, 2)
        return grouped.reshape(grid_h * grid_w, -1)

    monkeypatch.setattr(glm4v_vision.Embeddings, "forward", bilinear)
    wrong = engine.encode_images(images[:1])[0]
    assert (wrong - expected).abs().max() > 1e-2


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    check_m_rope_logits(model, engine, prompt, reference)


def test_greedy_tokens_match_transformers_and_text_after_them_too(
    model, folder, engine, prompt, reference
):
    # generate() goes past stories260K's </s> (2), where llmrun stops.
    made = processor(folder)
    check_m_rope_greedy_then_text(model, engine, prompt, reference, made, QUESTION, eos=2)


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    check_engine_with_images(model, engine, images, reference, QUESTION)
    check_mmproj_refusals(text, mmproj, from_mmproj)


def test_a_quantized_mmproj_matches_its_dequantized_weights(model, tmp_path):
    """Q8_0 block matrices, as `llama-quantize` or the converter's --outtype q8_0 write
    them: the tower holds gguf's dequantization of the same blocks."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    vision = from_mmproj(write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", q8), 64)
    qkv = vision.encoder.state_dict()["blocks.0.attn.qkv.weight"]
    original = model.model.visual.blocks[0].attn.qkv.weight.detach().numpy()
    expected = gguf.quants.dequantize(gguf.quants.quantize(original, q8), q8)
    assert torch.equal(qkv, torch.from_numpy(np.ascontiguousarray(expected)))


def test_images_need_their_places(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image\|>\) for 2"):
        engine.image_prompt("<|begin_of_image|><|image|><|end_of_image|>hi", images)
    text = engine.prompt_text(QUESTION, images=1) + "<|image|>"
    with pytest.raises(UsageError, match="marks 2 image places"):
        engine.image_prompt(text, images[:1])
    with pytest.raises(UsageError, match="at most 200 times as long as they are wide"):
        pixel_patches(open_image(picture(28, 6000, seed=5)), engine.vision)


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    check_run_with_an_image(model, folder, tmp_path, processor_inputs, QUESTION)


def test_glm4v_moe_takes_images_as_transformers(images, tmp_path):
    """GLM-4.5V (Glm4vMoeForConditionalGeneration): the same tower and prompts, its
    language model GLM-4.5's experts with M-RoPE over the halves of the rotated features."""
    model = tiny_glm4v(moe=True)
    folder = save_glm4v_dir(model, tmp_path / "glm4v-moe")
    reference = processor_inputs(folder, images, QUESTION)
    engine = api.load(str(folder), device="cpu", vision=True)
    check_engine_with_images(model, engine, images, reference, QUESTION)


def test_a_chat_with_an_image_replies_as_transformers_in_every_turn(model, folder, tmp_path):
    check_chat_with_an_image_in_every_turn(model, folder, tmp_path, processor_inputs)


def test_a_language_model_without_m_rope_takes_no_images(folder, images, tmp_path):
    """A GLM-4V folder whose text_config has no mrope_section: its text runs, but its
    image tokens could only turn as plain text, so images are refused."""
    import shutil

    plain = shutil.copytree(folder, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_section"]
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="GLM-OCR's images go to its own language model"):
        api.load(str(plain), device="cpu", vision=True)

"""Qianfan-OCR (InternVL's encoder and tiles, its layers under their own names, Qwen3 text)
with images against transformers: a tiny random QianfanOCRForConditionalGeneration (text
hidden 64 in 2 layers; vision hidden 32 in 2 layers on 64-pixel tiles of 8-pixel patches,
16 tokens a tile, up to 4 tiles; internvl_helpers) whose QianfanOCRProcessor (a chat
template that marks an image <image>, expanded to <img>, <IMG_CONTEXT>s, </img>;
GotOcr2ImageProcessor's Pillow tiles) makes the reference inputs. Two images, 48x150 (3
tiles in a row and a thumbnail) and 100x60 (2 tiles in a column and a thumbnail): the
tiles, the prompt ids, the image features, the logits (whole, and a chunked prefill
through a KV cache) and 8 greedy tokens match, from the folder and through `llmrun run
--image`. The folder's weights are the Hub's (the original InternVL-chat names), as
transformers loads them. The layers' two norms swapped fail. llama.cpp has no Qianfan-OCR
converter: no GGUF or mmproj.

Tolerances: ids exact; tiles 1e-5 (exact here); features and logits 1e-4 (about ±8).
"""

import json

import pytest
import torch
from internvl_helpers import (
    IMG_CONTEXT,
    IMG_END,
    IMG_START,
    TOKENS_PER_TILE,
    greedy_tokens,
    processor_inputs,
    save_qianfan_ocr_dir,
    tiny_internvl,
)
from vision_checks import logits
from vision_helpers import picture

from llmrun import api, internvl_images, vision_families
from llmrun.errors import UnsupportedError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading import internvl_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model():
    return tiny_internvl(text_type="qwen3", family="QianfanOCR")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qianfan_ocr_dir(model, tmp_path_factory.mktemp("qianfan_ocr"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(48, 150, 1)), open_image(picture(100, 60, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def image_features(model, pixels) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(pixels).pooler_output.flatten(0, 1)


def test_the_prompt_and_tiles_are_the_processors(engine, images, prompt, reference):
    assert vision_families.of_vision(engine.vision).name == "Qianfan-OCR"
    assert "<image>" in engine.prompt_text(QUESTION, images=1)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    # 3 tiles and a thumbnail, then 2 tiles and a thumbnail, between <img> and </img>.
    assert [len(e) for e in prompt_images.embeds] == [4 * TOKENS_PER_TILE, 3 * TOKENS_PER_TILE]
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start - 1] == IMG_START and ids[start + len(embeds)] == IMG_END
        assert set(ids[start : start + len(embeds)]) == {IMG_CONTEXT}
    tiles = torch.cat([internvl_images.pixel_values(engine.vision, image) for image in images])
    torch.testing.assert_close(tiles, reference["pixel_values"], atol=1e-5, rtol=0)


def test_features_logits_and_greedy_tokens_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    expected_features = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(
        torch.cat(prompt_images.embeds), expected_features, atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    assert 2 < expected.abs().max() < 10
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == greedy_tokens(model, reference)


def test_the_hub_s_layout_is_what_transformers_loads(model, folder):
    loaded = transformers.QianfanOCRForConditionalGeneration.from_pretrained(folder)
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.state_dict().items())


def test_norms_read_the_wrong_way_round_fail(model, folder, images, reference, monkeypatch):
    """Planted: each layer's norm1 read as its second norm, norm2 as its first."""
    monkeypatch.setitem(internvl_vision._ORIGINAL_LAYER, "norm1.", "layernorm_after.")
    monkeypatch.setitem(internvl_vision._ORIGINAL_LAYER, "norm2.", "layernorm_before.")
    vision = internvl_vision.qianfan_from_hf_dir(folder, 64)
    features = torch.cat(internvl_images.encode(vision, images))
    assert (features - image_features(model, reference["pixel_values"])).abs().max() > 1e-2


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` from the folder."""
    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(48, 150, seed=4))
    reference = processor_inputs(folder, [Image.open(image).convert("RGB")], QUESTION)
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    expected = greedy_tokens(model, reference)
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected


def test_places_must_match_the_images_and_there_is_no_mmproj(engine, images, tmp_path):
    text = "<|im_start|>user\n<image>\ntwo?<|im_end|>\n"
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2"):
        engine.image_prompt(text, images)
    with pytest.raises(UnsupportedError, match="no Qianfan-OCR projector"):
        internvl_vision.qianfan_from_mmproj(tmp_path / "mmproj.gguf", 64)

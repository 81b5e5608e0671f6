"""Unlimited-OCR with images against transformers: a tiny random
UnlimitedOcrForConditionalGeneration (SAM ViT with windowed and global layers, CLIP over
SAM's features, a DeepSeek MoE text) and UnlimitedOcrProcessor (with DeepSeek-OCR 2's
Pillow image processor under Unlimited-OCR's settings: unlimited_ocr_helpers) make the
reference inputs. Of the two images, the 1200x800 one is over a crop's 640 pixels: six
crops (3 x 2) laid out as one 20x30 grid, each row closed by a newline, then the whole
view's 16x16 grid the same way and the view separator, 20 * 31 + 16 * 17 + 1 tokens; the
360x480 one takes the whole view only. The prompt ids, the pixel values of every view, the
image features, the logits and 8 greedy tokens match; so do the same model as a
deepseek2-ocr text GGUF and an mmproj GGUF of projector type deepseekocr laid out as
llama.cpp's converter writes them, and `llmrun run --image` from either. The crops'
grids laid out crop by crop instead of side by side fail.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
from deepseek_ocr2_helpers import (
    check_gguf_with_mmproj,
    check_logits_and_tokens,
    check_run_with_an_image,
    image_prompt,
    transformers_logits_and_tokens,
    write_text_gguf,
)
from unlimited_ocr_helpers import (
    IMAGE,
    SLIDING_WINDOW,
    processor_inputs,
    save_unlimited_ocr_dir,
    tiny_unlimited_ocr,
    write_mmproj,
)
from vision_helpers import picture

from llmrun import api
from llmrun.deepseek_ocr2_images import views
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading.unlimited_ocr_vision import UnlimitedOcrVision
from llmrun.unlimited_ocr_images import prompt as prompt_for

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is written here?"
SIZES = [(800, 1200), (480, 360)]  # (height, width)
TOKENS = [20 * 31 + 16 * 17 + 1, 16 * 17 + 1]


@pytest.fixture(scope="module")
def model():
    return tiny_unlimited_ocr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_unlimited_ocr_dir(model, tmp_path_factory.mktemp("unlimited_ocr"))


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
def hf_images(model, reference):
    """transformers' image features of the reference's pixels, computed once."""
    with torch.no_grad():
        return model.model.get_image_features(
            reference["pixel_values"],
            reference["pixel_values_local"],
            reference["num_local_patches"],
            reference["patches_grid"],
            return_dict=True,
        )


@pytest.fixture(scope="module")
def expected(model, reference, hf_images):
    return transformers_logits_and_tokens(model, reference, hf_images)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return image_prompt(engine, images, QUESTION)


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt, reference):
    assert isinstance(engine.vision, UnlimitedOcrVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    assert [engine.image_tokens(image) for image in images] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start : start + count] == [IMAGE] * count
    assert reference["num_local_patches"] == [6, 0]
    crops, whole = views(engine.vision, images[0])
    torch.testing.assert_close(crops, reference["pixel_values_local"], atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, reference["pixel_values"][0], atol=1e-5, rtol=0)
    crops, whole = views(engine.vision, images[1])
    assert crops is None
    torch.testing.assert_close(whole, reference["pixel_values"][1], atol=1e-5, rtol=0)


def test_image_features_match_transformers(prompt, hf_images):
    for ours, theirs in zip(prompt[1].embeds, hf_images.pooler_output, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_crops_laid_out_one_by_one_fail(engine, images, hf_images):
    """The six crops' grids each in turn, rows closed by newlines, instead of side by side."""
    vision = engine.vision
    crops, _ = views(vision, images[0])
    with torch.no_grad():
        grids = vision.encoder(crops)  # [6, 10, 10, hidden]
    newline = vision.encoder.image_newline.expand(6, 10, 1, -1)
    planted = torch.cat([grids, newline], dim=2).flatten(0, 2)
    theirs = hf_images.pooler_output[0][: len(planted)]
    assert planted.shape == theirs.shape
    assert (planted - theirs).abs().max() > 0.1


def test_logits_and_greedy_tokens_match_transformers(engine, prompt, expected):
    check_logits_and_tokens(engine, *prompt, expected)


def test_gguf_with_mmproj_matches_transformers(model, folder, images, prompt, expected, tmp_path):
    text = write_text_gguf(model, folder, tmp_path / "model.gguf", SLIDING_WINDOW)
    mmproj = write_mmproj(model, folder, tmp_path / "mmproj.gguf", f16=False)
    check_gguf_with_mmproj(text, mmproj, "Unlimited-OCR", images, prompt, expected, QUESTION)


def test_image_places_must_match_the_images(engine, prompt):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2"):
        prompt_for(engine.tokenizer, "<image>\ntwo?", prompt[1].embeds)
    with pytest.raises(UsageError, match="too thin"):
        engine.image_tokens(open_image(picture(3000, 1, 5)))  # 0x1024 whole


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """From the folder and from a GGUF with its mmproj file (F16 matrices, as the
    converter writes them by default); without --image the language model alone."""
    gguf = write_text_gguf(model, folder, tmp_path / "model.gguf", SLIDING_WINDOW)
    mmproj = write_mmproj(model, folder, tmp_path / "mmproj.gguf")
    check_run_with_an_image(
        model, folder, gguf, mmproj, processor_inputs, QUESTION, "Unlimited-OCR"
    )

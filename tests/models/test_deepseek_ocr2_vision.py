"""DeepSeek-OCR 2 with images against transformers: a tiny random
DeepseekOcr2ForConditionalGeneration (SAM ViT with windowed and global layers, learned
queries through a Qwen2 layer, a DeepSeek MoE text) and DeepseekOcr2Processor (its image
processor's Pillow backend) make the reference inputs. Of the two images, the 1200x800 one
is over a crop's 768 pixels: six crops (3 x 2) and the whole view, 6 * 144 + 256 + 1
tokens; the 360x480 one takes the whole view only. The prompt ids, the pixel values of
every view, the image features, the logits and 8 greedy tokens match; so do the same
model as a deepseek2-ocr text GGUF and an mmproj GGUF laid out as llama.cpp's converter
writes them (deepseek_ocr2_helpers; checked once against the converter itself, equal
tensors and metadata) and `llmrun run --image` from either. The whole view padded at its
corner instead of centred fails.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
from deepseek_ocr2_helpers import (
    IMAGE,
    check_gguf_with_mmproj,
    check_logits_and_tokens,
    check_run_with_an_image,
    image_prompt,
    processor_inputs,
    save_deepseek_ocr2_dir,
    tiny_deepseek_ocr2,
    transformers_logits_and_tokens,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api
from llmrun.deepseek_ocr2_images import prompt as prompt_for
from llmrun.deepseek_ocr2_images import views
from llmrun.errors import UsageError
from llmrun.images import normalized, open_image
from llmrun.loading.deepseek_ocr2_vision import DeepseekOcr2Vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is written here?"
SIZES = [(800, 1200), (480, 360)]  # (height, width)
TOKENS = [6 * 144 + 256 + 1, 256 + 1]


@pytest.fixture(scope="module")
def model():
    return tiny_deepseek_ocr2()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_deepseek_ocr2_dir(model, tmp_path_factory.mktemp("deepseek_ocr2"))


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
            return_dict=True,
        )


@pytest.fixture(scope="module")
def expected(model, reference, hf_images):
    return transformers_logits_and_tokens(model, reference, hf_images)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return image_prompt(engine, images, QUESTION)


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt, reference):
    assert isinstance(engine.vision, DeepseekOcr2Vision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    assert [engine.image_tokens(image) for image in images] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start : start + count] == [IMAGE] * count
    assert reference["num_local_patches"].tolist() == [6, 0]
    crops, whole = views(engine.vision, images[0])
    torch.testing.assert_close(crops, reference["pixel_values_local"], atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, reference["pixel_values"][0], atol=1e-5, rtol=0)
    crops, whole = views(engine.vision, images[1])
    assert crops is None
    torch.testing.assert_close(whole, reference["pixel_values"][1], atol=1e-5, rtol=0)


def test_image_features_match_transformers(prompt, hf_images):
    for ours, theirs in zip(prompt[1].embeds, hf_images.pooler_output, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_the_whole_view_padded_at_its_corner_fails(engine, images, reference):
    """The narrow image's whole view pasted at the top left of its square, not centred."""
    from PIL import Image

    vision, image = engine.vision, images[1]
    square = Image.new("RGB", (vision.size, vision.size), vision.background)
    width = round(image.width * vision.size / image.height)
    square.paste(image.resize((width, vision.size), Image.Resampling.BICUBIC), (0, 0))
    planted = normalized(square, vision.mean, vision.std)
    assert (planted - reference["pixel_values"][1]).abs().max() > 0.5


def test_logits_and_greedy_tokens_match_transformers(engine, prompt, expected):
    check_logits_and_tokens(engine, *prompt, expected)


def test_gguf_with_mmproj_matches_transformers(model, folder, images, prompt, expected, tmp_path):
    text = write_text_gguf(model, folder, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, folder, tmp_path / "mmproj.gguf", f16=False)
    check_gguf_with_mmproj(text, mmproj, "DeepSeek-OCR 2", images, prompt, expected, QUESTION)


def test_image_places_must_match_the_images(engine, prompt):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2"):
        prompt_for(engine.tokenizer, "<image>\ntwo?", prompt[1].embeds)
    with pytest.raises(UsageError, match="too thin"):
        engine.image_tokens(open_image(picture(3000, 1, 5)))  # 0x1024 whole


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """From the folder and from a GGUF with its mmproj file (F16 matrices, as the
    converter writes them by default); without --image the language model alone."""
    gguf = write_text_gguf(model, folder, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, folder, tmp_path / "mmproj.gguf")
    check_run_with_an_image(
        model, folder, gguf, mmproj, processor_inputs, QUESTION, "DeepSeek-OCR 2"
    )

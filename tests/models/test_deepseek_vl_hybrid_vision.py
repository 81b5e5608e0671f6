"""DeepSeek-VL 7B's hybrid encoder with images against transformers: a tiny random
DeepseekVLHybridForConditionalGeneration (SigLIP and SAM towers, the second neck, the
joined aligner, Llama text) and DeepseekVLHybridProcessor (its image processor's Pillow
backend: the image padded square at the SAM tower's size, that square resized for SigLIP)
make the reference inputs. Two images of other aspects: the prompt ids, both pixel values,
the image features, the logits (whole and prefilled in chunks), 8 greedy tokens and a
text-only prompt match; `run --image`, `chat` and `serve` reply with transformers' tokens.
Features with the high-resolution side joined after the low one differ.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
from deepseek_vl_helpers import (
    IMAGE,
    PER_IMAGE,
    QUESTION,
    SIZES,
    processor_inputs,
    save_deepseek_vl_dir,
    tiny_deepseek_vl,
)
from exaone4_5_helpers import greedy_tokens
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
)
from vision_helpers import picture

from llmrun import api, deepseek_vl_hybrid_images, vision_families
from llmrun.images import open_image

pytest.importorskip("transformers")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def model():
    model = tiny_deepseek_vl(hybrid=True)
    # transformers starts alpha at 0; a trained one is not, and the global path must count.
    with torch.no_grad():
        model.model.high_res_vision_alpha.fill_(0.7)
    return model


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_deepseek_vl_dir(model, tmp_path_factory.mktemp("deepseek_vl_hybrid"), hybrid=True)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION, hybrid=True)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(
            reference["pixel_values"], reference["high_res_pixel_values"]
        )
    return out.pooler_output.flatten(0, 1)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "DeepSeek-VL (hybrid)"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == [PER_IMAGE, PER_IMAGE]
    for start in prompt_images.starts:
        assert ids[start : start + PER_IMAGE] == [IMAGE] * PER_IMAGE
    assert engine.image_tokens(images[0]) == PER_IMAGE
    for i, image in enumerate(images):
        low, high = deepseek_vl_hybrid_images.pixel_values(image, engine.vision)
        torch.testing.assert_close(low, reference["pixel_values"][i], atol=1e-5, rtol=0)
        torch.testing.assert_close(high, reference["high_res_pixel_values"][i], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)
    check_text_only_prompt(model, engine, QUESTION)


def test_the_high_resolution_side_joined_last_differs(engine, images, reference, model):
    """Planted: the aligner joins [low, high] where DeepseekVLHybridAligner joins
    [high, low]."""
    encoder = engine.vision.encoder
    aligner = encoder.aligner
    with torch.no_grad():
        ours = []
        for image in images:
            low, high = deepseek_vl_hybrid_images.pixel_values(image, engine.vision)
            last, first_global = encoder.high_res_vision_model.vision_encoder(high[None])
            grid = encoder.high_res_vision_proj(last) + encoder.high_res_vision_alpha * (
                encoder.high_res_vision_proj(encoder.high_res_vision_neck(first_global))
            )
            high_tokens = aligner.high_res_vision_proj(grid.flatten(2).transpose(1, 2))
            low_tokens = aligner.vision_proj(encoder.vision_model(low[None]))
            joined = torch.cat([low_tokens, high_tokens], dim=-1)
            ours.append(aligner.proj(torch.nn.functional.gelu(joined))[0])
    assert (torch.cat(ours) - image_features(model, reference)).abs().max() > 1e-2


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(60, 90, seed=6))
    inputs = processor_inputs(folder, [Image.open(image)], QUESTION, hybrid=True)
    expected = greedy_tokens(model, inputs)
    assert len(expected) == 8 and len(set(expected)) > 1
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "DeepSeek-VL")

"""Ovis2.5 with images against transformers: a tiny random Ovis2_5ForConditionalGeneration
(ovis2_5_helpers: a NaViT SigLIP 2 of patch 8, windows of 4x4 merged tokens in its first
layer, a visual vocabulary of 36 plus 4 indicators, a Qwen3) and Ovis2_5Processor
(Ovis2_5ImageProcessorPil) make the reference inputs. Two images that fit one window
(60x50 -> 64x48, 4x3 merged tokens; 10x40, under a merged token high, -> 16x64, 1x4):
the prompt ids (start token, one image token per merged token, end token), the pixel
values, the image features, the start and end embeddings, the logits of the prompt (whole,
and prefilled in chunks) and 8 greedy tokens match; so do the logits of a text-only prompt.
A 100x120 image (96x128, 6x8 merged tokens in four windows) gives transformers' features,
which transformers 5.25 orders window by window where Ovis2.5's own code (and llmrun)
orders them row by row (llmrun.models.ovis2_5_vision). `run --image` and `chat --image`
reply with transformers' tokens; the text alone runs with a note. Start and end
embeddings swapped move the logits; every layer attending to the whole image moves the
larger image's features.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import dataclasses
import json

import pytest
import torch
from exaone4_5_helpers import greedy_tokens
from in_process import llmrun
from ovis2_5_helpers import (
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    processor_inputs,
    save_ovis2_5_dir,
    tiny_ovis2_5,
)
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.ovis2_5_vision import Ovis25Vision
from llmrun.models import ovis2_5_vision
from llmrun.ovis2_5_images import pixel_patches
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What is in these pictures?"
SIZES = [(60, 50), (10, 40)]
TOKENS = [12, 4]


@pytest.fixture(scope="module")
def model():
    return tiny_ovis2_5()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_ovis2_5_dir(model, tmp_path_factory.mktemp("ovis2_5"))


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


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    return torch.cat(out.pooler_output)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert isinstance(engine.vision, Ovis25Vision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == [n + 2 for n in TOKENS]
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start : start + count + 2] == [IMAGE_START, *[IMAGE] * count, IMAGE_END]
    assert reference["image_grid_thw"].tolist() == [[1, 8, 6], [1, 2, 8]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat([e[1:-1] for e in prompt_images.embeds])
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        indicators = model.model.multi_modal_projector.get_visual_indicator_features(CPU)
    for embeds in prompt_images.embeds:
        torch.testing.assert_close(embeds[[0, -1]], indicators[:2], atol=1e-6, rtol=0)
    with torch.no_grad():
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected_logits[-1], atol=1e-4, rtol=0)
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8 and len(set(expected)) > 1
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected


def test_a_larger_image_s_features_are_transformers_row_by_row(model, engine, folder):
    """transformers' features come window by window (get_vision_window_index's order);
    llmrun's row by row, as Ovis2.5's own VisualTokenizer and vLLM give them."""
    from transformers.vision_utils import get_vision_window_index

    image = open_image(picture(100, 120, 3))
    reference = processor_inputs(folder, [image], QUESTION)
    grid = reference["image_grid_thw"]
    assert grid.tolist() == [[1, 12, 16]]
    config = model.config.vision_config
    window_index, bounds = get_vision_window_index(grid, 2, config.window_size, config.patch_size)
    assert len(bounds) == 5  # four windows
    family = vision_families.of_vision(engine.vision)
    ours = family.encode(engine.vision, [image])[0][1:-1]
    expected = image_features(model, reference)
    torch.testing.assert_close(ours[window_index], expected, atol=1e-4, rtol=0)
    args = vars(engine.vision.encoder.args) | {"layer_types": ["full_attention"] * 2}
    whole = ovis2_5_vision.VisionModel(ovis2_5_vision.EncoderArgs(**args))
    whole.load_state_dict(engine.vision.encoder.state_dict())
    without_windows = dataclasses.replace(engine.vision, encoder=whole)
    features = family.encode(without_windows, [image])[0][1:-1]
    assert (features[window_index] - expected).abs().max() > 1e-2


def test_a_text_only_prompt_is_transformers(model, engine):
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_swapped_start_and_end_embeddings_move_the_logits(
    engine, prompt, expected_logits, monkeypatch
):
    ids, prompt_images = prompt
    swapped = [torch.cat([e[-1:], e[1:-1], e[:1]]) for e in prompt_images.embeds]
    monkeypatch.setattr(prompt_images, "embeds", swapped)
    assert (logits(engine, ids, prompt_images) - expected_logits).abs().max() > 1e-2


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` from the
    folder; the folder's text alone with its usual note."""
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    image = tmp_path / "photo.png"
    image.write_bytes(picture(60, 64, seed=6))  # 4x4 merged tokens: one window
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    options = ("--image", str(image), "-n", "8", "--temperature", "0")
    chat = llmrun("chat", str(folder), *options, input=QUESTION)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == load_tokenizer(folder).decode(expected) + "\n\n"
    result = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "a multimodal Ovis2.5; running its language model" in result.stderr

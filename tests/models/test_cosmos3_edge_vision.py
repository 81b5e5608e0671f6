"""Cosmos3 Edge with images against transformers: a tiny random
Cosmos3EdgeForConditionalGeneration (a SigLIP 2 tower whose 6x6 table of positions each
image resamples, Qwen3.5's patch merger; a Llama-like language model with an ungated relu²
MLP turned by interleaved M-RoPE over uneven sections) saved in the Hub's layout, and
Cosmos3EdgeProcessor (Cosmos3EdgeImageProcessorPil) make the reference inputs. Two images
whose sides the processor rounds to 32 pixels (140x168 -> 8x10 patches, 4x5 merged tokens;
150x60 -> 10x4, 5x2): the prompt ids, the pixel values, the image features, the logits of
the prompt (whole, and prefilled in chunks) and 8 greedy tokens match; so do the logits of
a text-only prompt. `run --image` and `chat --image` reply with transformers' tokens; the
text alone runs with a note. The position table resampled without antialiasing, or the
M-RoPE sections taken in blocks instead of interleaved, move the features or logits.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
import torch.nn.functional as F
from cosmos3_edge_helpers import processor_inputs, save_cosmos3_edge_dir, tiny_cosmos3_edge
from qwen2_vl_helpers import IMAGE, VISION_END, VISION_START
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_and_chat_with_an_image,
    check_text_only_prompt,
    image_features,
    logits,
)
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.cosmos3_edge_images import pixel_patches
from llmrun.images import open_image
from llmrun.loading.cosmos3_edge_vision import Cosmos3EdgeVision
from llmrun.models import cosmos3_edge_vision, mrope

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
SIZES = [(140, 168), (150, 60)]
TOKENS = [20, 10]


@pytest.fixture(scope="module")
def model():
    return tiny_cosmos3_edge()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_cosmos3_edge_dir(model, tmp_path_factory.mktemp("cosmos3_edge"))


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


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert isinstance(engine.vision, Cosmos3EdgeVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1 : start + count + 1] == [VISION_START, *[IMAGE] * count, VISION_END]
    assert reference["image_grid_thw"].tolist() == [[1, 8, 10], [1, 10, 4]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_move_the_features_or_logits(
    model, engine, images, prompt, reference, expected_logits, monkeypatch
):
    """The position table resampled without antialiasing; the M-RoPE sections in blocks
    (Qwen2-VL's) instead of interleaved."""
    expected = image_features(model, reference)
    family = vision_families.of_vision(engine.vision)
    interpolate = F.interpolate
    with monkeypatch.context() as patch:

        def aliased(*args, **kwargs):
            return interpolate(*args, **{**kwargs, "antialias": False})

        patch.setattr(cosmos3_edge_vision.F, "interpolate", aliased)
        features = torch.cat([t.flatten(0, 1) for t in family.encode(engine.vision, images)])
    assert (features - expected).abs().max() > 1e-2
    angles = mrope.angles
    with monkeypatch.context() as patch:
        patch.setattr(mrope, "angles", lambda *args: angles(*args[:4], interleaved=False))
        assert (logits(engine, *prompt) - expected_logits).abs().max() > 1e-2


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` from the
    folder; the folder's text alone with its usual note."""
    check_run_and_chat_with_an_image(
        model, folder, tmp_path, processor_inputs, QUESTION, "Cosmos3 Edge"
    )

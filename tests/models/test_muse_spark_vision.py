"""Muse Spark with images against transformers: a tiny random
MuseSparkForConditionalGeneration (tests/muse_spark_helpers.py), whose vision tower,
adapter and projection are Muse Glimmer's, run by llmrun's Muse Glimmer tower
(tests/models/test_muse_glimmer_vision.py holds that tower's own checks: pixels, windows,
position table). The prompt ids (transformers' Muse Glimmer processor, which Muse Spark's
extends for audio alone), the image features, the logits of a prompt with two images and
8 greedy tokens match; `llmrun run --image` replies as transformers.

Tolerances: features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from helpers import needs_templates
from in_process import llmrun
from muse_glimmer_helpers import greedy_tokens, processor_inputs
from muse_spark_helpers import folder_of, tiny_muse_spark
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.images import open_image
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytestmark = needs_templates  # the chat template is llama.cpp's muse-glimmer.jinja
QUESTION = "What is in the picture?"
SIZES = [(112, 170), (60, 40)]  # 2 x 3 windows of 4 x 4 patches, and one cut short


@pytest.fixture(scope="module")
def model():
    return tiny_muse_spark()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_of(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


def test_features_logits_and_greedy_tokens_match_transformers(model, folder, engine):
    assert vision_families.of_folder(folder).name == "Muse Spark"
    images = [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": QUESTION}]
    ids, prompt_images = engine.image_prompt(
        engine.render([{"role": "user", "content": content}]), images
    )
    reference = processor_inputs(folder, engine.vision, images, QUESTION)
    assert ids == reference["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
        expected = model(**reference).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, torch.cat(out.pooler_output), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    greedy = SamplingParams(temperature=0.0)
    tokens = [r.token for r in engine.generate(ids, greedy, 8, images=prompt_images) if r.token]
    assert len(tokens) == 8
    assert tokens == greedy_tokens(model, reference)


def test_run_with_an_image_replies_as_transformers(model, folder, engine, tmp_path):
    from PIL import Image

    image = tmp_path / "picture.png"
    image.write_bytes(picture(90, 50, seed=6))  # 8 x 4 patches: 4 x 2 tokens
    reference = processor_inputs(folder, engine.vision, [Image.open(image)], QUESTION)
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ids = [e["id"] for e in json.loads(result.stdout)["logprobs"]]
    assert ids == greedy_tokens(model, reference)

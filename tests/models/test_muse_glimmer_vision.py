"""Muse Glimmer with images against transformers: a tiny random
MuseGlimmerForConditionalGeneration (tests/muse_glimmer_helpers.py: a windowed ViT whose
windows are 4 x 4 patches, then a global block, merged 2x2) and MuseGlimmerProcessor.
The image processor needs torchvision, which the suite goes without: llmrun's pixels are
held to what it gave for five images (GOLDEN, checked against it where torchvision is
installed) and then stand in for it. The prompt ids (the chat template's <|patch|>
expanded by the processor's own code), the image features, the logits of a prompt with
two images of other shapes (one of 2 x 3 windows) and 8 greedy tokens match; so does
the same model as llama.cpp's converter writes it (a text GGUF and an mmproj GGUF);
`llmrun run --image` and serve reply as transformers. Reading the position table the
natural way round, or attending over the whole image in every block, fails.

Tolerances: pixels 1e-5 (their checksums over about 10^4 values 1e-3), features and
logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from helpers import needs_converter, needs_templates
from image_serving import check_reply_is_run_s
from muse_glimmer_helpers import (
    GOLDEN,
    GOLDEN_CASES,
    PATCH,
    converted,
    folder_of,
    greedy_tokens,
    pixel_sums,
    processor_inputs,
    processor_record,
    tiny_muse_glimmer,
)
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api, muse_glimmer_images, vision_families
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.muse_glimmer_vision import MuseGlimmerVision
from llmrun.models import muse_glimmer_vision
from llmrun.multimodal import PromptImages
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytestmark = needs_templates  # the chat template is llama.cpp's muse-glimmer.jinja
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in the picture?"
# Under the cap of 24 merged tokens: 112x170 is 8 x 12 patches (2 x 3 windows, 4 x 6
# tokens), 60x40 is 6 x 4 patches (one window cut short, 3 x 2 tokens).
SIZES = [(112, 170), (60, 40)]


@pytest.fixture(scope="module")
def model():
    return tiny_muse_glimmer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_of(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return processor_inputs(folder, engine.vision, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": QUESTION}]
    return engine.image_prompt(engine.render([{"role": "user", "content": content}]), images)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    return torch.cat(out.pooler_output)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def generated(engine, ids, prompt_images) -> list[int]:
    return [r.token for r in engine.generate(ids, GREEDY, 8, images=prompt_images) if r.token]


def test_the_stored_pixels_are_the_processors():
    pytest.importorskip("torchvision")
    assert processor_record() == json.loads(GOLDEN.read_text())


def test_the_pixels_and_the_prompt_are_the_processors(engine, prompt, reference):
    """Each GOLDEN image's grid and pixels (the processor's size under the token cap and
    its Lanczos, or no resize where the size is kept: 28x28); the prompt's ids, each image
    between <|image_start|> and <|image_end|>, one <|patch|> per merged token."""
    assert isinstance(engine.vision, MuseGlimmerVision)
    for (height, width, seed), stored in zip(
        GOLDEN_CASES, json.loads(GOLDEN.read_text()), strict=True
    ):
        image = open_image(picture(height, width, seed))
        patches, grid_h, grid_w = muse_glimmer_images.pixel_patches(image, engine.vision)
        assert [1, grid_h, grid_w] == stored["image_grid_thw"]
        ours = pixel_sums(torch.cat([patches, patches], dim=-1))  # the processor's two slabs
        assert ours == pytest.approx(stored["pixel_sums"], abs=1e-3, rel=0)
        assert muse_glimmer_images.image_tokens(engine.vision, image) == grid_h * grid_w // 4
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert reference["image_grid_thw"].tolist() == [[1, 8, 12], [1, 6, 4]]
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start - 1] == PATCH + 1  # <|image_start|>
        assert ids[start : start + len(embeds) + 1] == [PATCH] * len(embeds) + [PATCH + 2]


def test_features_logits_and_greedy_tokens_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    expected_features = image_features(model, reference)
    torch.testing.assert_close(
        torch.cat(prompt_images.embeds), expected_features, atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 5, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    assert len(tokens) == 8
    assert generated(engine, ids, prompt_images) == tokens


@pytest.mark.parametrize("bug", ["the position table read unswapped", "no windows"])
def test_a_planted_bug_fails(model, engine, images, reference, monkeypatch, bug):
    if bug == "no windows":
        monkeypatch.setattr(
            muse_glimmer_vision, "windows", lambda h, w, side: (torch.arange(h * w), [h * w])
        )
    else:
        taps = muse_glimmer_vision.position_taps
        monkeypatch.setattr(
            muse_glimmer_vision, "position_taps", lambda side, h, w: taps(side, w, h)
        )
    planted = torch.cat(muse_glimmer_images.encode(engine.vision, images))
    assert (planted - image_features(model, reference)).abs().max() > 1e-2


@needs_converter
def test_the_converter_s_gguf_and_mmproj_match_transformers(
    tmp_path_factory, model, engine, images, prompt, reference
):
    """The mmproj's tower is the folder's (1e-5: the q/k rows and the patch embedding come
    back); with the text GGUF, the logits of the processor's prompt and 8 greedy tokens
    are transformers' (the GGUF's vocabulary is the converter's BPE reading of the toy
    tokenizer, so the prompt's ids are the processor's)."""
    files = converted(tmp_path_factory)
    assert vision_families.of_mmproj(files["mmproj"]).name == "Muse Glimmer"
    loaded = api.load(str(files["f32"]), device="cpu", mmproj=files["mmproj"])
    assert isinstance(loaded.vision, MuseGlimmerVision)
    assert loaded.vision.max_tokens == 4096  # clip.cpp's cap: these images fit under 24 anyway
    encoded = muse_glimmer_images.encode(loaded.vision, images)
    torch.testing.assert_close(torch.cat(encoded), torch.cat(prompt[1].embeds), atol=1e-5, rtol=0)
    ids = reference["input_ids"][0].tolist()
    prompt_images = PromptImages(encoded, prompt[1].starts)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(loaded, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(loaded, ids, prompt_images) == greedy_tokens(model, reference)


def test_run_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"` and serve's chat completion with the
    image give transformers' greedy tokens (run's up to its EOS)."""
    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "picture.png"
    image.write_bytes(picture(90, 50, seed=6))  # 8 x 4 patches: 4 x 2 tokens
    reference = processor_inputs(folder, engine.vision, [Image.open(image)], QUESTION)
    expected = greedy_tokens(model, reference)
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ran = [e["id"] for e in json.loads(result.stdout)["logprobs"]]
    assert ran == (expected[: expected.index(2)] if 2 in expected else expected)
    for client in served(engine, "muse_glimmer"):
        reply = chat_reply(client, image.read_bytes(), QUESTION)
        prompt_tokens = reference["input_ids"].shape[1]
        check_reply_is_run_s(reply, engine, (image.read_bytes(), QUESTION), expected, prompt_tokens)

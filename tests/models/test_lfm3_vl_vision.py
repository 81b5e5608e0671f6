"""LFM3-VL with images against transformers: a tiny random Lfm3VlForConditionalGeneration
(a tower of two gated 2D convolution layers and an attention layer with 2 key/value heads
for 4 query heads; LFM3 text with a convolution and an attention layer) and
Lfm3VlProcessor (Qwen2VLImageProcessor's Pillow backend) make the reference inputs. Two
images the processor resizes (120x200 -> 64x128, 2x4 merged tokens; 60x90 -> 64x96, 2x3):
the prompt ids, the pixel values, the image features, the logits of the prompt (whole,
and prefilled in chunks) and 8 greedy tokens match, every token turned by its place in the
prompt. Grouping the key/value heads in turn, or convolving the patches in the
processor's order instead of on their grid, gives other features. `run --image`, `chat`
with /image and serve's chat completions reply with transformers' tokens. llama.cpp
converts no LFM3-VL (nor LFM3 text): folders only.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from image_serving import check_reply_is_run_s
from in_process import llmrun
from lfm3_vl_helpers import (
    IMAGE,
    VISION_END,
    VISION_START,
    greedy_tokens,
    processor_inputs,
    save_lfm3_vl_dir,
    tiny_lfm3_vl,
)
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.lfm3_vl_vision import Lfm3VlVision
from llmrun.models import lfm3_vl_vision
from llmrun.qwen2_vl_images import pixel_patches
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What is in these pictures?"
SIZES = [(120, 200), (60, 90)]
TOKENS = [8, 6]


@pytest.fixture(scope="module")
def model():
    return tiny_lfm3_vl(seed=3)  # whose greedy replies here reach no EOS in 8 tokens


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_lfm3_vl_dir(model, tmp_path_factory.mktemp("lfm3_vl"))


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


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    return torch.cat(out.pooler_output)


def encode(vision, images) -> torch.Tensor:
    return torch.cat(vision_families.of_vision(vision).encode(vision, images))


def test_the_prompt_pixels_features_and_logits_are_transformers(
    model, engine, images, prompt, reference
):
    assert isinstance(engine.vision, Lfm3VlVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1 : start + count + 1] == [VISION_START, *[IMAGE] * count, VISION_END]
    assert reference["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 6]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        got = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image_pad\|>\) for 2"):
        engine.image_prompt("<|im_start|>user\n<|image_pad|>two?<|im_end|>\n", images)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    ids, prompt_images = prompt
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected


def test_planted_bugs_give_other_features(model, engine, images, reference, monkeypatch):
    """Each query head attends with its own group's key/value head (in runs, as
    transformers' repeat_kv), and the convolutions see the patches on their grid: key/value
    heads taken in turn, or the patches convolved in the processor's 2x2-group order, move
    the features."""
    expected = image_features(model, reference)
    assert (encode(engine.vision, images) - expected).abs().max() < 1e-4
    with monkeypatch.context() as patch:
        in_turn = lambda t, n, dim: t.repeat(1, n, 1)  # noqa: E731
        patch.setattr(torch.Tensor, "repeat_interleave", in_turn)
        assert (encode(engine.vision, images) - expected).abs().max() > 1e-2
    with monkeypatch.context() as patch:
        in_order = lambda x, h, w, merge: x.T.reshape(-1, h, w)  # noqa: E731
        patch.setattr(lfm3_vl_vision, "to_grid", in_order)
        patch.setattr(lfm3_vl_vision, "from_grid", lambda x, merge: x.flatten(1).T)
        assert (encode(engine.vision, images) - expected).abs().max() > 1e-2


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"`, `llmrun chat FOLDER` with /image and
    serve's chat completion with the image reply with transformers' greedy tokens (run's
    and chat's up to the EOS); the folder's text alone runs with its note."""
    image = tmp_path / "photo.png"
    image.write_bytes(picture(90, 60, seed=6))
    opened = [open_image(image.read_bytes())]
    reference = processor_inputs(folder, opened, QUESTION)
    expected = greedy_tokens(model, reference)
    kept = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(kept) >= 4
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == kept
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=1), opened)
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in kept) + stream.flush()
    chat = llmrun(
        "chat", folder, "-n", "8", "--temperature", "0", input=f"/image {image}\n{QUESTION}"
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    for client in served(engine, "lfm3_vl"):
        served_reply = chat_reply(client, image.read_bytes(), QUESTION)
        prompt_tokens = reference["input_ids"].shape[1]
        check_reply_is_run_s(served_reply, engine, (image.read_bytes(), QUESTION), expected, prompt_tokens)  # fmt: skip
    text = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert text.returncode == 0, text.stderr
    assert "a multimodal LFM3-VL; running its language model" in text.stderr

"""Gemma 4 Unified with images and audio against transformers: a tiny random
Gemma4UnifiedForConditionalGeneration (gemma4_unified_helpers) whose
Gemma4UnifiedProcessor makes the reference inputs of one message of two images (60
tokens each, far past the sliding window of 8) and a clip (18 frames of 640 samples, the
last one padded). The ids are the processor's; the patches its merged patches and their
positions; the frames its features, exactly; the embeddings the language model takes,
the logits (whole, and through a KV cache: the text before the first image, then the
rest) and 8 greedy tokens match, with images alone and a clip alone too. So does the
model as the converter's text GGUF and mmproj, `run --image --audio` and serve's
image_url and input_audio parts. Planted bugs (images causal on the global
layer, or seen both ways within the window only on the sliding one, the position table's
axes swapped, an mmproj's columns left in im2col's order) move the logits or
embeddings far past the tolerance.

Tolerances: embeddings and f32 logits 1e-4 max abs (measured ~1e-6); pixels 1e-5
(Pillow's resize on both sides).
"""

import base64
import json

import numpy as np
import pytest
import torch
from gemma4_unified_helpers import (
    AUDIO,
    processor_inputs,
    save_gemma4_unified_dir,
    tiny_gemma4_unified,
    write_mmproj,
)
from gemma4_vision_helpers import IMAGE, write_text_gguf
from helpers import needs_templates
from in_process import llmrun
from serving import data_url
from starlette.testclient import TestClient
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, gemma4_images, gemma4_unified_media, mixed_media
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading import gemma4_unified
from llmrun.models.gemma4 import GlobalBothWays
from llmrun.sampling import SamplingParams
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytestmark = needs_templates
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4_unified()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma4_unified_dir(model, tmp_path_factory.mktemp("gemma4-unified"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True, audio=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two PNGs (48x80 and 100x60 pixels: 6x10 and 10x6 tokens of 12-pixel patches) and
    a WAV of 0.7 s at 16 kHz (17.5 frames)."""
    tmp = tmp_path_factory.mktemp("media")
    paths = [tmp / "a.png", tmp / "b.png", tmp / "c.wav"]
    paths[0].write_bytes(picture(48, 80, 1))
    paths[1].write_bytes(picture(100, 60, 2))
    paths[2].write_bytes(wav_bytes(chirp(0.7, 16000, seed=1), 16000))
    return paths


@pytest.fixture(scope="module")
def images(files):
    return [open_image(path.read_bytes()) for path in files[:2]]


@pytest.fixture(scope="module")
def clip(files):
    return audio.open_audio(files[2])


@pytest.fixture(scope="module")
def reference(folder, images, clip):
    return processor_inputs(folder, QUESTION, images, [clip.samples])


@pytest.fixture(scope="module")
def expected(model, reference):
    with torch.no_grad():
        return model(**reference).logits[0]


@pytest.fixture(scope="module")
def prompt(engine, images, clip):
    text = engine.prompt_text(QUESTION, images=len(images), audio=1)
    return engine.media_prompt(text, images, [clip])


def taken_embeddings(model, reference) -> torch.Tensor:
    """The rows transformers' language model takes at the image and audio places."""
    taken = {}

    def keep(module, args, kwargs):
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**reference)
    finally:
        hook.remove()
    ids = reference["input_ids"][0]
    return taken["embeds"][(ids == IMAGE) | (ids == AUDIO)]


def logits(engine, ids, prompt_media, tokens=None) -> torch.Tensor:
    tokens = prompt_media.tokens(0, len(ids), CPU) if tokens is None else tokens
    with torch.no_grad():
        return engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], images=tokens)[0]


def generated(engine, ids, prompt_media, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_media)
    return [r.token for r in stream if r.token is not None]


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_ids_patches_and_frames_are_the_processors(engine, images, clip, prompt, reference):
    ids, media = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [engine.image_tokens(image) for image in images] == [60, 60]
    assert engine.audio_tokens(clip) == 18
    assert media.clips == [False, False, True]
    for image, pixels, positions in zip(
        images, reference["pixel_values"], reference["image_position_ids"], strict=True
    ):
        patches, ours = gemma4_images.patches(engine.vision, image)
        real = (positions != -1).all(-1)
        assert torch.equal(ours, positions[real])
        torch.testing.assert_close(patches, pixels[real], atol=1e-5, rtol=0)
    frames = gemma4_unified_media.frames(engine.audio, clip)
    assert np.array_equal(frames, reference["input_features"][0].numpy())


def test_embeddings_logits_and_greedy_tokens_match_transformers(
    model, engine, prompt, reference, expected
):
    ids, media = prompt
    taken = taken_embeddings(model, reference)
    assert taken.abs().max() > 1
    torch.testing.assert_close(torch.cat(media.embeds), taken, atol=1e-4, rtol=0)
    with torch.no_grad():
        inputs = {k: v for k, v in reference.items() if k != "mm_token_type_ids"}
        causal = model(**inputs).logits[0]
    # The images' tokens seeing each other both ways matters.
    assert (causal - expected).abs().max() > 1e-2
    torch.testing.assert_close(logits(engine, ids, media), expected, atol=1e-4, rtol=0)
    length, first = len(ids), media.first
    tokens = torch.tensor([ids])
    with torch.no_grad():
        cache = engine.model.new_cache(1, 512, torch.float32, "cpu")
        head = engine.model(tokens[:, :first], torch.arange(first)[None], cache)
        tail = engine.model(
            tokens[:, first:],
            torch.arange(first, length)[None],
            cache,
            images=media.tokens(first, length, CPU),
        )
        state = KVState(engine.model.new_cache(1, 512, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=16, images=media)
    torch.testing.assert_close(torch.cat([head, tail], 1)[0], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    assert generated(engine, ids, media) == greedy_tokens(model, reference)


def test_images_alone_and_a_clip_alone_match_transformers(model, folder, engine, images, clip):
    for media in ({"images": images[1:]}, {"clips": [clip.samples]}):
        reference = processor_inputs(folder, QUESTION, **media)
        with torch.no_grad():
            expected = model(**reference).logits[0]
        count = len(media.get("images", []))
        text = engine.prompt_text(QUESTION, images=count, audio=1 - count)
        ids, encoded = engine.media_prompt(
            text, images[1:] if count else [], [] if count else [clip]
        )
        assert ids == reference["input_ids"][0].tolist()
        torch.testing.assert_close(logits(engine, ids, encoded), expected, atol=1e-4, rtol=0)


class WindowedTokens(GlobalBothWays, mixed_media.MediaTokens):
    """A planted bug: the images' tokens both ways on the global layer, but on the
    sliding one within its window only (Gemma 4's composition)."""


def test_planted_bugs_fail(engine, prompt, expected, reference, monkeypatch):
    ids, media = prompt
    tokens = media.tokens(0, len(ids), CPU)
    parts = (tokens.embeds, tokens.groups, tokens.image_groups)
    for planted in (mixed_media.MediaTokens(*parts), WindowedTokens(*parts)):
        assert (logits(engine, ids, media, planted) - expected).abs().max() > 1e-2
    encoder = engine.vision.encoder
    image = open_image(picture(48, 80, 1))
    patches, positions = gemma4_images.patches(engine.vision, image)
    with torch.no_grad():
        right = encoder(patches, positions)
        swapped = encoder(patches, positions.flip(-1))
    assert (right - swapped).abs().max() > 1e-2


def test_gguf_with_mmproj_matches_transformers(model, folder, images, clip, tmp_path, monkeypatch):
    """The converter's files: an image takes up to 280 tokens (an mmproj names no budget:
    transformers' default, llama.cpp's too)."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj, vision=True, audio=True)
    reference = processor_inputs(folder, QUESTION, images[:1], [clip.samples], tokens=280)
    prompt_text = engine.prompt_text(QUESTION, images=1, audio=1)
    ids, media = engine.media_prompt(prompt_text, images[:1], [clip])
    assert ids == reference["input_ids"][0].tolist()
    assert len(media.embeds[0]) == 252
    taken = taken_embeddings(model, reference)
    torch.testing.assert_close(torch.cat(media.embeds), taken, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, media), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, media) == greedy_tokens(model, reference)
    # The converter's channel-major columns matter: left as they are, the images move.
    monkeypatch.setattr(gemma4_unified, "_pixel_order", lambda weights, side, source: weights)
    unordered = gemma4_unified.vision_from_mmproj(mmproj, 64)
    patches = gemma4_images.patches(unordered, images[0])
    with torch.no_grad():
        moved = unordered.encoder(*patches) - engine.vision.encoder(*patches)
    assert moved.abs().max() > 1e-2


def test_run_with_images_and_audio_replies_as_transformers(model, folder, files, reference):
    """`llmrun run FOLDER --image A --image B --audio C "prompt"`: transformers' greedy
    reply."""
    args = ["run", str(folder), "--image", str(files[0]), "--image", str(files[1])]
    args += ["--audio", str(files[2]), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun(*args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ids = [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]
    assert ids == greedy_tokens(model, reference)


def test_serve_replies_to_image_and_audio_parts_as_transformers(model, engine, files, reference):
    wav = base64.b64encode(files[2].read_bytes()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(f.read_bytes())}} for f in files[:2]
    ]
    parts += [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    content = [*parts, {"type": "text", "text": QUESTION}]
    request = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    service = Service("gemma4-unified", set(), None, parallel=1, queue=2)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            response = http.post("/v1/chat/completions", json=request)
    finally:
        service.close()
    assert response.status_code == 200, response.text
    expected = engine.tokenizer.decode(greedy_tokens(model, reference))
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.json()["usage"]["prompt_tokens"] == reference["input_ids"].shape[1]

"""Images and audio in one prompt against transformers: tiny random Qwen2.5-Omni,
Qwen3-Omni and Gemma 4 models (their families' test helpers) with one image and one clip
in one user message, in both orders; Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor and
Gemma4Processor make the reference. The ids, the logits (the Omni models' M-RoPE positions
come out of the whole sequence: the text and audio after an image shift by it; Qwen3-Omni's
deepstack features go to image tokens only; Gemma 4's image tokens see each other both
ways, a clip's attend causally) and 8 greedy tokens match; `run --image --audio`, `chat`
with /audio then /image before one message, and serve's replies to requests with both
part types are transformers'. Planted bugs (the audio positioned as if no image came
before it; a clip attending both ways; serve naming KV blocks by the digests of each kind
in turn rather than in prompt order) fail.

Tolerances: ids and tokens exact; logits 1e-4 (measured ~1e-5).
"""

import base64
import dataclasses
import json

import pytest
import qwen2_5_omni_helpers
import qwen3_omni_helpers
import torch
from gemma4_audio_helpers import tiny_gemma4_audio
from gemma4_vision_helpers import processor as gemma4_processor
from gemma4_vision_helpers import save_gemma4_vl_dir
from helpers import needs_templates
from in_process import llmrun
from qwen2_5_omni_helpers import greedy_tokens as greedy
from serving import GREEDY, data_url, served
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, audio_families, mixed_media
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.models.gemma3 import ImageTokens

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
pytestmark = needs_templates
QUESTION = "What is this?"
# Image and clip tokens: Qwen2.5-Omni's 6 and 25, Qwen3-Omni's 70 (with its deepstack
# features) and 13, Gemma 4's 60 and 25.
IMAGE = picture(56, 84, 1)
SECONDS = 1.0
ORDERS = {"image, audio": ("image", "audio"), "audio, image": ("audio", "image")}
FAMILIES = ("qwen2.5-omni", "qwen3-omni", "gemma4")


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "clip.wav"
    path.write_bytes(wav_bytes(chirp(SECONDS, 16000, seed=1), 16000))
    return path


@pytest.fixture(scope="module")
def other_wav(tmp_path_factory):
    """Another clip as long as `wav`: a prompt of the same ids."""
    path = tmp_path_factory.mktemp("mixed") / "other.wav"
    path.write_bytes(wav_bytes(chirp(SECONDS, 16000, seed=2), 16000))
    return path


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "image.png"
    path.write_bytes(IMAGE)
    return path


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """Each family's transformers model, folder and engine (both towers loaded)."""
    out = {}
    qwen = qwen2_5_omni_helpers.tiny_qwen25_omni()
    folder = qwen2_5_omni_helpers.save_qwen25_omni_dir(qwen, tmp_path_factory.mktemp("qwen2.5"))
    out["qwen2.5-omni"] = (qwen, folder)
    qwen = qwen3_omni_helpers.tiny_qwen3_omni()
    folder = qwen3_omni_helpers.save_qwen3_omni_dir(qwen, tmp_path_factory.mktemp("qwen3"))
    out["qwen3-omni"] = (qwen, folder)
    gemma = tiny_gemma4_audio()
    folder = save_gemma4_vl_dir(gemma, tmp_path_factory.mktemp("gemma4"))
    out["gemma4"] = (gemma, folder)
    return {
        name: (model, folder, api.load(str(folder), device="cpu", vision=True, audio=True))
        for name, (model, folder) in out.items()
    }


def message(order: tuple[str, ...]) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": k} for k in order] + [{"type": "text", "text": QUESTION}],
        }
    ]


def reference(family: str, folder, order: tuple[str, str], wav):
    """The processor's inputs for one user message of the image and the clip in `order`."""
    samples = audio.open_audio(wav).samples
    if family != "gemma4":
        helpers = qwen2_5_omni_helpers if family == "qwen2.5-omni" else qwen3_omni_helpers
        images = [open_image(IMAGE)]
        return helpers.processor_inputs(folder, message(order), images=images, clips=[samples])
    proc = gemma4_processor(folder)
    text = proc.apply_chat_template(message(order), add_generation_prompt=True, tokenize=False)
    return proc(
        text=text,
        images=[open_image(IMAGE)],
        audio=[samples],
        return_tensors="pt",
        add_special_tokens=False,
    )


def ours(engine, order: tuple[str, str], wav):
    text = engine.render(message(order))
    return engine.media_prompt(text, [open_image(IMAGE)], [audio.open_audio(wav)])


def logits(engine, ids, media) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=media.tokens(0, len(ids), torch.device("cpu")),
        )[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("order", ORDERS)
def test_one_image_and_one_clip_match_transformers(setups, wav, family, order):
    model, folder, engine = setups[family]
    inputs = reference(family, folder, ORDERS[order], wav)
    ids, media = ours(engine, ORDERS[order], wav)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    torch.testing.assert_close(logits(engine, ids, media), expected, atol=1e-4, rtol=0)
    tokens = greedy(model, inputs)
    assert len(tokens) == 8
    assert [
        r.token for r in engine.generate(ids, GREEDY, 8, images=media) if r.token is not None
    ] == tokens


def test_audio_positioned_as_if_no_image_came_before_fails(setups, wav):
    model, folder, engine = setups["qwen2.5-omni"]
    inputs = reference("qwen2.5-omni", folder, ORDERS["image, audio"], wav)
    ids, media = ours(engine, ORDERS["image, audio"], wav)
    image, clip = media.spans()
    assert media.rope[0, clip[0]] < clip[0]  # the image's 6 tokens take 3 positions
    media.rope[:, clip[0] : clip[1]] = torch.arange(*clip)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    assert (logits(engine, ids, media) - expected).abs().max() > 1e-2


def test_a_clip_attending_both_ways_as_an_image_fails(setups, wav, monkeypatch):
    model, folder, engine = setups["gemma4"]
    inputs = reference("gemma4", folder, ORDERS["audio, image"], wav)
    ids, media = ours(engine, ORDERS["audio, image"], wav)
    monkeypatch.setattr(mixed_media.MediaTokens, "unmask", ImageTokens.unmask)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    assert (logits(engine, ids, media) - expected).abs().max() > 1e-2


def test_run_with_an_image_and_a_clip_replies_as_transformers(setups, png, wav):
    """`llmrun run FOLDER --image A --audio B "prompt"`: the image, then the clip."""
    model, folder, _ = setups["qwen2.5-omni"]
    expected = greedy(model, reference("qwen2.5-omni", folder, ORDERS["image, audio"], wav))
    options = ("-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    result = llmrun("run", folder, "--image", png, "--audio", wav, QUESTION, *options)
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected


def test_chat_takes_an_image_and_a_clip_in_one_message_as_attached(setups, png, wav):
    """`chat` with /audio then /image, then the question: one message, the clip first."""
    model, folder, engine = setups["gemma4"]
    expected = greedy(model, reference("gemma4", folder, ORDERS["audio, image"], wav))
    lines = f"/audio {wav}\n/image {png}\n{QUESTION}"
    chat = llmrun("chat", folder, "-n", "8", "--temperature", "0", input=lines)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == engine.tokenizer.decode(expected) + "\n\n"


def body(order: tuple[str, str], wav) -> dict:
    """A greedy chat request of one user message: the image and the clip in `order`."""
    parts = {
        "image": {"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
        "audio": {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(wav.read_bytes()).decode(), "format": "wav"},
        },
    }
    content = [parts[kind] for kind in order] + [{"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_serve_replies_to_image_and_audio_parts_as_transformers(setups, wav, other_wav, family):
    """Each reply is transformers'; the same request again reuses the KV blocks past both
    (named by their digests), and another clip in the first place reuses none of its."""
    model, folder, engine = setups[family]
    order = ORDERS["audio, image"]
    clips = (wav, wav, other_wav)
    for client in served(engine, family):
        replies = [client.post("/v1/chat/completions", json=body(order, c)) for c in clips]
    for reply, clip in zip(replies, clips, strict=True):
        assert reply.status_code == 200, reply.text
        expected = engine.tokenizer.decode(greedy(model, reference(family, folder, order, clip)))
        assert reply.json()["choices"][0]["message"]["content"] == expected
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    clip, image = ours(engine, order, wav)[1].spans()
    assert cached[0] == 0 and cached[1] > image[1] and cached[2] <= clip[0]


def test_a_clip_without_its_place_is_one_error(setups, wav):
    _, _, engine = setups["qwen2.5-omni"]
    text = engine.render(message(("image",)))
    with pytest.raises(UsageError, match=r"marks 0 audio places \(<\|AUDIO\|>\) for 1 clip"):
        engine.media_prompt(text, [open_image(IMAGE)], [audio.open_audio(wav)])


def test_a_family_without_both_keeps_one_error(setups, wav, png, monkeypatch):
    _, _, engine = setups["qwen2.5-omni"]
    family = audio_families.of_encoder(engine.audio)
    alone = dataclasses.replace(family, with_images=None)
    monkeypatch.setattr(audio_families, "of_encoder", lambda encoder: alone)
    with pytest.raises(UsageError, match="takes images or audio in a prompt, not both"):
        ours(engine, ORDERS["image, audio"], wav)
    for client in served(engine, "qwen2.5-omni"):
        refused = client.post("/v1/chat/completions", json=body(ORDERS["image, audio"], wav))
    assert refused.status_code == 400
    assert "takes images or audio in a prompt, not both" in refused.json()["error"]["message"]
    # A model without an image encoder says so, in one line.
    result = llmrun("run", "--image", png, "--audio", wav, QUESTION)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1

"""Qwen3-Omni's thinker with images and with audio against transformers: a tiny random
Qwen3OmniMoeThinkerForConditionalGeneration (a Qwen3-MoE of 4 experts with interleaved
M-RoPE, Qwen3-VL's vision tower with a deepstack merger, its Conv2d audio tower attending
within windows) and Qwen3OmniMoeProcessor (Qwen2VLImageProcessor, WhisperFeatureExtractor,
its token counts) make the reference, for a prompt with an image and one with two
2.5-second clips (16 kHz and 22.05 kHz; each spans two of the tower's attention windows,
its last chunk half full). The input ids, the image and audio embeddings (as the language
model takes them), the logits and 8 greedy tokens match; so do the Hub's layout
(thinker_config, thinker.* weights, talker and code2wav weights left unread), and the text
GGUF and the one mmproj GGUF of both towers as llama.cpp's converter writes them
(qwen3_omni_helpers; benchmarks/llama_cpp_qwen3_omni.py checks that layout against the
converter). run and chat (for an image, and for a clip shorter than a chunk) and serve
reply as transformers. Audio attending across its windows, or images without their
deepstack features, fail.

Tolerances: ids and tokens exact; embeddings and logits within 1e-4.
"""

import copy
import json

import pytest
import torch
from audio_checks import audio_body, placed
from image_serving import check_reply_is_run_s
from in_process import llmrun
from qwen2_5_omni_helpers import check_matches, greedy_tokens
from qwen3_omni_helpers import (
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    IMAGE,
    hub_layout,
    processor_inputs,
    save_qwen3_omni_dir,
    tiny_qwen3_omni,
    write_mmproj,
    write_text_gguf,
)
from serving import GREEDY, chat_reply, image_prompt, served
from vision_checks import logits
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio
from llmrun.images import open_image
from llmrun.models import mrope

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is this?"
# 224x320 pixels (at least Qwen3-VL's 65536): 14x20 patches of 16, 7x10 merged tokens.
WIDE = picture(224, 320, 1)
# 250 feature frames each: chunks of 100, 100 and 50 frames, 13 + 13 + 7 tokens.
TOKENS = [33, 33]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_omni()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qwen3_omni_dir(model, tmp_path_factory.mktemp("qwen3-omni"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True, audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wavs")
    first, second = tmp / "first.wav", tmp / "second.wav"
    first.write_bytes(wav_bytes(chirp(2.5, 16000, seed=1), 16000))
    second.write_bytes(wav_bytes(chirp(2.5, 22050, seed=2), 22050))
    return first, second


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


def user_turn(kind: str, count: int) -> list[dict]:
    content = [{"type": kind}] * count + [{"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def image_reference(folder):
    return processor_inputs(folder, user_turn("image", 1), images=[open_image(WIDE)])


@pytest.fixture(scope="module")
def audio_reference(folder, clips):
    return processor_inputs(folder, user_turn("audio", 2), clips=[c.samples for c in clips])


def image_prompt_of(engine):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=1), [open_image(WIDE)])


def audio_prompt_of(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)


def test_an_image_prompt_matches_transformers(model, engine, image_reference):
    prompt = image_prompt_of(engine)
    # 7x10 tokens, each its features and the deepstack block's.
    assert [tuple(e.shape) for e in prompt[1].embeds] == [(70, 128)]
    assert prompt[1].shift_at(len(prompt[0])) < 0  # the text after it is shifted
    check_matches(model, engine, prompt, image_reference, IMAGE, deepstack=True)


def test_an_audio_prompt_matches_transformers(model, engine, clips, audio_reference):
    prompt = audio_prompt_of(engine, clips)
    ids, prompt_images = prompt
    assert [engine.audio_tokens(clip) for clip in clips] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1] == AUDIO_START and ids[start + count] == AUDIO_END
    check_matches(model, engine, prompt, audio_reference, AUDIO, deepstack=True)


def test_audio_across_windows_or_images_without_deepstack_fail(
    model, engine, clips, image_reference, audio_reference, monkeypatch
):
    expected = placed(model, audio_reference, AUDIO)
    monkeypatch.setattr(engine.audio.encoder.args, "n_window_infer", 1000)
    planted = torch.cat(engine.encode_audio(clips))
    assert planted.shape == expected.shape
    assert (planted - expected).abs().max() > 1e-2
    monkeypatch.setattr(mrope.MRopeImages, "add_deepstack", lambda self, x, layer: x)
    ids, prompt_images = image_prompt_of(engine)
    with torch.no_grad():
        reference = model(**image_reference).logits[0]
    assert (logits(engine, ids, prompt_images) - reference).abs().max() > 1e-2


def test_the_hubs_layout_loads_the_thinker(
    model, folder, clips, image_reference, audio_reference, tmp_path
):
    hub = hub_layout(folder, tmp_path / "hub")
    engine = api.load(str(hub), device="cpu", vision=True, audio=True)
    ids, prompt_images = image_prompt_of(engine)
    with torch.no_grad():
        expected = model(**image_reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    heard = torch.cat(audio_prompt_of(engine, clips)[1].embeds)
    torch.testing.assert_close(heard, placed(model, audio_reference, AUDIO), atol=1e-4, rtol=0)
    text_only = api.load(str(hub), device="cpu")
    assert text_only.vision is None and text_only.audio is None
    assert any("Qwen3-Omni" in note for note in text_only.checkpoint.notes)
    shown = llmrun("show", hub)  # the thinker's language model, not its talker's
    assert shown.returncode == 0, shown.stderr
    assert "architecture   qwen3_omni_moe\n" in shown.stdout
    text = model.model.language_model.num_parameters() + model.lm_head.weight.numel()
    assert f"({text:,})" in shown.stdout


def test_gguf_with_mmproj_matches_transformers(
    model, clips, image_reference, audio_reference, tmp_path
):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32 but the audio convolutions' weights and conv_out, which the converter keeps F16
    # whatever --outtype says: transformers with those rounded the same way is the reference.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    # The mmproj holds no attention windows: llmrun takes the Hub's (800 frames).
    rounded = copy.deepcopy(model)
    tower = rounded.model.audio_tower
    for layer in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
        layer.weight.data = layer.weight.data.half().float()
    tower.n_window_infer = 800
    engine = api.load(str(text), device="cpu", mmproj=mmproj, vision=True, audio=True)
    check_matches(rounded, engine, image_prompt_of(engine), image_reference, IMAGE, deepstack=True)
    check_matches(
        rounded, engine, audio_prompt_of(engine, clips), audio_reference, AUDIO, deepstack=True
    )


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, tmp_path, kind):
    """`llmrun run FOLDER --image A "prompt"` (and `--audio A`), and `chat` with `/image A`
    (`/audio A`) then the question: transformers' greedy reply."""
    if kind == "image":
        media = tmp_path / "wide.png"
        media.write_bytes(WIDE)
        reference = processor_inputs(folder, user_turn("image", 1), images=[open_image(WIDE)])
    else:  # shorter than a chunk: its own length is the longest chunk's
        media = tmp_path / "short.wav"
        media.write_bytes(wav_bytes(chirp(0.73, 16000, seed=4), 16000))
        clip = audio.open_audio(media)
        assert engine.audio_tokens(clip) == 10
        reference = processor_inputs(folder, user_turn("audio", 1), clips=[clip.samples])
    expected = greedy_tokens(model, reference)
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, f"--{kind}", media, QUESTION, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    chat = llmrun("chat", folder, *options, input=f"/{kind} {media}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    # The stream keeps the first token's leading space, which a whole decode drops.
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"


def test_a_clip_too_short_is_one_error_line(folder, tmp_path):
    tiny = tmp_path / "tiny.wav"
    tiny.write_bytes(wav_bytes(chirp(0.01, 16000, seed=3), 16000))
    result = llmrun("run", folder, "--audio", tiny, QUESTION)
    assert result.returncode == 2
    *notes, line = result.stderr.strip().splitlines()
    assert all(note.startswith("note: ") for note in notes)  # the vision tower's, unloaded
    assert line == f"error: {tiny}: 160 samples, too short for Qwen3-Omni"


def test_serve_replies_to_an_image_and_to_audio_as_run_does(model, engine, wavs, image_reference):
    data = wavs[1].read_bytes()
    for client in served(engine, "qwen3-omni"):
        reply = chat_reply(client, WIDE, QUESTION)
        heard = client.post("/v1/chat/completions", json=audio_body(data, QUESTION))
    _, ids, _, _ = image_prompt(engine, WIDE, QUESTION)
    expected = greedy_tokens(model, image_reference)
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, len(ids))
    assert heard.status_code == 200, heard.text
    ids, prompt_images = audio_prompt_of(engine, [audio.open_audio(data)])
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=prompt_images))
    assert heard.json()["choices"][0]["message"]["content"] == expected
    assert heard.json()["usage"]["prompt_tokens"] == len(ids)

"""Granite Speech Plus against transformers: a tiny random
GraniteSpeechPlusForConditionalGeneration without a LoRA adapter (granite_speech_helpers: a
3-block conformer of width 32 whose input layer's and middle block's outputs its 2-layer
Q-Former reads beside the last block's, a Granite of width 64) and GraniteSpeechProcessor
make the reference, for a 2-second clip at 16 kHz. The features, the input ids, the audio
embeddings, the logits and 8 greedy tokens match, from the Hugging Face folder and from the
text GGUF and mmproj GGUF that llama.cpp's converter writes of it; `run --audio`, `chat`'s
`/audio`, serve's input_audio part and serve's /v1/audio/transcriptions (the prompt
transformers documents for the model) reply as transformers does. Planting llama.cpp's
reading of the middle block (its output before the CTC head's addition) or the layers in
the wrong order fails.

transformers 5.25's GraniteSpeechPlusForConditionalGeneration leaves the text model's
logits_scaling out of its logits, as Granite Speech's does (tests/models/
test_granite_speech.py): the logits are compared with transformers' divided by it.

Tolerances: features 5e-5 (measured 2e-5: the reference's mel spectrogram is numpy's
float64 as torchaudio is not installed, llmrun's torchaudio's float32 operations); ids and
tokens exact; embeddings and logits 1e-4 (measured ~2e-6).
"""

import base64
import json

import numpy as np
import pytest
import torch
from glmasr_helpers import converted
from granite_speech_helpers import (
    AUDIO,
    extracted,
    greedy_tokens,
    processor_inputs,
    tiny_granite_speech_plus,
)
from helpers import needs_converter
from in_process import llmrun
from serving import GREEDY
from starlette.testclient import TestClient
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, granite_speech_clips
from llmrun.generate import KVState, prefill
from llmrun.models import granite_speech_audio as model_audio
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
QUESTION = "What do you hear?"
CPU = torch.device("cpu")
LOGITS_SCALING = 2.0  # the tiny model's
# transformers' documentation of Granite Speech Plus (model_doc/granite_speech_plus).
SYSTEM_PROMPT = (
    "Knowledge Cutoff Date: April 2024.\nToday's Date: December 19, 2024.\n"
    "You are Granite, developed by IBM. You are a helpful AI assistant"
)
ASR_PROMPT = "<|audio|> can you transcribe the speech into a written format?"
# The transcription's prompt (its 21 audio tokens among 159 of text: the tiny tokenizer
# spells the system prompt in pieces) and 20 tokens of answer.
CONTEXT = 200


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("granite-speech-plus")


@pytest.fixture(scope="module")
def model(folder):
    return tiny_granite_speech_plus(folder)


@pytest.fixture(scope="module")
def engine(model, folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("wavs") / "clip.wav"
    path.write_bytes(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    return path


@pytest.fixture(scope="module")
def clip(wav):
    return audio.open_audio(wav)


@pytest.fixture(scope="module")
def reference(folder, clip):
    return processor_inputs(folder, [clip.samples], QUESTION)


def audio_features(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model.get_audio_features(inputs["input_features"]).pooler_output[0]


def check_matches(model, engine, clip, reference) -> list[int]:
    """The audio embeddings, the logits (whole, and generate's prefill in chunks) and 8
    greedy tokens (returned) on llmrun's ids are transformers' on the same ids."""
    ids, prompt_audio = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
    row = torch.tensor([ids])
    reference = {**reference, "input_ids": row, "attention_mask": torch.ones_like(row)}
    expected_audio = audio_features(model, reference)
    assert expected_audio.abs().max() > 0.5
    torch.testing.assert_close(prompt_audio.embeds[0], expected_audio, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0] / LOGITS_SCALING
        got = engine.model(
            row, torch.arange(len(ids))[None], images=prompt_audio.tokens(0, len(ids), CPU)
        )[0]
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=8, images=prompt_audio)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    stream = engine.generate(ids, GREEDY, 8, images=prompt_audio)
    assert [r.token for r in stream if r.token is not None] == tokens
    return tokens


def test_features_and_ids_are_the_processor_s(engine, clip, reference):
    expected = extracted([clip.samples])["input_features"][0].numpy()
    ours = granite_speech_clips.features(clip, engine.audio.settings)
    np.testing.assert_allclose(ours.numpy(), expected, atol=5e-5, rtol=0)
    ids, _ = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
    assert ids == reference["input_ids"][0].tolist()
    # 2 s: 100 encoder frames, 7 windows of 15, 3 tokens each.
    assert ids.count(AUDIO) == engine.audio_tokens(clip) == 21


def test_the_folder_matches_transformers(model, engine, clip, reference):
    assert engine.audio.adapter is None and engine.audio.encoder.args.cat_hidden_layers == (0, 1)
    check_matches(model, engine, clip, reference)


@needs_converter
def test_the_converter_s_ggufs_match_transformers(model, folder, wav, clip, reference, tmp_path):
    """Also `chat GGUF --mmproj MMPROJ` with `/audio A`. The converter gives the text GGUF
    stories260K's SentencePiece vocabulary (a BOS, spaces its own way), so transformers runs
    on llmrun's ids."""
    text, mmproj = converted(folder, tmp_path)
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    assert engine.audio.encoder.args.batch_norm_eps == 0  # folded by the converter
    tokens = check_matches(model, engine, clip, reference)
    options = ("--mmproj", mmproj, "-n", "8", "--temperature", "0")
    chat = llmrun("chat", text, *options, input=f"/audio {wav}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(tokens) + "\n\n"


def _middle_before_ctc(self, features, original):
    """llama.cpp's graph: the middle block's output kept before the CTC head's addition."""
    x = self.input_linear(features)
    kept = [x] if 0 in self.cat_hidden_layers else []
    for i, layer in enumerate(self.layers, start=1):
        x = layer(x)
        if i in self.cat_hidden_layers:
            kept.append(x)
        if i == len(self.layers) // 2:
            x = x + self.out_mid(torch.softmax(self.out(x), dim=-1))
    return torch.cat([*kept, x], dim=-1)


def _last_first(self, features, original):
    """The last block's output before the kept layers' instead of after."""
    out = original(self, features)
    width = self.input_linear.out_features
    return torch.cat([out[:, -width:], out[:, :-width]], dim=-1)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(_middle_before_ctc, id="middle-block-kept-before-the-ctc-addition"),
        pytest.param(_last_first, id="last-block-first"),
    ],
)
def test_a_planted_bug_fails(model, engine, clip, reference, monkeypatch, plant):
    expected = audio_features(model, reference)
    original = model_audio.Conformer.forward
    monkeypatch.setattr(
        model_audio.Conformer, "forward", lambda self, features: plant(self, features, original)
    )
    bugged = engine.encode_audio([clip])[0]
    assert bugged.shape == expected.shape
    assert (bugged - expected).abs().max() > 1e-2


def test_cat_hidden_layers_past_the_encoder_is_one_error(model, folder, wav, tmp_path):
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(folder / name)
    config = json.loads((folder / "config.json").read_text())
    config["encoder_config"]["cat_hidden_layers"] = [0, 3]
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = llmrun("run", tmp_path, "--audio", wav, QUESTION, "-n", "2")
    assert result.returncode != 0
    assert result.stderr == (
        f"error: {tmp_path}: cat_hidden_layers [0, 3]: distinct layers from 0 to 2\n"
    )


def test_run_with_audio_replies_as_transformers(model, folder, wav, reference):
    """`llmrun run FOLDER --audio A "prompt"`: transformers' greedy reply."""
    args = ["run", str(folder), "--audio", str(wav), QUESTION]
    result = llmrun(*args, "-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ids = [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]
    assert ids == greedy_tokens(model, reference)


def test_serve_transcribes_with_the_documented_prompt(model, folder, wav, engine):
    """/v1/audio/transcriptions: transformers' greedy generation (to the context's end, a
    random model not stopping) on the processor's ids of the documented system and
    transcription prompts; a language is one 400. A chat request's input_audio part
    replies as run does."""
    data = wav.read_bytes()
    clip = audio.open_audio(data)
    short = api.load(str(folder), device="cpu", audio=True, ctx_size=CONTEXT)
    service = Service("granite-speech-plus", set(), None, parallel=1, queue=2)
    service.start(short)
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"},
    }
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
        "max_tokens": 8,
        "temperature": 0,
    }
    files = {"file": ("clip.wav", data, "audio/wav")}
    form = {"model": "granite-speech-plus"}
    try:
        with TestClient(create_app(service)) as http:
            transcribed = http.post("/v1/audio/transcriptions", data=form, files=files)
            with_language = http.post(
                "/v1/audio/transcriptions", data={**form, "language": "en"}, files=files
            )
            spoken = http.post("/v1/chat/completions", json=body)
    finally:
        service.close()
    assert transcribed.status_code == 200, transcribed.text
    history = [{"role": "system", "content": SYSTEM_PROMPT}]
    instruction = ASR_PROMPT.removeprefix("<|audio|>")
    inputs = processor_inputs(folder, [clip.samples], instruction, history)
    ids = inputs["input_ids"][0].tolist()
    assert transcribed.json()["usage"]["input_tokens"] == len(ids)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=CONTEXT + 1 - len(ids), do_sample=False)
    # The stream keeps the first token's leading space, which a whole decode drops.
    text = transcribed.json()["text"].lstrip(" ")
    assert text == engine.tokenizer.decode(out[0, len(ids) :].tolist())
    assert with_language.status_code == 400
    assert "takes no language" in with_language.json()["error"]["message"]
    assert spoken.status_code == 200, spoken.text
    reply = engine.tokenizer.decode(
        greedy_tokens(model, processor_inputs(folder, [clip.samples], QUESTION))
    )
    assert spoken.json()["choices"][0]["message"]["content"] == reply

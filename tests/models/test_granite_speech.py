"""Granite Speech against transformers: a tiny random GraniteSpeechForConditionalGeneration
with a PEFT LoRA adapter on its language model (granite_speech_helpers: a 2-block conformer
of width 32, a 1-layer Q-Former, a Granite of width 64) and GraniteSpeechProcessor make the
reference, for a 2-second clip at 16 kHz and a 1.3-second one at 22.05 kHz. The features,
the input ids, each clip's audio embeddings, the logits and 8 greedy tokens match; serve's
reply to an `input_audio` part equals run's.

transformers turns the adapter on for prompts with audio alone
(GraniteSpeechForConditionalGeneration.generate); the reference is the PEFT model, with
the adapter, and its disable_adapter() for a prompt without audio, which llmrun runs
without the adapter on the same engine (run, chat, serve).

transformers 5.25's GraniteSpeechForConditionalGeneration leaves the text model's
logits_scaling out of its logits (its own lm_head after the base GraniteModel), where
GraniteForCausalLM, transformers 4's Granite Speech (the release's) and llama.cpp divide
by it: llmrun divides, and the logits are compared with transformers' divided by it. The
greedy tokens do not depend on it.

Tolerances: features 5e-5 (measured 2e-5: the reference's mel spectrogram is numpy's
float64, llmrun's the same float32 torch operations as torchaudio's, which it equals
exactly where torchaudio is installed); ids and tokens exact; embeddings and logits 1e-4
(measured ~2e-6).
"""

import base64
import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from granite_speech_helpers import (
    AUDIO,
    extracted,
    greedy_tokens,
    processor_inputs,
    tiny_granite_speech,
)
from in_process import llmrun
from lora_helpers import needs_peft
from serving import GREEDY
from starlette.testclient import TestClient
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, audio_families, granite_speech_clips
from llmrun.errors import UnsupportedError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.hub import names
from llmrun.models import granite_speech_audio as model_audio
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
pytestmark = needs_peft
QUESTION = "What do you hear?"
CPU = torch.device("cpu")
LOGITS_SCALING = 2.0  # the tiny model's


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("granite-speech")


@pytest.fixture(scope="module")
def model(folder):
    return tiny_granite_speech(folder)


@pytest.fixture(scope="module")
def engine(model, folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wavs")
    first, second = tmp / "first.wav", tmp / "second.wav"
    first.write_bytes(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    second.write_bytes(wav_bytes(chirp(1.3, 22050, seed=2), 22050))
    return first, second


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def reference(folder, clips):
    """transformers' inputs for the first clip alone."""
    return processor_inputs(folder, [clips[0].samples], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), clips[:1])


def logits(engine, ids, prompt_audio) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_audio.tokens(0, len(ids), CPU),
        )[0]


def audio_features(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model.get_base_model().get_audio_features(inputs["input_features"]).pooler_output


def test_features_match_the_feature_extractor(clips):
    for clip in [*clips, audio.Clip(clips[0].samples[:5001], "odd")]:
        expected = extracted([clip.samples])["input_features"][0].numpy()
        ours = granite_speech_clips.features(clip, granite_speech_clips.FeatureSettings())
        np.testing.assert_allclose(ours.numpy(), expected, atol=5e-5, rtol=0)


def test_the_prompt_is_laid_out_as_the_processor_does(folder, engine, clips):
    reference = processor_inputs(folder, [clip.samples for clip in clips], QUESTION)
    text = engine.prompt_text(QUESTION, audio=2)
    assert text.count("<|audio|>") == 2
    ids, prompt_audio = engine.audio_prompt(text, clips)
    assert ids == reference["input_ids"][0].tolist()
    # 2 s: 100 encoder frames, 7 windows of 15, 3 tokens each; 1.3 s: 65 frames, 5 windows.
    assert [engine.audio_tokens(clip) for clip in clips] == [21, 15]
    for start, embeds in zip(prompt_audio.starts, prompt_audio.embeds, strict=True):
        assert ids[start : start + len(embeds)] == [AUDIO] * len(embeds)
    # Loading the tower drops the note that it is not run.
    assert not [n for n in engine.checkpoint.notes if "audio tower" in n]


def test_audio_embeddings_match_transformers(model, folder, engine, clips):
    for clip, embeds in zip(clips, engine.encode_audio(clips), strict=True):
        expected = audio_features(model, processor_inputs(folder, [clip.samples], QUESTION))[0]
        assert expected.abs().max() > 0.5
        torch.testing.assert_close(embeds, expected, atol=1e-4, rtol=0)


def test_logits_with_audio_match_transformers_with_its_adapter(model, engine, prompt, reference):
    ids, prompt_audio = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0] / LOGITS_SCALING
        with model.disable_adapter():
            without = model(**reference).logits[0] / LOGITS_SCALING
        # generate's prefill in chunks of 8, moved so that no clip is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=8, images=prompt_audio)
    assert expected.abs().max() > 1.0
    assert (without - expected).abs().max() > 0.5  # the adapter counts
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers_with_audio_and_without(model, engine, prompt, reference):
    """With audio, the adapter's reply; a text prompt on the same engine, the reply
    without it (transformers' generate turns it off without input_features)."""
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    stream = engine.generate(prompt[0], GREEDY, 8, images=prompt[1])
    assert [r.token for r in stream if r.token is not None] == expected
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with model.disable_adapter():
        plain = greedy_tokens(model, {"input_ids": torch.tensor([ids])})
    with_adapter = greedy_tokens(model, {"input_ids": torch.tensor([ids])})
    assert plain != with_adapter
    assert [r.token for r in engine.generate(ids, GREEDY, 8) if r.token is not None] == plain


def _running_stats_ignored(encoder, monkeypatch):
    def forward(self, x):
        return x * self.weight[:, None] + self.bias[:, None]

    monkeypatch.setattr(model_audio.BatchNorm, "forward", forward)


def _distances_reversed(encoder, monkeypatch):
    """Each relative position's embedding that of j - i instead of i - j."""
    for layer in encoder.encoder.layers:
        table = layer.attn.rel_pos_emb
        mirrored = 2 * encoder.args.max_pos_emb
        monkeypatch.setattr(
            table, "forward", lambda i, t=table, m=mirrored: F.embedding(m - i, t.weight)
        )


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(_running_stats_ignored, id="batch-norm-running-stats-ignored"),
        pytest.param(_distances_reversed, id="relative-distances-reversed"),
    ],
)
def test_a_planted_bug_fails(model, engine, clips, reference, monkeypatch, plant):
    expected = audio_features(model, reference)[0]
    plant(engine.audio.encoder, monkeypatch)
    bugged = engine.encode_audio(clips[:1])[0]
    assert bugged.shape == expected.shape
    assert (bugged - expected).abs().max() > 1e-2


def test_run_with_audio_replies_as_transformers(model, folder, wavs, reference):
    """`llmrun run FOLDER --audio A "prompt"`: transformers' greedy reply."""
    args = ["run", str(folder), "--audio", str(wavs[0]), QUESTION]
    result = llmrun(*args, "-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ids = [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]
    assert ids == greedy_tokens(model, reference)


def streamed(engine, ids, images=None) -> tuple[list[int], str]:
    """The 8 greedy tokens of engine.generate and the text it streams."""
    responses = list(engine.generate(ids, GREEDY, 8, images=images))
    return [r.token for r in responses if r.token is not None], "".join(r.text for r in responses)


def test_chat_with_audio_replies_as_transformers(
    model, folder, wavs, clips, engine, prompt, reference
):
    """`chat --audio A`, and `/audio A` after a text turn (whose cached tokens ran
    without the adapter, and run again with it): transformers' greedy replies."""
    tokens, text = streamed(engine, *prompt)
    assert tokens == greedy_tokens(model, reference)
    options = ("-n", "8", "--temperature", "0")
    flag = llmrun("chat", folder, "--audio", wavs[0], *options, input=QUESTION)
    assert flag.returncode == 0, flag.stderr
    assert flag.stdout == text + "\n\n"

    hello = engine.tokenizer.encode(engine.prompt_text("Hello"))
    tokens, first = streamed(engine, hello)
    with model.disable_adapter():
        assert tokens == greedy_tokens(model, {"input_ids": torch.tensor([hello])})
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first}]
    parts = [{"type": "audio"}, {"type": "text", "text": QUESTION}]
    text = engine.render([*history, {"role": "user", "content": parts}])
    ids, prompt_audio = engine.audio_prompt(text, clips[:1])
    second = processor_inputs(folder, [clips[0].samples], QUESTION, history)
    assert ids == second["input_ids"][0].tolist()
    tokens, reply = streamed(engine, ids, prompt_audio)
    assert tokens == greedy_tokens(model, second)
    command = llmrun("chat", folder, *options, input=f"Hello\n/audio {wavs[0]}\n{QUESTION}")
    assert command.returncode == 0, command.stderr
    assert command.stdout == f"{first}\n\n{reply}\n\n"


def test_a_short_clip_and_llama_cpp_projectors_are_refused(folder, engine, tmp_path):
    with pytest.raises(UsageError, match="too short for Granite Speech"):
        engine.audio_tokens(audio.Clip(np.zeros(200, np.float32), "tiny"))
    with pytest.raises(UsageError, match=r"marks 1 audio place \(<\|audio\|>\) for 2"):
        engine.audio_prompt("<|audio|>two?", [audio.Clip(np.zeros(8000, np.float32), "a")] * 2)
    mmproj = tmp_path / "mmproj.gguf"
    writer = gguf.GGUFWriter(mmproj, "clip")
    writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
    writer.add_string(gguf.Keys.ClipAudio.PROJECTOR_TYPE, gguf.VisionProjectorType.GRANITE_SPEECH)
    writer.add_tensor("a.input_linear.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    family = audio_families.of_mmproj(mmproj)
    assert family is not None and family.name == "Granite Speech"
    with pytest.raises(UnsupportedError, match="without the model's LoRA adapter"):
        family.from_mmproj(mmproj, 64)


def test_pull_takes_the_adapter_and_the_feature_settings():
    listing = dict.fromkeys(
        [
            "config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "tokenizer.json",
            "adapter_config.json",
            "adapter_model.safetensors",
            "preprocessor_config.json",
        ],
        1,
    )
    assert set(names.select_safetensors(listing).files) == set(listing)


def chat_body(content) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }


def test_serve_replies_as_run_does_with_audio_and_without(model, engine, wavs):
    data = wavs[0].read_bytes()
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"},
    }
    service = Service("granite-speech", set(), None, parallel=2, queue=2)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            spoken = http.post(
                "/v1/chat/completions",
                json=chat_body([part, {"type": "text", "text": QUESTION}]),
            )
            written = http.post("/v1/chat/completions", json=chat_body(QUESTION))
    finally:
        service.close()
    assert spoken.status_code == 200, spoken.text
    ids, prompt_audio = engine.audio_prompt(
        engine.prompt_text(QUESTION, audio=1), [audio.open_audio(data)]
    )
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=prompt_audio))
    assert spoken.json()["choices"][0]["message"]["content"] == expected
    assert spoken.json()["usage"]["prompt_tokens"] == len(ids)
    assert written.status_code == 200, written.text
    plain = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with model.disable_adapter():
        tokens = greedy_tokens(model, {"input_ids": torch.tensor([plain])})
    assert written.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(tokens)

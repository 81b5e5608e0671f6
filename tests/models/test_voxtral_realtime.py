"""Voxtral Realtime against transformers: a tiny random VoxtralRealtimeForConditionalGeneration
and VoxtralRealtimeProcessor (mistral_common's offline streaming transcription request)
make the reference, for a 1.3-second clip and a 0.3-second one. The padded clip's log-mel
features and the prompt ids are the processor's; the audio tokens (each added to its
position's embedding), the prompt's logits and the greedy tokens (every audio token read,
generate's default length, through both sliding windows) are transformers'; `run --audio`
prints their text as mistral_common decodes it. The encoder without its sliding window,
or the delay's embedding with sines and cosines swapped, fails.

Tolerances: ids and tokens exact; features within 5e-5 (the extractor's float32 torch STFT
against llmrun's float64 one); audio tokens and logits within 1e-4.
"""

import json

import pytest
import torch
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes
from voxtral_realtime_helpers import (
    DELAY_TOKENS,
    greedy,
    processor,
    save_voxtral_realtime_dir,
    tiny_voxtral_realtime,
)

from llmrun import api, audio, voxtral_realtime
from llmrun.models import voxtral_realtime as model_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("mistral_common")


@pytest.fixture(scope="module")
def model():
    return tiny_voxtral_realtime()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_voxtral_realtime_dir(model, tmp_path_factory.mktemp("voxtral_realtime"))


@pytest.fixture(scope="module")
def made(folder):
    return processor(folder)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wavs")
    long, short = tmp / "long.wav", tmp / "short.wav"
    long.write_bytes(wav_bytes(chirp(1.3, 16000, seed=1), 16000))
    short.write_bytes(wav_bytes(chirp(0.3, 16000, seed=2), 16000))
    return long, short


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def references(made, clips):
    return [made(clip.samples, return_tensors="pt") for clip in clips]


def features(folder, clip) -> torch.Tensor:
    padded = voxtral_realtime.Streaming.of(folder).padded(clip.samples)
    return torch.from_numpy(audio.log_mel(padded, 128, 1.5))


def test_features_prompt_and_transcripts_are_transformers(
    model, folder, engine, made, clips, references
):
    streaming = voxtral_realtime.Streaming.of(folder)
    assert streaming.delay_tokens == made.num_delay_tokens == DELAY_TOKENS
    for clip, reference in zip(clips, references, strict=True):
        ours = features(folder, clip)
        torch.testing.assert_close(ours, reference["input_features"][0], atol=5e-5, rtol=0)
        ids = voxtral_realtime.prompt_ids(engine.tokenizer, streaming)
        assert ids == reference["input_ids"][0].tolist()
        with torch.no_grad():
            tokens = engine.model.encode(ours)
            expected = model.model.get_audio_features(reference["input_features"])
            torch.testing.assert_close(tokens, expected.pooler_output[0], atol=1e-4, rtol=0)
            # The prompt's logits: its audio tokens are those of its first frames (the
            # encoder is causal), which transformers' forward takes alone.
            frames = len(ids) * model.config.audio_length_per_tok
            logits = model(
                input_ids=reference["input_ids"],
                input_features=reference["input_features"][..., :frames],
                num_delay_tokens=reference["num_delay_tokens"],
            ).logits[0]
            positions = torch.arange(len(ids))
            delay = model_file.delay_embedding(DELAY_TOKENS, 64)
            ours_logits = engine.model.step(
                torch.tensor(ids), tokens[: len(ids)], positions, engine.model.new_keys(64), delay
            )
        torch.testing.assert_close(ours_logits, logits, atol=1e-4, rtol=0)
        result = engine.transcribe(clip)
        assert result.ids == greedy(model, reference)
        assert result.prompt_tokens == len(ids)
    assert [len(greedy(model, r)) for r in references] == [27, 14]


def test_the_encoder_without_its_window_or_a_turned_delay_fails(
    engine, clips, references, monkeypatch, model, folder
):
    expected = greedy(model, references[0])
    ours = features(folder, clips[0])
    with torch.no_grad():
        tokens = engine.model.encode(ours)
    audio_args = engine.model.args.audio
    with monkeypatch.context() as patched:
        patched.setattr(audio_args, "sliding_window", None)
        with torch.no_grad():
            unwindowed = engine.model.encode(ours)
    assert (unwindowed - tokens).abs().max() > 1e-2
    embedding = model_file.delay_embedding

    def swapped(delay, width):
        cos, sin = embedding(delay, width).chunk(2)
        return torch.cat((sin, cos))

    with monkeypatch.context() as patched:
        patched.setattr(voxtral_realtime, "delay_embedding", swapped)
        assert engine.transcribe(clips[0]).ids != expected


def test_run_prints_the_transcript_and_refuses_a_language(folder, made, wavs, references, model):
    text = made.tokenizer.decode(greedy(model, references[1]), skip_special_tokens=True)
    result = llmrun("run", folder, "--audio", wavs[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    refused = llmrun("run", folder, "--audio", wavs[1], "--language", "en")
    assert refused.returncode == 2
    assert refused.stderr == (
        "error: Voxtral Realtime takes no language (it transcribes the language it hears)\n"
    )


def test_a_tekken_json_without_streaming_settings_is_refused(folder, wavs, tmp_path):
    copy = tmp_path / "instruct"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    tekken = json.loads((copy / "tekken.json").read_text())
    tekken["audio"]["transcription_format"] = "instruct"
    (copy / "tekken.json").write_text(json.dumps(tekken))
    result = llmrun("run", copy, "--audio", wavs[1])
    assert result.returncode == 1
    assert result.stderr == f'error: {copy / "tekken.json"}: no streaming "audio" settings\n'

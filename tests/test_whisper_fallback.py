"""Whisper's temperature fallback (llmrun.whisper.Fallback, transcribe(fallback=...)) against
transformers 5.25's generate(temperature=(0.0, 0.2), logprob_threshold=...,
no_speech_threshold=...) on a tiny random Whisper (tests/whisper_helpers.py): the decision
(retry, skip) after a window's greedy first pass equals _need_fallback's, with the
log-probability threshold just above and just below the window's average (the random model's
windows end at max_length), so that the pass fails or holds; a failed pass is decoded again
at the next temperature, as generate's, and that result is kept (sampled: its tokens cannot
equal transformers' RNG); where every pass holds, the ids are generate's greedy ones; a
no-speech skip leaves no tokens, as generate's. An average
over one token more than were scored (openai-whisper's count where no end-of-text ended the
window: the planted bug) decides otherwise. A compression ratio over its threshold fails a
pass. `run --audio --temperature` starts the fallback, seeded (the same seed, the same
transcript).

Tolerances: decisions and ids exact (the thresholds sit 0.01 from the average).
"""

import json

import numpy as np
import pytest
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes
from whisper_helpers import tiny_whisper_dir

from llmrun import api, audio, whisper

transformers = pytest.importorskip("transformers")

SAMPLES = chirp(3.0, 16000, seed=1).astype(np.float32)
TEMPERATURES = (0.0, 0.2)
OFF = {"compression_ratio_threshold": None, "logprob_threshold": None, "no_speech_threshold": None}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    hf = tiny_whisper_dir(path)
    (path / "clip.wav").write_bytes(wav_bytes(SAMPLES, 16000))
    return path, hf


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def features(folder):
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(folder[0])
    return extractor(SAMPLES, sampling_rate=16000, return_tensors="pt").input_features


def transformers_decisions(folder, features, monkeypatch, **thresholds):
    """generate's ids with the fallback, and (temperature, (retry, skip)) of each try."""
    path, hf = folder
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    tries = []
    decide = hf._need_fallback

    def spy(sequence, outputs, index, processors, config, vocab, temperature):
        verdict = decide(sequence, outputs, index, processors, config, vocab, temperature)
        tries.append((temperature, verdict))
        return verdict

    monkeypatch.setattr(hf, "_need_fallback", spy)
    ids = hf.generate(
        features,
        language="en",
        return_timestamps=True,
        temperature=TEMPERATURES,
        **{**OFF, **thresholds},
    )
    ids = ids[0].tolist()
    monkeypatch.undo()
    return ids, tries


def llmrun_decisions(engine, monkeypatch, **thresholds):
    """llmrun's transcription with the fallback, (temperature, (retry, skip)) of each try,
    and each try's average log-probability."""
    tries, averages = [], []
    decide = whisper.Fallback.verdict

    def spy(self, window, text):
        verdict = decide(self, window, text)
        tries.append((window.temperature, verdict))
        averages.append(window.logprob / window.scored)
        return verdict

    monkeypatch.setattr(whisper.Fallback, "verdict", spy)
    fallback = whisper.Fallback(TEMPERATURES, **{**OFF, **thresholds})
    checkpoint = engine.checkpoint
    settings = whisper.Settings.of(checkpoint.generation_config, checkpoint.config)
    clip = audio.Clip(SAMPLES, "clip")
    result = whisper.transcribe(
        engine.model,
        engine.tokenizer,
        settings,
        clip,
        "en",
        timestamps=True,
        fallback=fallback,
        seed=0,
    )
    monkeypatch.undo()
    return result, tries, averages


def test_the_fallback_decides_as_transformers(folder, engine, features, monkeypatch):
    greedy = engine.transcribe(audio.Clip(SAMPLES, "clip"), "en", None, None, True)
    # The first window's greedy average log-probability, and thresholds 0.01 either side.
    _, _, averages = llmrun_decisions(engine, monkeypatch, logprob_threshold=-100.0)
    first = averages[0]
    for threshold, retried in ((first + 0.01, True), (first - 0.01, False)):
        expected_ids, expected = transformers_decisions(
            folder, features, monkeypatch, logprob_threshold=threshold
        )
        result, tries, _ = llmrun_decisions(engine, monkeypatch, logprob_threshold=threshold)
        assert tries[0] == expected[0] == (0.0, (retried, False))
        if retried:  # decoded again at the next temperature, whose result is kept
            assert tries[1][0] == expected[1][0] == TEMPERATURES[1]
            assert result.segments[0].temperature == TEMPERATURES[1]
        else:  # kept: generate's greedy ids
            assert result.ids == expected_ids == greedy.ids
            assert result.segments[0].temperature == 0.0
    # The planted bug: openai-whisper's count of tokens plus one whatever ended the window
    # (the random model's windows end at max_length, with no end-of-text).
    monkeypatch.setattr(whisper.Window, "scored", property(lambda self: len(self.tokens) + 1))
    _, tries, _ = llmrun_decisions(engine, monkeypatch, logprob_threshold=first + 0.01)
    assert tries[0] == (0.0, (False, False))


def test_a_silent_window_is_skipped_as_transformers(folder, engine, features, monkeypatch):
    thresholds = {"logprob_threshold": -1.0, "no_speech_threshold": 0.0}
    expected_ids, expected = transformers_decisions(folder, features, monkeypatch, **thresholds)
    result, tries, _ = llmrun_decisions(engine, monkeypatch, **thresholds)
    assert tries == expected == [(0.0, (False, True))]
    assert result.ids == expected_ids == []
    assert result.text == "" and result.segments == ()


def test_compression_ratio_fails_a_window(engine, monkeypatch):
    _, tries, _ = llmrun_decisions(engine, monkeypatch, compression_ratio_threshold=0.0)
    assert tries[0] == (0.0, (True, False))


def test_schedules_start_at_the_temperature_given():
    assert whisper.Fallback.starting_at(0.0).temperatures == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert whisper.Fallback.starting_at(0.3).temperatures == (0.3, 0.5, 0.7, 0.9)
    assert whisper.Fallback.starting_at(1.5).temperatures == (1.5,)


def test_run_with_a_temperature_falls_back_seeded(folder):
    path, _ = folder
    args = ["run", str(path), "--audio", str(path / "clip.wav"), "--language", "en"]
    args += ["--output-format", "verbose_json", "--temperature", "0.8"]
    first = llmrun(*args, "--seed", "3")
    assert first.returncode == 0, first.stderr
    segments = json.loads(first.stdout)["segments"]
    # The random model fails every try: the last, at 1.0, is kept.
    assert {s["temperature"] for s in segments} == {1.0}
    assert llmrun(*args, "--seed", "3").stdout == first.stdout

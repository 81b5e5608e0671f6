"""Moonshine (llmrun.models.moonshine, llmrun.moonshine) against transformers 5.25 on a tiny
random MoonshineForConditionalGeneration (tests/moonshine_helpers.py): the samples equal
Wav2Vec2FeatureExtractor's (with and without do_normalize), the encoder's output and the
decoder's logits (prefilled in two pieces through the self-attention cache) equal
transformers' forward, and the transcript's ids equal generate's (greedy), its text
batch_decode(skip_special_tokens=True)'s, with generation_config.json's max_length and,
without one, the model card's max_length of 6.5 tokens a second. RoPE turning half-split
instead of adjacent pairs, and a decoder without its causal mask (the planted bugs), fail.
`llmrun run --audio` prints the transcript (--output-format verbose_json: without segments),
`show` says what the folder is; a language, a prompt, translation and srt (Moonshine predicts
no times) are one error line each.

Tolerances: samples, encoder output and logits 1e-4; ids and text exact.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from in_process import llmrun
from moonshine_helpers import tiny_moonshine_dir
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, moonshine
from llmrun.models import moonshine as moonshine_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("moonshine")
    hf, extractor = tiny_moonshine_dir(path)
    (path / "clip.wav").write_bytes(wav_bytes(chirp(3.0, 16000, seed=1), 16000))
    return path, hf, extractor


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def clip(folder):
    return audio.open_audio(folder[0] / "clip.wav")


def generate(hf, extractor, samples, **kwargs) -> tuple[list[int], str]:
    """transformers' greedy ids after the decoder start and end token, and the text."""
    inputs = extractor(samples, sampling_rate=16000, return_tensors="pt")
    out = hf.generate(**inputs, **kwargs)[0].tolist()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf.name_or_path)
    ids = out[1 : out.index(2)] if 2 in out else out[1:]
    return ids, tokenizer.decode(out, skip_special_tokens=True)


def test_samples_encoder_and_cached_logits_equal_transformers(folder, engine, clip, monkeypatch):
    path, hf, extractor = folder
    inputs = extractor(clip.samples, sampling_rate=16000, return_tensors="pt")
    mine = moonshine.samples(clip, moonshine.normalizes(path))
    assert np.abs(mine - inputs["input_values"][0].numpy()).max() < 1e-4
    normalizing = transformers.Wav2Vec2FeatureExtractor(do_normalize=True)
    normalized = normalizing(clip.samples, sampling_rate=16000)["input_values"][0]
    assert np.abs(moonshine.samples(clip, True) - normalized).max() < 1e-4
    model = engine.model
    ids = torch.tensor([[1, 40, 57, 100, 12, 99, 13, 5]])
    with torch.no_grad():
        expected = hf(**inputs, decoder_input_ids=ids)
        encoded = model.encode(torch.from_numpy(mine)[None])
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        cache, cross = model.new_cache(), model.cross_cache(encoded)
        logits = torch.cat(
            [model.decode(ids[:, :3], cache, 0, cross), model.decode(ids[:, 3:], cache, 3, cross)],
            dim=1,
        )
        assert (logits - expected.logits).abs().max() < 1e-4
        # The planted bugs: the decoder's self-attention sees the tokens after each one; RoPE
        # turns x[i] with x[i + d/2] (half-split) instead of adjacent pairs.
        attend = moonshine_model.Attention.forward
        with monkeypatch.context() as patch:
            patch.setattr(
                moonshine_model.Attention,
                "forward",
                lambda self, q, k, v, causal_from: attend(self, q, k, v, None),
            )
            wrong = model.decode(ids, model.new_cache(), 0, cross)
        assert (wrong - expected.logits).abs().max() > 1e-2
        turn = moonshine_model.Rotary.__call__

        def half_split(self, x):
            half = self.cos.shape[-1]
            order = torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()
            turned = turn(self, torch.cat((x[..., order], x[..., 2 * half :]), dim=-1))
            out = turned.clone()
            out[..., order] = turned[..., : 2 * half]
            return out

        monkeypatch.setattr(moonshine_model.Rotary, "__call__", half_split)
        wrong = model.encode(torch.from_numpy(mine)[None])
        assert (wrong - expected.encoder_last_hidden_state).abs().max() > 1e-2


def test_the_transcript_equals_transformers_generate(folder, engine, clip):
    _, hf, extractor = folder
    ids, text = generate(hf, extractor, clip.samples)
    result = engine.transcribe(clip)
    assert (result.ids, result.text, result.language) == (ids, text, None)


def test_without_max_length_a_transcript_stops_at_6_5_tokens_a_second(folder, clip, tmp_path):
    """The model card's generate(max_length=int(samples * 6.5 / 16000)), normalized
    samples too."""
    path, hf, _ = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    generation = json.loads((path / "generation_config.json").read_text())
    del generation["max_length"]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    settings = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**settings, "do_normalize": True})
    )
    extractor = transformers.Wav2Vec2FeatureExtractor.from_pretrained(tmp_path)
    samples = clip.samples[:32000]  # 2 seconds: 13 tokens
    ids, text = generate(hf, extractor, samples, max_length=13)
    engine = api.load(str(tmp_path), device="cpu", transcribe=True)
    result = engine.transcribe(audio.Clip(samples, "short"))
    assert (result.ids, result.text) == (ids, text)
    assert len(result.ids) == 12


def test_run_prints_the_transcript_and_show_says_what_it_is(folder, clip):
    path, hf, extractor = folder
    _, text = generate(hf, extractor, clip.samples)
    result = llmrun("run", str(path), "--audio", str(path / "clip.wav"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    verbose = llmrun(
        "run", str(path), "--audio", str(path / "clip.wav"), "--output-format", "verbose_json"
    )
    assert verbose.returncode == 0, verbose.stderr
    duration = len(clip.samples) / 16000
    assert json.loads(verbose.stdout) == {
        "task": "transcribe",
        "language": None,
        "duration": duration,
        "text": text,
    }
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert (
        "moonshine (speech recognition: 2 encoder and 2 decoder layers over raw 16 kHz audio)"
    ) in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--audio", "clip.wav", "--language", "en"], "Moonshine takes no language"),
        (["--audio", "clip.wav", "--task", "translate"], "Moonshine transcribes; it does not"),
        (["the quick fox", "--audio", "clip.wav"], "Moonshine takes no prompt"),
        (["--audio", "short.wav"], "{path}/short.wav: too short for Moonshine (under 56 ms)"),
        (
            ["--audio", "clip.wav", "--output-format", "srt"],
            "--output-format srt: {path} is a Moonshine model, which predicts no timestamps",
        ),
    ],
    ids=["language", "translate", "prompt", "short", "srt"],
)
def test_a_bad_option_is_one_error_line(folder, args, message):
    path = folder[0]
    (path / "short.wav").write_bytes(wav_bytes(chirp(0.05, 16000), 16000))
    args = [str(path / a) if a.endswith(".wav") else a for a in args]
    result = llmrun("run", str(path), *args)
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message.format(path=path))
    assert result.stderr.count("\n") == 1

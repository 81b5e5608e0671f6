"""Beam search of the speech encoder-decoders (llmrun.seq2seq through llmrun.beam_search)
against transformers 5.25's generate with num_beams > 1: on a tiny random Canary
(tests/canary_helpers.py: a decoder prompt of nine tokens, its end token's bias raised alike
on both sides so that beams end at different steps) the ids equal generate's for 2 to 4
beams, length penalties of 2, 0.5 and -1 and early_stopping True, False and "never", and so
on a tiny Moonshine (its own cache) and Whisper (short with timestamps, with a prompt, and
long-form, its timestamp rules per beam); a cache whose rows are not reordered to the beams
they continue, and the timestamp rules left out of the beams (the planted bugs), fail. A
Speech2Text folder whose config.json asks for 5 beams (as facebook/s2t-* folders do)
decodes with them by default, as transformers does, `run --audio --beams N` overrides it,
serve's /v1/audio/transcriptions follows the folder, and a family that decodes without beams
(Whisper) refuses --beams in one error line.

Tolerances: ids and text exact.
"""

import json

import pytest
import torch
from canary_helpers import tiny_canary_dir
from in_process import llmrun
from serving import served
from speech_to_text_helpers import tiny_speech_to_text_dir
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, transcribers, whisper
from llmrun.errors import UsageError
from llmrun.models import cohere_asr, moonshine

transformers = pytest.importorskip("transformers")

SETTINGS = [
    {"num_beams": 2},
    {"num_beams": 3, "length_penalty": 2.0, "early_stopping": True},
    {"num_beams": 4, "length_penalty": 0.5, "early_stopping": "never"},
    {"num_beams": 4, "length_penalty": -1.0},
]


@pytest.fixture(scope="module")
def canary(tmp_path_factory):
    """Transformers' Canary, its processor, llmrun's engine and the clip, </s> raised."""
    path = tmp_path_factory.mktemp("canary")
    hf, processor = tiny_canary_dir(path, seed=2)
    (path / "clip.wav").write_bytes(wav_bytes(chirp(3.0, 16000, seed=1), 16000))
    engine = api.load(str(path), device="cpu", transcribe=True)
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        hf.proj_out.bias[eos] += 0.8
        engine.model.proj_out.bias[eos] += 0.8
    return hf, processor, engine, audio.open_audio(path / "clip.wav")


def _canary_beams(canary, setting, monkeypatch) -> tuple[list[int], list[int]]:
    """transformers' ids after the decoder prompt (up to the end token) and llmrun's."""
    hf, processor, engine, clip = canary
    inputs = processor.apply_transcription_request(audio=clip.samples, source_language="en")
    with torch.no_grad():
        out = hf.generate(**inputs, **setting)[0].tolist()[inputs["decoder_input_ids"].shape[1] :]
    eos = hf.generation_config.eos_token_id
    expected = out[: out.index(eos)] if eos in out else out
    generation = {**engine.checkpoint.generation_config, **setting}
    monkeypatch.setattr(engine.checkpoint, "generation_config", generation)
    return expected, engine.transcribe(clip, "en").ids


def test_canary_beams_are_transformers_generate(canary, monkeypatch):
    lengths = []
    for setting in SETTINGS:
        expected, ids = _canary_beams(canary, setting, monkeypatch)
        assert ids == expected, setting
        lengths.append(len(ids))
    assert len(set(lengths)) >= 3 and max(lengths) > 20  # searches that ended apart
    # The planted bug: each beam goes on from its own row's cache, not its parent's.
    monkeypatch.setattr(cohere_asr.SelfCache, "reorder_rows", lambda self, rows: None)
    wrong = [_canary_beams(canary, s, monkeypatch) for s in SETTINGS]
    assert any(ids != expected for expected, ids in wrong)


def test_moonshine_beams_are_transformers_generate(tmp_path, monkeypatch):
    """Moonshine's own self-attention cache, reordered to the beams."""
    from moonshine_helpers import tiny_moonshine_dir

    hf, extractor = tiny_moonshine_dir(tmp_path, seed=1)
    clip = audio.Clip(chirp(3.0, 16000, seed=1).astype("float32"), "chirp")
    engine = api.load(str(tmp_path), device="cpu", transcribe=True)
    inputs = extractor(clip.samples, sampling_rate=16000, return_tensors="pt")
    eos = hf.generation_config.eos_token_id
    greedy = engine.transcribe(clip, num_beams=1).ids
    for beams in (2, 4):
        with torch.no_grad():
            out = hf.generate(**inputs, num_beams=beams)[0].tolist()[1:]
        expected = out[: out.index(eos)] if eos in out else out
        assert engine.transcribe(clip, num_beams=beams).ids == expected != greedy, beams
    monkeypatch.setattr(moonshine.SelfCache, "reorder_rows", lambda self, rows: None)
    assert engine.transcribe(clip, num_beams=4).ids != expected  # the planted bug


@pytest.fixture(scope="module")
def s2t(tmp_path_factory):
    """A Speech2Text folder as the Hub's facebook/s2t-* are: no generation_config.json,
    num_beams 5 in config.json; transformers' model of it, its processor, the clip."""
    path = tmp_path_factory.mktemp("s2t")
    _, processor = tiny_speech_to_text_dir(path, seed=2)
    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config.update(num_beams=5, max_length=30, early_stopping=True)
    (path / "config.json").write_text(json.dumps(config))
    hf = transformers.Speech2TextForConditionalGeneration.from_pretrained(path).eval()
    (path / "clip.wav").write_bytes(wav_bytes(chirp(3.0, 16000, seed=1), 16000))
    return path, hf, processor, audio.open_audio(path / "clip.wav")


def test_a_folder_s_num_beams_is_the_default_and_beams_override_it(s2t):
    path, hf, processor, clip = s2t
    inputs = processor(clip.samples, sampling_rate=16000, return_tensors="pt")
    texts = {}
    for beams in (None, 1, 2):
        kw = {} if beams is None else {"num_beams": beams}
        with torch.no_grad():
            out = hf.generate(**inputs, **kw)
        texts[beams] = processor.batch_decode(out, skip_special_tokens=True)[0]
    assert texts[None] != texts[1]  # the file's 5 beams are not greedy
    wav = str(path / "clip.wav")
    assert llmrun("run", str(path), "--audio", wav).stdout == texts[None] + "\n"
    for beams in (1, 2):
        result = llmrun("run", str(path), "--audio", wav, "--beams", str(beams))
        assert (result.returncode, result.stdout) == (0, texts[beams] + "\n")
    engine = api.load(str(path), device="cpu", transcribe=True)
    for client in served(engine, "s2t"):
        answer = client.post(
            "/v1/audio/transcriptions",
            data={"model": "s2t"},
            files={"file": ("clip.wav", (path / "clip.wav").read_bytes(), "audio/wav")},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"] == texts[None]


def test_too_many_beams_and_a_family_without_beams_are_refused(s2t, monkeypatch):
    path, wav = s2t[0], str(s2t[0] / "clip.wav")
    result = llmrun("run", str(path), "--audio", wav, "--beams", "40")
    assert (result.returncode, result.stderr) == (
        2,
        "error: the number of beams must be between 1 and 32, got 40\n",
    )
    engine = api.load(str(path), device="cpu", transcribe=True)
    monkeypatch.setattr(transcribers, "BEAMED", frozenset())  # as Voxtral Realtime
    with pytest.raises(UsageError, match="a Speech2Text model, which decodes without beams"):
        engine.transcribe(s2t[3], num_beams=2)
    assert engine.transcribe(s2t[3], num_beams=1).text


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory):
    """A tiny random Whisper (tests/whisper_helpers.py), llmrun's engine and transformers'
    tokenizer and feature extractor of it."""
    from whisper_helpers import tiny_whisper_dir

    path = tmp_path_factory.mktemp("whisper")
    hf = tiny_whisper_dir(path)
    engine = api.load(str(path), device="cpu", transcribe=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    return path, hf, engine, tokenizer, extractor


WHISPER_CASES = [
    (3.0, {"language": "de", "return_timestamps": True}, SETTINGS[1]),
    (3.0, {"prompt": "the quick fox"}, SETTINGS[3]),
    (45.0, {"language": "de"}, SETTINGS[2]),  # long-form: a window at a time
]


def _whisper_beams(whisper_folder, seconds, options, setting, monkeypatch):
    """transformers' generate's ids and llmrun's, for a chirp of `seconds`."""
    path, hf, engine, tokenizer, extractor = whisper_folder
    samples = chirp(seconds, 16000, seed=2).astype("float32")
    long = {"truncation": False, "padding": "longest", "return_attention_mask": True}
    inputs = extractor(
        samples, sampling_rate=16000, return_tensors="pt", **(long if seconds > 30 else {})
    )
    kwargs = {k: v for k, v in options.items() if k != "prompt"}
    if "prompt" in options:
        kwargs["prompt_ids"] = tokenizer.get_prompt_ids(options["prompt"], return_tensors="pt")
    if seconds > 30:
        kwargs["attention_mask"] = inputs.attention_mask
    # generate changes its model's generation config (long-form's max_length): the file's
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    with torch.no_grad():
        expected = hf.generate(inputs.input_features, **kwargs, **setting)[0].tolist()
    generation = {**engine.checkpoint.generation_config, **setting}
    monkeypatch.setattr(engine.checkpoint, "generation_config", generation)
    result = engine.transcribe(
        audio.Clip(samples, "chirp"),
        options.get("language"),
        None,
        options.get("prompt"),
        bool(options.get("return_timestamps")),
    )
    return expected, result.ids


def test_whisper_beams_are_transformers_generate(whisper_folder, monkeypatch):
    timestamp = whisper_folder[3].convert_tokens_to_ids("<|0.00|>")
    for seconds, options, setting in WHISPER_CASES:
        expected, ids = _whisper_beams(whisper_folder, seconds, options, setting, monkeypatch)
        assert ids == expected, (seconds, options, setting)
        assert len(set(ids)) > 10 or "prompt" in options  # varied, timestamps among them
    assert any(t >= timestamp for t in ids)
    # The planted bug: the timestamp rules left out of the beams.
    monkeypatch.setattr(whisper.Decoder, "_timestamp_rules", lambda self, logits, out: None)
    expected, ids = _whisper_beams(whisper_folder, *WHISPER_CASES[0], monkeypatch)
    assert ids != expected

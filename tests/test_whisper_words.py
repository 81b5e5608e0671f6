"""Whisper's word timestamps (llmrun.whisper_words, llmrun.whisper.transcribe(words=True))
against transformers 5.25 on a tiny random Whisper with alignment_heads
(tests/whisper_helpers.py): each token's time equals
generate(return_token_timestamps=True, return_segments=True)'s (the segments'
token_timestamps, with the attention mask that crops the weights to the audio), for a short
clip and a long one; the words and their times equal the ASR pipeline's
return_timestamps="word" chunks; the dynamic time warping equals
_dynamic_time_warping's path on a matrix full of ties; the grouping of tokens into words
(spaces, punctuation joined before and after, whole characters for Japanese) equals
_collate_word_timestamps's. A wrong alignment head (the planted bug) fails.
`run --audio --output-format verbose_json --word-timestamps` prints OpenAI's "words"; a
folder without alignment_heads, and --word-timestamps without verbose_json, are one error
line each.

Tolerances: token times 1e-6 s (they are 20 ms steps); word texts and times exact (times
rounded to 10 ms by both).
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes
from whisper_helpers import tiny_whisper_dir

from llmrun import api, audio, whisper, whisper_words

transformers = pytest.importorskip("transformers")
from transformers.models.whisper import generation_whisper, tokenization_whisper  # noqa: E402

# transformers' std() over a window past the audio's end, which has no frames
pytestmark = pytest.mark.filterwarnings("ignore:std:UserWarning")
HEADS = [[0, 1], [1, 0], [1, 1]]
SAMPLES = chirp(3.0, 16000, seed=1).astype(np.float32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    hf = tiny_whisper_dir(path, alignment_heads=HEADS)
    (path / "clip.wav").write_bytes(wav_bytes(SAMPLES, 16000))
    return path, hf


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


def inputs(path, samples):
    """The features and attention mask as the ASR pipeline makes them."""
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    long = {"truncation": False, "padding": "longest"} if len(samples) > 480000 else {}
    return extractor(
        samples, sampling_rate=16000, return_tensors="pt", return_attention_mask=True, **long
    )


def token_times(folder, samples) -> tuple[list[int], list[float]]:
    """transformers' generated ids and each one's time (its segment's token_timestamps)."""
    path, hf = folder
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    features = inputs(path, samples)
    out = hf.generate(
        features.input_features,
        attention_mask=features.attention_mask,
        language="en",
        return_timestamps=True,
        return_token_timestamps=True,
        return_segments=True,
    )
    times = torch.cat([s["token_timestamps"] for s in out["segments"][0]])
    return out["sequences"][0].tolist(), times.tolist()


def settings(engine, **changes) -> whisper.Settings:
    """The folder's settings, with `changes`."""
    checkpoint = engine.checkpoint
    found = whisper.Settings.of(checkpoint.generation_config, checkpoint.config)
    return dataclasses.replace(found, **changes)


def transcribe(engine, samples, **kwargs):
    chosen = kwargs.pop("settings", None) or settings(engine)
    clip = audio.Clip(samples, "clip")
    return whisper.transcribe(engine.model, engine.tokenizer, chosen, clip, "en", **kwargs)


@pytest.fixture(scope="module")
def short_times(folder):
    """transformers' ids and token times of SAMPLES."""
    return token_times(folder, SAMPLES)


@pytest.mark.parametrize("seconds", [3.0, 34.0], ids=["short", "long"])
def test_token_times_and_words_equal_transformers(folder, engine, short_times, seconds):
    path, hf = folder
    samples = SAMPLES if seconds == 3.0 else chirp(seconds, 16000, seed=2).astype(np.float32)
    ids, times = short_times if seconds == 3.0 else token_times(folder, samples)
    result = transcribe(engine, samples, words=True)
    assert result.ids == ids
    assert len({s.seek for s in result.segments}) >= 2  # times offset per window
    assert np.abs(np.array(result.token_times) - times).max() < 1e-6
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    pipe = transformers.pipeline(
        "automatic-speech-recognition",
        model=hf,
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        feature_extractor=transformers.WhisperFeatureExtractor.from_pretrained(path),
        device="cpu",
    )
    # The pipeline's own defaults (5 beams, 256 new tokens) off: generate's greedy decoding.
    expected = pipe(
        samples.copy(),
        return_timestamps="word",
        generate_kwargs={"language": "en", "num_beams": 1, "max_length": 48},
    )
    assert [(w.word, (w.start, w.end)) for w in result.words] == [
        (c["text"], c["timestamp"]) for c in expected["chunks"]
    ]
    assert len(result.words) >= 3


def test_a_wrong_alignment_head_is_not_transformers(engine, short_times):
    _, times = short_times
    planted = settings(engine, alignment_heads=((0, 0), (1, 0), (1, 1)))
    wrong = transcribe(engine, SAMPLES, words=True, settings=planted)
    assert np.abs(np.array(wrong.token_times) - times).max() > 1e-6


def test_dynamic_time_warping_is_transformers_on_ties():
    rng = np.random.default_rng(0)
    matrix = rng.integers(0, 3, size=(9, 40)).astype(np.float64)  # many equal costs
    mine = whisper_words.dynamic_time_warping(matrix)
    theirs = generation_whisper._dynamic_time_warping(matrix)
    assert [a.tolist() for a in mine] == [a.tolist() for a in theirs]


@pytest.mark.parametrize(
    ("text", "language"),
    [
        (' "Hello, (quick) fox!" der schnelle-fuchs... ¿speech? «ü» 30 seconds.', "en"),
        ("だ 音声 テキスト、 ü", "ja"),
    ],
    ids=["spaces", "unicode"],
)
def test_tokens_group_into_words_as_transformers(folder, engine, text, language):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder[0])
    ids = tokenizer.encode(text, add_special_tokens=False)
    spans = [(round(i * 0.1, 2), round(i * 0.1 + 0.05, 2)) for i in range(len(ids))]
    name = {"en": "english", "ja": "japanese"}[language]
    expected = tokenization_whisper._collate_word_timestamps(tokenizer, ids, spans, name, False)
    words = whisper_words.words(engine.tokenizer, ids, spans, language)
    assert [(w.word, (w.start, w.end)) for w in words] == [
        (e["text"], e["timestamp"]) for e in expected
    ]
    assert len(words) >= 4


def test_run_prints_words_in_verbose_json(folder, engine):
    path, _ = folder
    args = ["run", str(path), "--audio", str(path / "clip.wav"), "--language", "en"]
    result = llmrun(*args, "--output-format", "verbose_json", "--word-timestamps")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    clip = audio.open_audio(path / "clip.wav")
    expected = transcribe(engine, clip.samples, words=True)
    assert body["words"] == [
        {"word": w.word.strip(), "start": w.start, "end": w.end} for w in expected.words
    ]
    assert [s["tokens"] for s in body["segments"]] == [s.tokens for s in expected.segments]
    wrong = llmrun(*args, "--word-timestamps")
    assert wrong.returncode != 0
    assert wrong.stderr == (
        "error: --word-timestamps goes with --audio and --output-format verbose_json\n"
    )


def test_a_folder_without_alignment_heads_is_one_error_line(folder, tmp_path):
    path, _ = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((path / "generation_config.json").read_text())
    del config["alignment_heads"]
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    args = ["--audio", str(path / "clip.wav"), "--output-format", "verbose_json"]
    result = llmrun("run", str(tmp_path), *args, "--word-timestamps")
    assert result.returncode != 0
    assert result.stderr.startswith(
        "error: word timestamps: this Whisper model's generation_config.json has no alignment_heads"
    )
    assert result.stderr.count("\n") == 1

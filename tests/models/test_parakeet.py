"""Parakeet (llmrun.models.parakeet, llmrun.parakeet) against transformers 5.25 on tiny random
ParakeetForTDT, ParakeetForRNNT and ParakeetForCTC folders (tests/parakeet_helpers.py): the
features equal ParakeetFeatureExtractor's, the encoder's output, the CTC logits, the
projected encoding and the joint's logits over the prediction network's states (stepped
token by token) equal transformers' forward (its lattice of every position and token), and
the transcripts' ids and text equal generate's and the processor's batch_decode's for a
long and a short clip (TDT's durations, RNN-T's max_symbols_per_step, the length cap and
CTC's collapse all taken). A TDT decoded as an RNN-T (its durations ignored: the planted bug)
fails. The transducers' token times (start, end) equal the processor's decode of generate's
durations (a TDT's and an RNN-T's), and a planted bug (every token a frame late) fails;
words and segments of a constructed transcript are the tokenizer's words (its word_ids) cut
after ".", "?" and "!". `llmrun run --audio` prints the transcript and its json, verbose_json
(with segments and, with --word-timestamps, words) and srt, `show` says what the folder is;
a language, CTC's srt or words and `chat` are one error line each.

Tolerances: features, encoder output and logits 1e-4; ids, text and times exact.
"""

import json

import pytest
import torch
from audio_checks import chirp_wavs
from in_process import llmrun
from parakeet_helpers import tiny_parakeet_dir, token_times, transcript

from llmrun import api, audio, canary, parakeet
from llmrun import transcript_formats as formats

transformers = pytest.importorskip("transformers")
KINDS = ("tdt", "rnnt", "ctc")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        made[kind] = (path, *tiny_parakeet_dir(path, kind, seed=1))
    chirp_wavs(made["tdt"][0], 3.0, 1.6)
    return made


@pytest.fixture(scope="module")
def engines(folders):
    return {k: api.load(str(folders[k][0]), device="cpu", transcribe=True) for k in KINDS}


@pytest.fixture(scope="module")
def clips(folders):
    path = folders["tdt"][0]
    return [audio.open_audio(path / name) for name in ("long.wav", "short.wav")]


@pytest.mark.parametrize("kind", KINDS)
def test_features_encoder_and_logits_equal_transformers(folders, engines, clips, kind):
    path, hf, processor = folders[kind]
    model = engines[kind].model
    samples = clips[0].samples
    inputs = processor(samples, sampling_rate=16000)
    features = canary.features(samples, canary.feature_size(path))
    assert (features - inputs["input_features"][0]).abs().max() < 1e-4
    valid = features.shape[0] - 1
    with torch.no_grad():
        encoded = model.encode(features, valid)
        reference = hf.encoder(**inputs).last_hidden_state[0]
        positions = model.args.encoder.tokens(valid)
        assert (encoded - reference)[:positions].abs().max() < 1e-4
        if kind == "ctc":
            logits = model.ctc_logits(encoded)
            assert (logits - hf(**inputs).logits[0])[:positions].abs().max() < 1e-4
            return
        ids = [model.args.blank_token_id, 5, 9, 5, 30]
        expected = hf(**inputs, decoder_input_ids=torch.tensor([ids])).logits[0]  # [T, U, V]
        projected = model.project(encoded)
        state, rows = None, []
        for token in ids:
            predicted, state = model.predict(token, state)
            rows.append(torch.stack([model.joint(p, predicted) for p in projected]))
        assert (torch.stack(rows, dim=1) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_transcripts_equal_transformers_generate(folders, engines, clips, kind):
    hf, processor = folders[kind][1:]
    for clip in reversed(clips):
        ids, text = transcript(hf, processor, clip.samples)
        result = engines[kind].transcribe(clip)
        assert (result.ids, result.text) == (ids, text)
        assert ids  # the random model's blanks are not all it emits
    assert len(set(ids)) > 2  # the long clip's: a transcript that the audio and decoder shape


def test_a_tdt_decoded_without_its_durations_differs(folders, engines, clips, monkeypatch):
    ids, _ = transcript(*folders["tdt"][1:], clips[0].samples)
    monkeypatch.setattr(parakeet, "TDT", "not parakeet_tdt")  # decoded as an RNN-T
    assert engines["tdt"].transcribe(clips[0]).ids != ids


@pytest.mark.parametrize("kind", ("tdt", "rnnt"))
def test_token_times_equal_the_processor_s(folders, engines, clips, kind, monkeypatch):
    hf, processor = folders[kind][1:]
    expected = token_times(hf, processor, clips[0].samples)
    timed = []
    real = parakeet.token_spans

    def spy(tokenizer, steps, moves, *rest):
        timed.append(real(tokenizer, steps, moves, *rest))
        late = [move + (i == 0) for i, move in enumerate(moves)]  # the planted bug
        timed.append(real(tokenizer, steps, late, *rest))
        return timed[0]

    monkeypatch.setattr(parakeet, "token_spans", spy)
    result = engines[kind].transcribe(clips[0], timestamps=True, words=True)
    assert timed[0] == expected
    assert timed[1] != expected
    assert len(expected) == len(result.ids) and len(set(expected)) >= 3
    if kind == "tdt":  # durations, not one frame each
        assert {round((end - start) / 0.08) for start, end in expected} - {0, 1}
    assert result.segments[0].start == expected[0][0]
    assert result.words[0].start == round(expected[0][0], 3)


def test_words_and_segments_of_a_transcript(folders, engines):
    from tokenizers import Tokenizer

    text = "the quick brown fox. speech to text! parakeet listens"
    encoding = Tokenizer.from_file(str(folders["tdt"][0] / "tokenizer.json")).encode(text)
    ids = encoding.ids
    spans = [(0.08 * i, 0.08 * (i + 2)) for i in range(len(ids))]
    logprobs = [-0.5 * i for i in range(len(ids))]
    firsts = {}
    for index, word in enumerate(encoding.word_ids):
        firsts.setdefault(word, []).append(index)
    expected = [
        (name, round(spans[firsts[w][0]][0], 3), round(spans[firsts[w][-1]][1], 3))
        for w, name in enumerate(text.split())
    ]
    assert any(len(group) > 1 for group in firsts.values())  # a word of several tokens
    tokenizer = engines["tdt"].tokenizer
    words = parakeet.timed_words(tokenizer, ids, spans)
    assert [(w.word.strip(), w.start, w.end) for w in words] == expected
    segments = parakeet.timed_segments(tokenizer, ids, spans, logprobs)
    cuts = [firsts[3][-1] + 1, firsts[6][-1] + 1, len(ids)]  # after "fox." and "text!"
    assert [s.text for s in segments] == [
        " the quick brown fox.",
        " speech to text!",
        " parakeet listens",
    ]
    assert [(s.start, s.end) for s in segments] == [
        (spans[a][0], spans[b - 1][1]) for a, b in zip([0, *cuts[:2]], cuts, strict=True)
    ]
    assert segments[1].tokens == ids[cuts[0] : cuts[1]]
    assert segments[2].avg_logprob == sum(logprobs[cuts[1] :]) / (len(ids) - cuts[1])
    assert formats.srt(segments).startswith("1\n00:00:00,000 --> 00:00:")


def test_run_prints_the_transcript_and_show_says_what_it_is(folders, engines, clips):
    path, hf, processor = folders["tdt"]
    wav = str(path / "long.wav")
    ids, text = transcript(hf, processor, clips[0].samples)
    result = llmrun("run", str(path), "--audio", wav)
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    result = llmrun("run", str(path), "--audio", wav, "--output-format", "json")
    assert json.loads(result.stdout)["text"] == text
    assert json.loads(result.stdout)["usage"]["output_tokens"] == len(ids)
    timed = engines["tdt"].transcribe(clips[0], timestamps=True, words=True)
    first = token_times(hf, processor, clips[0].samples)[0][0]
    verbose = ("--output-format", "verbose_json")
    result = llmrun("run", str(path), "--audio", wav, *verbose, "--word-timestamps")
    body = json.loads(result.stdout)
    assert body == formats.verbose_json(text, None, "transcribe", 3.0, timed.segments, timed.words)
    assert body["segments"][0]["start"] == body["words"][0]["start"] == first
    assert "words" not in json.loads(llmrun("run", str(path), "--audio", wav, *verbose).stdout)
    result = llmrun("run", str(path), "--audio", wav, "--output-format", "srt")
    assert result.stdout == formats.srt(timed.segments)
    assert result.stdout.startswith(f"1\n{formats.timestamp(first, ',')} --> ")
    shown = llmrun("show", str(folders["ctc"][0]))
    assert shown.returncode == 0, shown.stderr
    # every parameter transformers' model has, the encoder's too
    assert f"({sum(p.numel() for p in folders['ctc'][1].parameters()):,})\n" in shown.stdout
    assert (
        "parakeet_ctc (speech recognition: 2 encoder (FastConformer) layers and a CTC head, "
        "16 mel bins)"
    ) in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--audio", "long.wav", "--language", "en"], "Parakeet takes no language"),
        (["run", "--audio", "long.wav", "--output-format", "srt"], "--output-format srt: "),
        (
            ["run", "--audio", "long.wav", "--output-format", "verbose_json", "--word-timestamps"],
            "{path} is a Parakeet model: llmrun times words with Whisper and Parakeet TDT",
        ),
        (["run", "--audio", "long.wav", "--task", "translate"], "Parakeet transcribes; it does"),
        (["chat"], "{path} is a speech recognition model (Parakeet): transcribe with"),
    ],
    ids=["language", "ctc-srt", "ctc-words", "translate", "chat"],
)
def test_what_it_cannot_do_is_one_error_line(folders, args, message):
    wavs = folders["tdt"][0]
    path = folders["ctc" if "--output-format" in args else "tdt"][0]
    command, *rest = args
    rest = [str(wavs / a) if a.endswith(".wav") else a for a in rest]
    result = llmrun(command, str(path), *rest, input="")
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message.format(path=path)), result.stderr
    assert result.stderr.count("\n") == 1

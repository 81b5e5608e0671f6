"""Whisper (llmrun.models.whisper, llmrun.whisper) against transformers 5.25 on a tiny random
WhisperForConditionalGeneration (tests/whisper_helpers.py): the log-mel features equal
WhisperFeatureExtractor's, the encoder's output and the decoder's logits (prefilled in two
pieces through the self-attention cache, the cross-attention's keys and values computed
once) equal transformers' forward, and the transcript's ids equal
WhisperForConditionalGeneration.generate's (greedy) with the language detected or given
(by code or name), translation, an initial prompt, the old forced_decoder_ids, timestamps
asked for by generation_config.json and half
weights (the Hub's files: llmrun keeps them half, transformers runs them in f32), its text
batch_decode(skip_special_tokens=True)'s; a clip over 30 seconds is generate's long-form
transcription of the whole clip's features (truncation=False), timestamps and all, with
and without a language and a prompt. A decoder without its causal mask, or decoding without
suppress_tokens (the planted bugs), fails.
Asked for timestamps, a short clip and a long one give generate(return_timestamps=True,
return_segments=True)'s segments: tokens, start and end times, texts (decode's), each
window split as _retrieve_segment splits it (every branch, on made-up windows too); each
segment with its window's openai-whisper scores: avg_logprob from generate's scores,
compression_ratio of the window's text, no_speech_prob from transformers' forward. Times
off by a factor (the planted bug) fail.
`llmrun run --audio` prints the transcript (--output-format srt and verbose_json: those
segments), `show` says what the folder is, and bad options, a Whisper model without audio
and whisper.cpp's ggml files are one error line each.

Tolerances: features, encoder output and logits 1e-4; avg_logprob and no_speech_prob 1e-4;
ids, text, times and compression_ratio exact.
"""

import dataclasses
import json
import shutil
import zlib

import numpy as np
import pytest
import torch
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes
from whisper_helpers import reference_segments, subtitle_cues, tiny_whisper_dir

from llmrun import api, audio, whisper
from llmrun.models import whisper as whisper_model

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(3.0, 16000, seed=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    hf = tiny_whisper_dir(path)
    (path / "clip.wav").write_bytes(wav_bytes(SAMPLES, 16000))
    return path, hf


def generate(folder, features, **kwargs):
    """transformers' generate with the folder's generation config as saved (generate
    changes its model's, e.g. max_length in long-form)."""
    path, hf = folder
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return hf.generate(features, **kwargs)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def reference(folder):
    """The clip as llmrun decodes it, and transformers' features and tokenizer for it."""
    path, _ = folder
    clip = audio.open_audio(path / "clip.wav")
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    features = extractor(clip.samples, sampling_rate=16000, return_tensors="pt").input_features
    return clip, features, transformers.AutoTokenizer.from_pretrained(path)


def test_features_encoder_and_cached_logits_equal_transformers(
    folder, engine, reference, monkeypatch
):
    _, hf = folder
    clip, features, _ = reference
    mine = whisper.features(clip, 80)
    assert np.abs(mine - features[0].numpy()).max() < 1e-4
    model = engine.model
    ids = torch.tensor([[331, 335, 341, 342, 40, 57, 200, 12, 99, 250]])
    with torch.no_grad():
        encoded = model.encode(features)
        expected = hf(input_features=features, decoder_input_ids=ids)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        cache, cross = model.new_cache(), model.cross_cache(encoded)
        logits = torch.cat(
            [model.decode(ids[:, :6], cache, 0, cross), model.decode(ids[:, 6:], cache, 6, cross)],
            dim=1,
        )
        assert (logits - expected.logits).abs().max() < 1e-4
        # The planted bug: the decoder's self-attention sees the tokens after each one.
        attend = whisper_model.Attention.forward
        monkeypatch.setattr(
            whisper_model.Attention,
            "forward",
            lambda self, x, k, v, causal_from: attend(self, x, k, v, None),
        )
        wrong = model.decode(ids, model.new_cache(), 0, cross)
        assert (wrong - expected.logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"language": "de"},
        {"language": "french", "task": "translate"},
        {"task": "translate"},
        {"prompt": "the quick fox"},
    ],
    ids=["detected", "code", "name-translate", "translate", "prompt"],
)
def test_transcripts_equal_transformers_generate(folder, engine, reference, options):
    _, hf = folder
    clip, features, tokenizer = reference
    kwargs = {k: v for k, v in options.items() if k != "prompt"}
    if "prompt" in options:
        kwargs["prompt_ids"] = tokenizer.get_prompt_ids(options["prompt"], return_tensors="pt")
    expected = generate(folder, features, **kwargs)
    result = engine.transcribe(
        clip, options.get("language"), options.get("task"), options.get("prompt")
    )
    assert result.ids == expected[0].tolist()
    assert result.text == tokenizer.batch_decode(expected, skip_special_tokens=True)[0]
    if "language" not in options:  # the detected one, as generate's detect_language has it
        detected = hf.detect_language(features)[0].item()
        assert result.language == tokenizer.convert_ids_to_tokens(detected).strip("<|>")


def test_decoding_without_suppress_tokens_is_not_transformers(engine, folder, reference):
    clip, features, _ = reference
    settings = whisper.Settings.of(engine.checkpoint.generation_config, engine.checkpoint.config)
    planted = dataclasses.replace(settings, suppress=())
    result = whisper.transcribe(engine.model, engine.tokenizer, planted, clip, "en")
    assert result.ids != generate(folder, features, language="en")[0].tolist()


@pytest.mark.parametrize("kind", ["forced_decoder_ids", "return_timestamps", "english_only"])
def test_other_generation_configs(folder, reference, tmp_path, kind):
    """The old forced_decoder_ids ([[1, None], [2, <|transcribe|>]]) of the first Hub
    folders, timestamps asked for a short clip with a cap on the first one, and an
    English-only model's (*.en: no languages or tasks, <|notimestamps|> forced)."""
    path, hf = folder
    clip, features, _ = reference
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((path / "generation_config.json").read_text())
    if kind == "forced_decoder_ids":
        config["forced_decoder_ids"] = [[1, None], [2, config["task_to_id"]["transcribe"]]]
    elif kind == "return_timestamps":
        config.update(return_timestamps=True, max_initial_timestamp_index=5)
    else:
        del config["lang_to_id"], config["task_to_id"]
        config["is_multilingual"] = False
        config["forced_decoder_ids"] = [[1, config["no_timestamps_token_id"]]]
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    expected = generate((tmp_path, hf), features)[0].tolist()
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip)
    assert result.ids == expected


def test_a_half_folder_as_the_hub_s_transcribes_as_transformers(folder, reference, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = folder
    clip, features, _ = reference
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    save_file({k: v.half() for k, v in weights.items()}, tmp_path / "model.safetensors")
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    expected = hf.generate(features, language="en")[0].tolist()
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip, "en")
    assert result.ids == expected


@pytest.mark.parametrize(
    ("seconds", "options"),
    [(34.0, {}), (65.0, {"language": "de", "prompt": "the quick fox"})],
    ids=["detected", "language-prompt"],
)
def test_a_long_clip_is_transformers_long_form_generate(
    folder, engine, reference, seconds, options, monkeypatch
):
    path, _ = folder
    tokenizer = reference[2]
    samples = chirp(seconds, 16000, seed=2).astype(np.float32)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    inputs = extractor(
        samples,
        sampling_rate=16000,
        return_tensors="pt",
        truncation=False,
        padding="longest",
        return_attention_mask=True,
    )
    assert inputs.input_features.shape[-1] > 3000  # generate's long-form
    kwargs = {"language": options.get("language")}
    if "prompt" in options:
        kwargs["prompt_ids"] = tokenizer.get_prompt_ids(options["prompt"], return_tensors="pt")
    expected = generate(
        folder, inputs.input_features, attention_mask=inputs.attention_mask, **kwargs
    )
    windows = []
    kept = whisper.split_window
    monkeypatch.setattr(whisper, "split_window", lambda *a: windows.append(a) or kept(*a))
    result = engine.transcribe(
        audio.Clip(samples, "long"), options.get("language"), None, options.get("prompt")
    )
    assert len(windows) >= 2
    assert result.ids == expected[0].tolist()
    assert any(t > tokenizer.convert_tokens_to_ids("<|notimestamps|>") for t in result.ids)
    assert result.text == tokenizer.batch_decode(expected, skip_special_tokens=True)[0]


def test_run_prints_the_transcript_and_show_says_what_it_is(folder, reference):
    path, hf = folder
    _, features, tokenizer = reference
    expected = generate(folder, features, language="de")
    result = llmrun("run", str(path), "--audio", str(path / "clip.wav"), "--language", "de")
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.batch_decode(expected, skip_special_tokens=True)[0] + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"({sum(p.numel() for p in hf.parameters()):,})\n" in shown.stdout  # the encoder's too
    assert "whisper (speech recognition: 2 encoder and 2 decoder layers, 80 mel bins)" in (
        shown.stdout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--audio", "clip.wav", "--task", "sum"],
            "task 'sum': Whisper's are transcribe and translate",
        ),
        (
            ["--audio", "clip.wav", "--language", "klingon"],
            "language 'klingon': not one Whisper knows",
        ),
        (["hello"], "{path} is a speech recognition model (Whisper): transcribe with `llmrun run"),
        (
            ["--audio", "clip.wav", "--output-format", "tsv"],
            "--output-format 'tsv': give json, text, srt, verbose_json, vtt",
        ),
        (
            ["--audio", "clip.wav", "--audio", "clip.wav", "--output-format", "vtt"],
            "--output-format vtt takes one --audio",
        ),
        (["hello", "--output-format", "srt"], "--output-format goes with --audio"),
    ],
    ids=["task", "language", "no-audio", "format", "two-subtitles", "format-no-audio"],
)
def test_a_bad_option_is_one_error_line(folder, args, message):
    path, _ = folder
    args = [str(path / a) if a == "clip.wav" else a for a in args]
    result = llmrun("run", str(path), *args)
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message.format(path=path))
    assert result.stderr.count("\n") == 1


def test_whisper_cpp_s_ggml_files_are_refused_by_name(folder, tmp_path):
    model = tmp_path / "ggml-base.en.bin"
    model.write_bytes(b"lmgg" + bytes(64))
    result = llmrun("run", str(model), "--audio", str(folder[0] / "clip.wav"))
    assert result.returncode != 0
    assert result.stderr.startswith(f"error: {model}: a whisper.cpp ggml model")


def segment_differences(segments, expected, tokenizer) -> list[str]:
    """Where llmrun's segments differ from transformers' (reference_segments): tokens,
    times, text; their window's avg_logprob (openai-whisper's: the chosen tokens'
    log-probabilities under generate's scores, end-of-text's included, over their number
    plus one) and compression_ratio (the window's text over its zlib compression); one
    seek per window."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if len(segments) != len(expected):
        return [f"{len(segments)} segments, not {len(expected)}"]
    wrong, seeks = [], {}
    for mine, theirs in zip(segments, expected, strict=True):
        for name in ("tokens", "start", "end", "text"):
            if getattr(mine, name) != theirs[name]:
                wrong.append(f"{mine.id} {name}: {getattr(mine, name)!r} != {theirs[name]!r}")
        generated = theirs["generated"]
        chosen = torch.log_softmax(theirs["scores"], -1)[range(len(generated)), generated]
        tokens = len(generated) - (generated[-1] == eot)
        if abs(mine.avg_logprob - chosen.sum().item() / (tokens + 1)) > 1e-4:
            wrong.append(f"{mine.id} avg_logprob {mine.avg_logprob}")
        text = tokenizer.decode(generated[:tokens], skip_special_tokens=True).strip()
        data = text.encode()
        if mine.compression_ratio != len(data) / len(zlib.compress(data)):
            wrong.append(f"{mine.id} compression_ratio {mine.compression_ratio}")
        if seeks.setdefault(theirs["window"], mine.seek) != mine.seek:
            wrong.append(f"{mine.id} seek {mine.seek}")
    if sorted(seeks.values()) != list(seeks.values()) or len(set(seeks.values())) != len(seeks):
        wrong.append(f"seeks {list(seeks.values())}")
    return wrong


@pytest.mark.parametrize(
    ("seconds", "options"),
    [(3.0, {"language": "de"}), (65.0, {"prompt": "the quick fox"})],
    ids=["short", "long-prompt"],
)
def test_segments_are_transformers_return_segments(
    folder, engine, reference, seconds, options, monkeypatch
):
    path, hf = folder
    tokenizer = reference[2]
    samples = chirp(seconds, 16000, seed=4).astype(np.float32)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    long = {"truncation": False, "padding": "longest"} if seconds > 30 else {}
    inputs = extractor(samples, sampling_rate=16000, return_tensors="pt", **long)
    features = inputs.input_features
    kwargs = {"language": options.get("language")}
    if "prompt" in options:
        kwargs["prompt_ids"] = tokenizer.get_prompt_ids(options["prompt"], return_tensors="pt")
    expected = reference_segments(hf, path, features, **kwargs)
    clip = audio.Clip(samples, "clip")
    result = engine.transcribe(clip, options.get("language"), None, options.get("prompt"), True)
    assert len({s["window"] for s in expected}) >= 2
    assert [t for s in result.segments for t in s.tokens] == result.ids
    assert segment_differences(result.segments, expected, tokenizer) == []
    assert {s.temperature for s in result.segments} == {0.0}
    # no_speech_prob: <|nospeech|>'s probability after <|startoftranscript|> in the first
    # window, by transformers' forward on its decoder prompt.
    prompt = torch.tensor([expected[0]["prompt"]])
    with torch.no_grad():
        logits = hf(input_features=features[..., :3000], decoder_input_ids=prompt).logits
    start = expected[0]["prompt"].index(tokenizer.convert_tokens_to_ids("<|startoftranscript|>"))
    no_speech = logits[0, start].softmax(-1)[tokenizer.convert_tokens_to_ids("<|nospeech|>")]
    assert abs(result.segments[0].no_speech_prob - no_speech.item()) < 1e-4
    monkeypatch.setattr(whisper, "TIME_PRECISION", 0.04)  # the planted bug
    planted = engine.transcribe(clip, options.get("language"), None, options.get("prompt"), True)
    assert segment_differences(planted.segments, expected, tokenizer) != []


def ts(position: int) -> int:
    """A made-up window's timestamp token: <|0.00|> is 1000."""
    return 1000 + position


@pytest.mark.parametrize(
    ("tokens", "frames"),
    [
        ([ts(0), 5, 6, ts(50), ts(60), 7, ts(80), ts(90), 9, 10], 3000),
        ([ts(0), 5, ts(50), ts(60), 7, 8, ts(120)], 3000),
        ([ts(3), 5, 6, ts(40), ts(40)], 3000),
        ([ts(0), 5, 6, ts(70)], 2345),
        ([ts(0), 5, 6], 2345),
        ([5, 6, 7], 30),  # generate's float32 window end: int(30 * 0.01 / 0.02) is 14
    ],
    ids=["pairs", "lone-end", "pair-end", "no-pair-lone", "no-pair", "no-timestamp"],
)
def test_a_window_splits_as_transformers_retrieve_segment(engine, tokens, frames):
    seek = 1234
    expected, offset = transformers.WhisperForConditionalGeneration._retrieve_segment(
        seek_sequence=torch.tensor(tokens),
        seek_outputs=[{}],
        time_offset=torch.tensor([seek], dtype=torch.float64) * 0.02 / 2,
        timestamp_begin=1000,
        seek_num_frames=torch.tensor([frames]),
        time_precision=0.02,
        time_precision_features=0.01,
        input_stride=2,
        prev_idx=0,
        idx=0,
        return_token_timestamps=False,
        decoder_input_ids=torch.zeros(1, 3, dtype=torch.long),
    )
    pieces, moved = whisper.split_window(tokens, frames, 1000)
    window = whisper.Window(tokens, -1.0, None)
    segments = whisper.window_segments(engine.tokenizer, window, pieces, seek, 1000, 0)
    assert moved == int(offset)
    assert [(s.tokens, s.start, s.end) for s in segments] == [
        (e["tokens"].tolist(), e["start"].item(), e["end"].item()) for e in expected
    ]


def test_run_prints_srt_and_verbose_json_of_the_segments(folder, reference):
    path, hf = folder
    _, features, tokenizer = reference
    expected = reference_segments(hf, path, features, language="en")
    args = ["run", str(path), "--audio", str(path / "clip.wav"), "--language", "en"]
    result = llmrun(*args, "--output-format", "srt")
    assert result.returncode == 0, result.stderr
    cues = [(round(s["start"] * 1000), round(s["end"] * 1000), s["text"].strip()) for s in expected]
    assert subtitle_cues(result.stdout, ",") == [c for c in cues if c[2]]
    verbose = llmrun(*args, "--output-format", "verbose_json")
    assert verbose.returncode == 0, verbose.stderr
    body = json.loads(verbose.stdout)
    assert (body["task"], body["language"], body["duration"]) == ("transcribe", "english", 3.0)
    assert [(s["start"], s["end"], s["text"], s["tokens"]) for s in body["segments"]] == [
        (round(s["start"], 3), round(s["end"], 3), s["text"], s["tokens"]) for s in expected
    ]

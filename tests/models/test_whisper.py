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
`llmrun run --audio` prints the transcript, `show` says what the folder is, and bad
options, a Whisper model without audio and whisper.cpp's ggml files are one error line each.

Tolerances: features, encoder output and logits 1e-4; ids and text exact.
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
    kept = whisper.kept_tokens
    monkeypatch.setattr(whisper, "kept_tokens", lambda *a: windows.append(a) or kept(*a))
    result = engine.transcribe(
        audio.Clip(samples, "long"), options.get("language"), None, options.get("prompt")
    )
    assert len(windows) >= 2
    assert result.ids == expected[0].tolist()
    assert any(t > tokenizer.convert_tokens_to_ids("<|notimestamps|>") for t in result.ids)
    assert result.text == tokenizer.batch_decode(expected, skip_special_tokens=True)[0]


def test_run_prints_the_transcript_and_show_says_what_it_is(folder, reference):
    path, _ = folder
    _, features, tokenizer = reference
    expected = generate(folder, features, language="de")
    result = llmrun("run", str(path), "--audio", str(path / "clip.wav"), "--language", "de")
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.batch_decode(expected, skip_special_tokens=True)[0] + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
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
    ],
    ids=["task", "language", "no-audio"],
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

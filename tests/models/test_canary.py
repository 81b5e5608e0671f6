"""Canary (llmrun.models.canary, llmrun.canary) against transformers 5.25 on a tiny random
CanaryForConditionalGeneration (tests/canary_helpers.py): the features equal
ParakeetFeatureExtractor's, the encoder's output and the decoder's logits (prefilled in two
pieces through the self-attention cache) equal transformers' forward, and the transcript's
ids equal generate's (greedy) after the processor's apply_transcription_request prompt, for
a transcription and an English translation (the language by code and by name), its text
batch_decode(skip_special_tokens=True)'s; a folder whose head is tied to the embedding (left
out of the file) decodes as transformers ties it. Decoder positions that restart at every
call (the planted bug) fail. `llmrun run --audio` prints the transcript and the translation,
`show` says what the folder is; no language, one Canary does not know and a prompt are one
error line each.

Tolerances: features, encoder output and logits 1e-4; ids and text exact.
"""

import json
import shutil

import pytest
import torch
from canary_helpers import tiny_canary_dir, transcript
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, canary
from llmrun.models import canary as canary_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("canary")
    hf, processor = tiny_canary_dir(path, seed=2)
    (path / "clip.wav").write_bytes(wav_bytes(chirp(3.0, 16000, seed=1), 16000))
    return path, hf, processor


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def clip(folder):
    return audio.open_audio(folder[0] / "clip.wav")


def forward(folder, model, samples):
    """transformers' forward on the processor's inputs, and llmrun's features, encoding and
    logits of its decoder prompt (in two pieces through the cache)."""
    path, hf, processor = folder
    inputs = processor.apply_transcription_request(audio=samples, source_language="en")
    features = canary.features(samples, canary.feature_size(path))
    ids = inputs["decoder_input_ids"]
    with torch.no_grad():
        expected = hf(**inputs)
        encoded = model.encode(features, features.shape[0] - 1)
        cache, cross = model.new_cache(), model.cross_cache(encoded)
        logits = torch.cat(
            [model.decode(ids[:, :4], cache, 0, cross), model.decode(ids[:, 4:], cache, 4, cross)],
            dim=1,
        )
    return inputs, expected, features, encoded, logits


def test_features_encoder_and_cached_logits_equal_transformers(folder, engine, clip, monkeypatch):
    inputs, expected, features, encoded, logits = forward(folder, engine.model, clip.samples)
    assert (features - inputs["input_features"][0]).abs().max() < 1e-4
    reference = expected.encoder_last_hidden_state
    assert (encoded - reference[:, : encoded.shape[1]]).abs().max() < 1e-4
    assert (logits - expected.logits).abs().max() < 1e-4
    # The planted bug: each call's positions start at 0, the cache's offset forgotten.
    sinusoids = canary_model.sinusoids
    monkeypatch.setattr(
        canary_model, "sinusoids", lambda start, end, *a: sinusoids(0, end - start, *a)
    )
    wrong = forward(folder, engine.model, clip.samples)[-1]
    assert (wrong - expected.logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("language", "task", "target"),
    [("en", None, None), ("german", "translate", "en"), ("fr", "transcribe", None)],
    ids=["en", "de-to-en", "fr"],
)
def test_transcripts_equal_transformers_generate(folder, engine, clip, language, task, target):
    code = canary.cohere_asr.language_code(language, canary.FAMILY, canary.LANGUAGES)
    ids, text = transcript(*folder[1:], clip.samples, code, target)
    result = engine.transcribe(clip, language, task)
    assert (result.ids, result.text, result.language) == (ids, text, code)
    assert len(ids) > 20 and len(set(ids)) > 2  # a transcript that the decoder's state shapes


def test_a_tied_head_is_the_token_embedding(folder, clip, tmp_path):
    """The Hub's Canary ties proj_out.weight to the embedding (save_pretrained leaves it
    out); a file that keeps one is tied all the same, as transformers ties it."""
    from safetensors.torch import load_file, save_file

    path, _, processor = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    del config["tie_word_embeddings"]  # CanaryConfig's default: tied
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    del weights["proj_out.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.CanaryForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, text = transcript(hf, processor, clip.samples, "fr")
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip, "fr")
    assert (result.ids, result.text) == (ids, text)


def test_run_prints_the_transcript_and_the_translation_and_show_says_what_it_is(folder, clip):
    path = folder[0]
    for task, target in (("transcribe", None), ("translate", "en")):
        _, text = transcript(*folder[1:], clip.samples, "de", target)
        result = llmrun(
            "run", str(path), "--audio", str(path / "clip.wav"), "--language", "de", "--task", task
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == text + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"({sum(p.numel() for p in folder[1].parameters()):,})\n" in shown.stdout  # all
    assert (
        "canary (speech recognition and translation: 2 encoder (FastConformer) and 2 decoder "
        "layers, 16 mel bins)"
    ) in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--audio", "clip.wav"], "Canary does not detect the language: give it"),
        (["--audio", "clip.wav", "--language", "ja"], "language 'ja': Canary transcribes bg, "),
        (["the quick fox", "--audio", "clip.wav", "--language", "en"], "Canary takes no prompt"),
    ],
    ids=["no-language", "language", "prompt"],
)
def test_a_bad_option_is_one_error_line(folder, args, message):
    path = folder[0]
    args = [str(path / a) if a == "clip.wav" else a for a in args]
    result = llmrun("run", str(path), *args)
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message)
    assert result.stderr.count("\n") == 1

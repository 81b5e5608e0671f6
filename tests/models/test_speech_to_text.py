"""Speech2Text (llmrun.models.speech_to_text, llmrun.speech_to_text) against transformers
5.25 on a tiny random Speech2TextForConditionalGeneration (tests/speech_to_text_helpers.py):
the features equal Speech2TextFeatureExtractor's (its numpy fbank, torchaudio absent), the
encoder's output and the decoder's logits (prefilled in two pieces through the
self-attention cache) equal transformers' forward, the transcript's ids equal generate's
(greedy) and its text batch_decode(skip_special_tokens=True)'s (uppercased, as
do_upper_case says), and the tokenizer's ids and texts equal Speech2TextTokenizer's
(sentencepiece.bpe.model and vocab.json); a folder whose head is tied to the embedding (left
out of the file) decodes as transformers ties it, and one without generation_config.json
takes config.json's max_length as transformers does (a repetition_penalty refused). Positions
numbered from 0 instead of after pad_token_id (the planted bug) fail. `llmrun run --audio`
prints the transcript, `show` says what the folder is; a language, a translation, a prompt
and a clip under one frame are one error line each.

Tolerances: features, encoder output and logits 1e-4; ids and text exact.
"""

import json
import random
import shutil

import pytest
import torch
from in_process import llmrun
from speech_to_text_helpers import CORPUS, tiny_speech_to_text_dir, transcript
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, speech_to_text
from llmrun.models import speech_to_text as s2t_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech_to_text")
    hf, processor = tiny_speech_to_text_dir(path, seed=2)
    (path / "clip.wav").write_bytes(wav_bytes(chirp(3.0, 16000, seed=1), 16000))
    return path, hf, processor


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def clip(folder):
    return audio.open_audio(folder[0] / "clip.wav")


def test_features_encoder_and_cached_logits_equal_transformers(folder, engine, clip, monkeypatch):
    _, hf, processor = folder
    inputs = processor(clip.samples, sampling_rate=16000, return_tensors="pt")
    features = speech_to_text.features(clip.samples, 16)
    assert (features - inputs["input_features"][0]).abs().max() < 1e-4
    model, ids = engine.model, torch.tensor([[2, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        expected = hf(**inputs, decoder_input_ids=ids)
        encoded = model.encode(features[None])
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        cache, cross = model.new_cache(), model.cross_cache(encoded)
        logits = torch.cat(
            [model.decode(ids[:, :2], cache, 0, cross), model.decode(ids[:, 2:], cache, 2, cross)],
            dim=1,
        )
        assert (logits - expected.logits).abs().max() < 1e-4
        # The planted bug: positions numbered from row 0, not after pad_token_id.
        positions = s2t_model.positions
        monkeypatch.setattr(
            s2t_model,
            "positions",
            lambda start, end, args, device: positions(start - 2, end - 2, args, device),
        )
        wrong = model.decode(ids, model.new_cache(), 0, cross)
        assert (wrong - expected.logits).abs().max() > 1e-2


def test_the_transcript_equals_transformers_generate(folder, engine, clip):
    ids, text = transcript(*folder[1:], clip.samples)
    result = engine.transcribe(clip)
    assert (result.ids, result.text, result.language) == (ids, text, None)
    assert len(ids) > 10 and len(set(ids)) > 1 and text == text.upper()


def test_the_tokenizer_is_speech2text_tokenizer_s(folder, engine):
    theirs, mine = folder[2].tokenizer, engine.tokenizer
    texts = [*CORPUS[:4], "unseen words: zebra, qx!", "two  spaces </s> and <unk> as text"]
    for text in texts:
        assert mine.encode_sequence(text) == theirs(text).input_ids, text
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(mine.vocab_size) for _ in range(rng.randrange(1, 12))]
        expected = theirs.decode(ids, skip_special_tokens=True)
        assert mine.decode(ids, skip_special=True).strip().upper() == expected, ids


def test_a_tied_head_is_the_token_embedding(folder, clip, tmp_path):
    """Speech2TextConfig ties lm_head to the embedding (save_pretrained leaves it out)."""
    from safetensors.torch import load_file, save_file

    path, _, processor = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.Speech2TextForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, text = transcript(hf, processor, clip.samples)
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip)
    assert (result.ids, result.text) == (ids, text)


def test_without_generation_config_json_config_json_s_settings_apply(folder, clip, tmp_path):
    """As transformers' GenerationConfig.from_model_config: the Hub's older config.json
    carries max_length (and num_beams: tests/test_seq2seq.py); what llmrun does not apply
    is refused."""
    path, _, processor = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_length": 9}))
    hf = transformers.Speech2TextForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, text = transcript(hf, processor, clip.samples)
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip)
    assert (result.ids, result.text, len(ids)) == (ids, text, 8)
    (tmp_path / "config.json").write_text(json.dumps({**config, "repetition_penalty": 1.2}))
    run = llmrun("run", str(tmp_path), "--audio", str(path / "clip.wav"))
    assert run.returncode != 0
    assert run.stderr == (
        "error: Speech2Text's config.json asks for repetition_penalty 1.2, which llmrun's "
        "decoding does not apply\n"
    )


def test_run_prints_the_transcript_and_show_says_what_it_is(folder, clip):
    path = folder[0]
    _, text = transcript(*folder[1:], clip.samples)
    result = llmrun("run", str(path), "--audio", str(path / "clip.wav"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "speech_to_text (speech recognition: 2 encoder and 2 decoder layers, 16 mel bins)" in (
        shown.stdout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--audio", "clip.wav", "--language", "en"], "Speech2Text takes no language"),
        (["--audio", "clip.wav", "--task", "translate"], "Speech2Text transcribes; it does not"),
        (["the quick fox", "--audio", "clip.wav"], "Speech2Text takes no prompt"),
        (["--audio", "short.wav"], "320 samples: shorter than Speech2Text's 25 ms frame"),
    ],
    ids=["language", "translate", "prompt", "short"],
)
def test_a_bad_option_is_one_error_line(folder, args, message):
    path = folder[0]
    (path / "short.wav").write_bytes(wav_bytes(chirp(0.02, 16000), 16000))
    args = [str(path / a) if a.endswith(".wav") else a for a in args]
    result = llmrun("run", str(path), *args)
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message)
    assert result.stderr.count("\n") == 1

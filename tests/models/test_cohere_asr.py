"""Cohere Transcribe (llmrun.models.cohere_asr, llmrun.cohere_asr) against transformers 5.25
on a tiny random CohereAsrForConditionalGeneration (tests/cohere_asr_helpers.py): the
features equal CohereAsrFeatureExtractor's (its seeded dither included), the encoder's
output and the decoder's logits (prefilled in two pieces through the self-attention cache)
equal transformers' forward, and the transcript's ids equal generate's (greedy) after
CohereAsrProcessor's decoder prompt, in two languages (by code and by name), its text
batch_decode(skip_special_tokens=True)'s, with generation_config.json's max_length or
max_new_tokens, with beams, from bf16 weights too; a clip over the extractor's limit is
split and transcribed chunk by chunk as the processor does. A decoder without its causal
mask, or decoding without suppress_tokens (the planted bugs), fails.
`llmrun run --audio` prints the transcript, `show` says what the folder is; no language,
a prompt and translation are one error line each.

Tolerances: features, encoder output and logits 1e-4; ids and text exact.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from cohere_asr_helpers import tiny_cohere_asr_dir, transcript
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, cohere_asr, seq2seq
from llmrun.models import cohere_asr as cohere_asr_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cohere_asr")
    hf, processor = tiny_cohere_asr_dir(path)
    (path / "clip.wav").write_bytes(wav_bytes(chirp(3.0, 16000, seed=1), 16000))
    return path, hf, processor


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def clip(folder):
    return audio.open_audio(folder[0] / "clip.wav")


def generate(folder, samples, language: str) -> tuple[list[int], str]:
    return transcript(*folder[1:], samples, language)


def test_features_encoder_and_cached_logits_equal_transformers(folder, engine, clip, monkeypatch):
    _, hf, processor = folder
    inputs = processor(clip.samples, language="en", sampling_rate=16000)
    mine = cohere_asr.Extractor.of_folder(folder[0]).features(clip.samples)
    assert (mine - inputs["input_features"][0]).abs().max() < 1e-4
    model, ids = engine.model, inputs["decoder_input_ids"]
    with torch.no_grad():
        expected = hf(
            input_features=inputs["input_features"],
            attention_mask=inputs["attention_mask"],
            decoder_input_ids=ids,
        )
        encoded = model.encode(mine, mine.shape[0] - 1)
        reference = expected.encoder_last_hidden_state
        assert (encoded - reference[:, : encoded.shape[1]]).abs().max() < 1e-4
        cache, cross = model.new_cache(), model.cross_cache(encoded)
        logits = torch.cat(
            [model.decode(ids[:, :4], cache, 0, cross), model.decode(ids[:, 4:], cache, 4, cross)],
            dim=1,
        )
        assert (logits - expected.logits).abs().max() < 1e-4
        # The planted bug: the decoder's self-attention sees the tokens after each one.
        attend = cohere_asr_model.Attention.forward
        monkeypatch.setattr(
            cohere_asr_model.Attention,
            "forward",
            lambda self, x, k, v, causal_from: attend(self, x, k, v, None),
        )
        wrong = model.decode(ids, model.new_cache(), 0, cross)
        assert (wrong - expected.logits).abs().max() > 1e-2


@pytest.mark.parametrize("language", ["en", "german"])
def test_transcripts_equal_transformers_generate(folder, engine, clip, language):
    code = cohere_asr.language_code(language)
    ids, text = generate(folder, clip.samples, code)
    result = engine.transcribe(clip, language)
    assert (result.ids, result.text, result.language) == (ids, text, code)


def test_decoding_without_suppress_tokens_is_not_transformers(folder, engine, clip):
    checkpoint = engine.checkpoint
    settings = seq2seq.Settings.of(checkpoint.generation_config, checkpoint.config, "")
    features = cohere_asr.Extractor.of_folder(folder[0]).features(clip.samples)
    prompt = settings.prompt(cohere_asr.prompt_ids(engine.tokenizer, "en"))
    encoded = engine.model.encode(features, features.shape[0] - 1)
    with torch.inference_mode():
        assert (
            seq2seq.generate(engine.model, encoded, prompt, settings)
            == engine.transcribe(clip, "en").ids
        )
        planted = dataclasses.replace(settings, suppress=())
        assert (
            seq2seq.generate(engine.model, encoded, prompt, planted)
            != (generate(folder, clip.samples, "en")[0])
        )


def test_max_new_tokens_and_beams_are_generate_s(folder, clip, tmp_path):
    path, hf, processor = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    generation = json.loads((path / "generation_config.json").read_text())
    del generation["max_length"]
    generation["max_new_tokens"] = 5
    for beams in (1, 4):
        file = {**generation, "num_beams": beams}
        (tmp_path / "generation_config.json").write_text(json.dumps(file))
        hf.generation_config = transformers.GenerationConfig.from_pretrained(tmp_path)
        try:
            ids, text = transcript(hf, processor, clip.samples, "fr")
        finally:
            hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
        engine = api.load(str(tmp_path), device="cpu", transcribe=True)
        result = engine.transcribe(clip, "fr")
        assert (result.ids, result.text) == (ids, text)
        assert len(ids) == 5 or beams > 1  # the beams' best ended sooner
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "min_length": 4}))
    run = llmrun("run", str(tmp_path), "--audio", str(path / "clip.wav"), "--language", "fr")
    assert run.returncode != 0
    assert run.stderr == (
        "error: Cohere Transcribe's generation_config.json asks for min_length 4, which "
        "llmrun's decoding does not apply\n"
    )


def test_a_long_clip_is_split_and_joined_as_the_processor_does(folder, tmp_path):
    """The extractor's limits shrunk (4 s chunks, a 1 s search for the quietest point) so
    that a 9-second clip takes three."""
    path, hf, processor = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    settings = json.loads((path / "processor_config.json").read_text())
    settings["feature_extractor"].update(max_audio_clip_s=4.0, overlap_chunk_second=1.0)
    (tmp_path / "processor_config.json").write_text(json.dumps(settings))
    short = (tmp_path, hf, transformers.CohereAsrProcessor.from_pretrained(tmp_path))
    samples = chirp(9.0, 16000, seed=2).astype("float32")
    ids, text = generate(short, samples, "fr")
    engine = api.load(str(tmp_path), device="cpu", transcribe=True)
    assert len(cohere_asr.Extractor.of_folder(tmp_path).chunks(samples)) == 3
    result = engine.transcribe(audio.Clip(samples, "long"), "fr")
    assert (result.ids, result.text) == (ids, text)


def test_a_bf16_folder_transcribes_as_transformers_in_f32(folder, clip, tmp_path):
    """The Hub's half weights: llmrun keeps them half, transformers runs them in f32."""
    from safetensors.torch import load_file, save_file

    path, _, processor = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(half, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.CohereAsrForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32
    )
    ids, _ = transcript(hf, processor, clip.samples, "en")
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip, "en")
    assert result.ids == ids


def test_run_prints_the_transcript_and_show_says_what_it_is(folder, clip):
    path = folder[0]
    _, text = generate(folder, clip.samples, "de")
    result = llmrun("run", str(path), "--audio", str(path / "clip.wav"), "--language", "de")
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert (
        "cohere_asr (speech recognition: 2 encoder (FastConformer) and 2 decoder layers, "
        "16 mel bins)"
    ) in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--audio", "clip.wav"], "Cohere Transcribe does not detect the language: give it"),
        (
            ["--audio", "clip.wav", "--language", "sv"],
            "language 'sv': Cohere Transcribe transcribes ar, de,",
        ),
        (["--audio", "clip.wav", "--language", "en", "--task", "translate"], "Cohere Transcribe"),
        (
            ["the quick fox", "--audio", "clip.wav", "--language", "en"],
            "Cohere Transcribe takes no prompt",
        ),
        (["hello"], "{path} is a speech recognition model (Cohere Transcribe): transcribe"),
    ],
    ids=["no-language", "language", "translate", "prompt", "no-audio"],
)
def test_a_bad_option_is_one_error_line(folder, args, message):
    path = folder[0]
    args = [str(path / a) if a == "clip.wav" else a for a in args]
    result = llmrun("run", str(path), *args)
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message.format(path=path))
    assert result.stderr.count("\n") == 1

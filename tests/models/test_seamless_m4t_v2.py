"""SeamlessM4T v2 (llmrun.models.seamless_m4t_v2, llmrun.seamless_m4t) against transformers'
SeamlessM4Tv2Model on a tiny random folder (tests/seamless_m4t_helpers.py): the stacked
filterbank features equal SeamlessM4TFeatureExtractor's, the source ids SeamlessM4TProcessor's,
the decoder's logits after a clip or a text transformers' forward's, and `run` decodes as
generate (tgt_lang, greedy and 3 beams) a clip (--audio, --target-language or --language) and
a text (--source-language, --target-language), the ids equal too, ISO 639-1 codes (fr) taken
as the folder's three-letter ones; a missing or unknown language (es, the folder lacking spa)
is one error line; `show` counts transformers' parameters but the speech output's, and says
so. v1 (SeamlessM4TModel, its embedding tied to the head): logits after a clip and `run
--audio` with 3 beams.

The clip has an odd frame count (its last stacked frame half padding, which the attention
mask hides), and v2's speech encoder attends in chunks; the reference applies its boolean masks
(tests/seamless_m4t_helpers.py: masks_applied).

Tolerances: features 1e-4, logits 1e-4; ids and text exact.
"""

import numpy as np
import pytest
import torch
from in_process import llmrun
from seamless_m4t_helpers import masks_applied, seamless_folder
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, seamless_m4t
from llmrun.audio import open_audio
from llmrun.sampling import SamplingParams
from llmrun.text_to_text import Options
from llmrun.ui import count

transformers = pytest.importorskip("transformers")
TEXT = "the quick brown fox jumps over the lazy dog"
SECONDS = 0.51  # 49 frames, stacked as 25 of which 24 are real


@pytest.fixture(scope="module")
def seamless(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seamless")
    hf, processor = seamless_folder(folder)
    samples = chirp(SECONDS, 16000, seed=1)
    wav = folder.parent / "clip.wav"
    wav.write_bytes(wav_bytes(samples, 16000))
    samples = ((samples * 32767).round() / 32768).astype(np.float32)  # as the WAV holds them
    engine = api.load(str(folder), path=folder, transcribe=True, text_to_text=True)
    with masks_applied():
        yield folder, hf, processor, samples, wav, engine


def _generated(hf, processor, inputs, target, beams):
    """transformers' ids after [decoder start, target code], up to the end token, and text."""
    out = hf.generate(**inputs, tgt_lang=target, generate_speech=False, num_beams=beams)
    row = out.sequences[0].tolist()[2:]
    ids = row[: row.index(3)] if 3 in row else row
    return ids, processor.decode(out.sequences[0], skip_special_tokens=True)


def test_features_match_the_feature_extractor(seamless):
    _, _, processor, samples, _, _ = seamless
    for clip in (samples, samples[:-160]):  # an odd and an even frame count
        expected = processor(audio=clip, sampling_rate=16000, return_tensors="pt")
        x, valid = seamless_m4t.features(clip)
        torch.testing.assert_close(x, expected["input_features"][0], atol=1e-4, rtol=0)
        assert valid == int(expected["attention_mask"].sum())


def test_logits_match_transformers_for_a_clip_and_a_text(seamless):
    _, hf, processor, samples, _, engine = seamless
    model = engine.model
    decoder = torch.tensor([[3, 201, 17, 42, 99]])
    positions = torch.arange(decoder.shape[1])[None]
    speech = processor(audio=samples, sampling_rate=16000, return_tensors="pt")
    text = processor(text=TEXT, src_lang="deu", return_tensors="pt")
    plain = engine.tokenizer.encode(TEXT, add_bos=False)
    frame = seamless_m4t.framing(engine.tokenizer)
    ids = frame.ids(plain, frame.code_id("deu", "seamless", "source"))
    assert ids == text["input_ids"][0].tolist()
    with torch.no_grad():
        x, valid = seamless_m4t.features(samples)
        sources = {
            "speech": (model.encode_speech(x[None], valid), speech),
            "text": (model.encode(torch.tensor([ids])), text),
        }
        for name, (encoded, inputs) in sources.items():
            mine = model.decode(decoder, positions, None, model.cross_cache(encoded), False)
            theirs = hf(**inputs, decoder_input_ids=decoder).logits
            assert (mine - theirs).abs().max() < 1e-4, (name, (mine - theirs).abs().max())


@pytest.mark.parametrize("beams", [1, 3])
def test_run_translates_a_clip_as_generate(seamless, beams):
    folder, hf, processor, samples, wav, engine = seamless
    inputs = processor(audio=samples, sampling_rate=16000, return_tensors="pt")
    clip = open_audio(wav)
    # ISO 639-1 codes (fr) name the folder's three-letter ones
    for flags, target in ((["--target-language", "fr"], "fra"), (["--language", "eng"], "eng")):
        ids, text = _generated(hf, processor, inputs, target, beams)
        assert len(set(ids)) > 1  # the random model writes something to compare
        assert engine.transcribe(clip, num_beams=beams, target_language=flags[1]).ids == ids
        result = llmrun("run", str(folder), "--audio", str(wav), "--beams", str(beams), *flags)
        assert result.returncode == 0, result.stderr
        assert result.stdout == text + "\n"


@pytest.mark.parametrize("beams", [1, 3])
def test_run_translates_a_text_as_generate(seamless, beams):
    folder, hf, processor, _, _, engine = seamless
    inputs = processor(text=TEXT, src_lang="deu", return_tensors="pt")
    out = hf.generate(**inputs, tgt_lang="fra", generate_speech=False, num_beams=beams)
    options = Options(beams, "deu", "fra")
    plain = engine.tokenizer.encode(TEXT, add_bos=False)
    replies = engine.generate(plain, SamplingParams(temperature=0.0), options=options)
    ids = [r.token for r in replies if r.token is not None]
    assert [3, 201, *ids] == out.sequences[0].tolist()
    result = llmrun(
        "run", str(folder), "--source-language", "deu", "--target-language", "fra",
        "--beams", str(beams), TEXT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == processor.decode(out.sequences[0], skip_special_tokens=True)


def test_a_language_is_required(seamless):
    folder, _, _, _, wav, _ = seamless
    result = llmrun("run", str(folder), "--audio", str(wav))
    assert result.returncode != 0
    assert result.stderr.startswith("error: SeamlessM4T writes the language it is told")
    result = llmrun("run", str(folder), "--audio", str(wav), "--target-language", "xyz")
    assert "error: unknown target language 'xyz' for SeamlessM4T" in result.stderr
    result = llmrun("run", str(folder), "--audio", str(wav), "--language", "es")  # spa: none
    assert result.stderr.startswith("error: unknown target language 'es' for SeamlessM4T")
    result = llmrun("run", str(folder), TEXT)
    assert "give a target language" in result.stderr
    result = llmrun("run", str(folder), "--audio", str(wav), "--source-language", "eng")
    assert result.stderr.startswith("error: --source-language goes with a text prompt")


@pytest.fixture(scope="module")
def seamless_v1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seamless_v1")
    hf, processor = seamless_folder(folder, version=1)
    return folder, hf, processor


def test_v1_decodes_a_clip_as_transformers(seamless, seamless_v1):
    folder, hf, processor = seamless_v1
    _, _, _, samples, wav, _ = seamless
    model = api.load(str(folder), path=folder, transcribe=True, text_to_text=True).model
    decoder = torch.tensor([[3, 201, 17, 42, 99]])
    positions = torch.arange(decoder.shape[1])[None]
    speech = processor(audio=samples, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        x, valid = seamless_m4t.features(samples)
        encoded = model.encode_speech(x[None], valid)
        mine = model.decode(decoder, positions, None, model.cross_cache(encoded), False)
        torch.testing.assert_close(mine, hf(**speech, decoder_input_ids=decoder).logits,
                                   atol=1e-4, rtol=0)  # fmt: skip
    ids, text = _generated(hf, processor, speech, "deu", 3)
    result = llmrun("run", str(folder), "--audio", str(wav), "--beams", "3", "--target-language",
                    "deu")  # fmt: skip
    assert (result.returncode, result.stdout) == (0, text + "\n")


def test_show_counts_what_llmrun_runs_and_names_the_speech_output_it_does_not(seamless):
    folder, hf, *_ = seamless
    speech_output = ("t2u_model.", "vocoder.")
    run = sum(p.numel() for n, p in hf.named_parameters() if not n.startswith(speech_output))
    left = sum(p.numel() for n, p in hf.named_parameters() if n.startswith(speech_output))
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    note = f"{count(left)} more in its speech output (t2u_model, vocoder), not run"
    assert f"({run:,}); {note}\n" in shown.stdout

"""Gemma 4 with audio against transformers: a tiny random Gemma4ForConditionalGeneration
with its vision and audio towers (gemma4_audio_helpers: a 2-layer conformer of width 32)
and Gemma4Processor (Gemma4AudioFeatureExtractor, Gemma 4's chat template, <|audio> and
<audio|> around a clip's soft tokens, one per 40 ms) make the reference, for a prompt with
a 2-second clip at 16 kHz and a 1.3-second one at 22.05 kHz. The log-mel features, the
input ids, the audio embeddings, the logits (the audio tokens attend causally, though the
model's images attend both ways) and 8 greedy tokens match; so does the same model as a
text GGUF and an mmproj GGUF holding both encoders as llama.cpp's converter writes them
(the images still load from it), and serve's reply to an `input_audio` part equals
run's. Planted bugs (relative positions one off, the light convolution padded on the
wrong side) move the embeddings far past the tolerance.

Tolerances: features 1e-5 (measured ~1e-6); ids and tokens exact; embeddings and logits
1e-4 (measured ~1e-6).
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audio_checks import (
    check_chat_with_audio,
    check_run_with_audio,
    check_served_audio_reply,
    placed,
    two_rate_wavs,
)
from gemma4_audio_helpers import (
    AUDIO,
    AUDIO_BEGIN,
    AUDIO_END,
    processor_inputs,
    tiny_gemma4_audio,
    write_audio_mmproj,
)
from gemma4_vision_helpers import greedy_tokens, save_gemma4_vl_dir, write_text_gguf
from helpers import needs_templates
from in_process import llmrun
from vision_checks import check_prompt_logits, greedy_ids, logits
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, gemma4_audio_clips, gemma4_images
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading import gemma4_vision
from llmrun.loading.gemma4_audio import feature_settings
from llmrun.models import gemma4_audio
from llmrun.models.gemma3 import ImageTokens

transformers = pytest.importorskip("transformers")
pytestmark = needs_templates
QUESTION = "What do you hear?"
# 2 s at 16 kHz: 32000 samples (a multiple of 128), 199 frames of audio, 50 tokens;
# 1.3 s at 22.05 kHz: 20800 samples, 129 frames, 33 tokens.
TOKENS = [50, 33]


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4_audio()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma4_vl_dir(model, tmp_path_factory.mktemp("gemma4-audio"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return two_rate_wavs(tmp_path_factory.mktemp("wavs"))


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def reference(folder, clips):
    return processor_inputs(folder, [clip.samples for clip in clips], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)


def extractor(**settings):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor(**settings)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="defaults"),
        pytest.param(
            dict(
                preemphasis=0.97,
                input_scale_factor=0.5,
                mel_floor=1e-5,
                per_bin_mean=[0.1] * 128,
                per_bin_stddev=[2.0] * 128,
            ),
            id="htk-preemphasis-per-bin",
        ),
        pytest.param(dict(preemphasis=0.9, preemphasis_htk_flavor=False), id="plain-preemphasis"),
    ],
)
def test_features_match_the_feature_extractor(clips, settings):
    ours = gemma4_audio_clips.FeatureSettings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    )
    for clip in [*clips, audio.Clip(clips[0].samples[:5000], "odd")]:
        expected = extractor(**settings)([clip.samples], return_tensors="np")
        features, valid = gemma4_audio_clips.features(clip, ours)
        np.testing.assert_allclose(features, expected["input_features"][0], atol=1e-5, rtol=0)
        assert valid == expected["input_features_mask"][0].sum()


@pytest.mark.parametrize("layout", ["preprocessor_config.json", "processor_config.json"])
def test_a_folders_feature_extractor_settings_read_as_transformers_does(clips, tmp_path, layout):
    """Settings saved by transformers (transformers 5 nests them under "feature_extractor"
    in processor_config.json) give the features its from_pretrained extractor gives."""
    from transformers.models.gemma4.feature_extraction_gemma4 import (
        Gemma4AudioFeatureExtractor,
    )

    saved = extractor(preemphasis=0.97, per_bin_mean=[0.1] * 128, per_bin_stddev=[2.0] * 128,
                      mel_floor=1e-5, frame_length_ms=25.0)  # fmt: skip
    saved.save_pretrained(tmp_path)
    reloaded = Gemma4AudioFeatureExtractor.from_pretrained(tmp_path)
    if layout == "processor_config.json":
        values = json.loads((tmp_path / "preprocessor_config.json").read_text())
        (tmp_path / "preprocessor_config.json").unlink()
        (tmp_path / layout).write_text(json.dumps({"feature_extractor": values}))
    settings = feature_settings(tmp_path)
    expected = reloaded([clips[0].samples], return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(
        gemma4_audio_clips.features(clips[0], settings)[0], expected, atol=1e-5, rtol=0
    )


def test_the_prompt_is_laid_out_as_gemma4_processor_does(engine, clips, prompt, reference):
    ids, prompt_audio = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [engine.audio_tokens(clip) for clip in clips] == TOKENS
    assert [len(e) for e in prompt_audio.embeds] == TOKENS
    for start, count in zip(prompt_audio.starts, TOKENS, strict=True):
        assert ids[start - 1] == AUDIO_BEGIN and ids[start + count] == AUDIO_END
        assert ids[start : start + count] == [AUDIO] * count
    # Loading the tower drops the note that it is not run.
    assert not [n for n in engine.checkpoint.notes if "audio tower" in n]


def test_audio_embeddings_match_transformers(model, prompt, reference):
    expected = placed(model, reference, AUDIO)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(torch.cat(prompt[1].embeds), expected, atol=1e-4, rtol=0)


def test_logits_with_audio_match_transformers(model, engine, prompt, reference):
    check_prompt_logits(model, engine, prompt, reference, chunk=40, context=256)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert greedy_ids(engine, *prompt) == expected


original_positions = gemma4_audio.Attention.relative_positions
original_pad = F.pad


def _shifted_positions(self, distances, dtype):
    return original_positions(self, distances + 1, dtype)[1:]


def _padded_right(x, pad, *args, **kwargs):
    """F.pad with the light convolution's left padding put on the right."""
    if len(pad) == 2 and pad[0] > 0 and pad[1] == 0:
        pad = (0, pad[0])
    return original_pad(x, pad, *args, **kwargs)


@pytest.mark.parametrize(
    "owner, name, planted",
    [
        pytest.param(
            gemma4_audio.Attention,
            "relative_positions",
            _shifted_positions,
            id="relative-positions-one-off",
        ),  # fmt: skip
        pytest.param(F, "pad", _padded_right, id="conv-padded-right"),
    ],
)
def test_a_planted_bug_fails(model, engine, clips, reference, monkeypatch, owner, name, planted):
    expected = placed(model, reference, AUDIO)
    monkeypatch.setattr(owner, name, planted)
    bugged = torch.cat(engine.encode_audio(clips))
    assert bugged.shape == expected.shape
    assert (bugged - expected).abs().max() > 1e-2


def test_audio_tokens_attending_both_ways_fail(model, engine, prompt, reference, monkeypatch):
    """The model's images attend both ways on sliding layers; its audio must not."""
    monkeypatch.setattr(gemma4_audio_clips.CausalTokens, "unmask", ImageTokens.unmask)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    assert (logits(engine, *prompt) - expected).abs().max() > 0.1


def test_gguf_with_mmproj_matches_transformers(model, folder, clips, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_audio_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    ids, prompt_audio = engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)
    assert ids == reference["input_ids"][0].tolist()
    torch.testing.assert_close(
        torch.cat(prompt_audio.embeds), placed(model, reference, AUDIO), atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_audio), expected, atol=1e-4, rtol=0)
    assert greedy_ids(engine, ids, prompt_audio) == greedy_tokens(model, reference)
    # The same file's image encoder: as the folder's.
    from_file = gemma4_vision.from_mmproj(mmproj, 64)
    from_folder = gemma4_vision.from_hf_dir(folder, 64)
    with torch.no_grad():
        patches = gemma4_images.patches(from_folder, open_image(picture(48, 80, 1)))
        torch.testing.assert_close(
            from_file.encoder(*patches), from_folder.encoder(*patches), atol=1e-5, rtol=0
        )


def test_run_with_audio_replies_as_transformers(model, folder, wavs, reference):
    """`llmrun run FOLDER --audio A --audio B "prompt"`: transformers' greedy reply."""
    check_run_with_audio(folder, wavs, QUESTION, greedy_tokens(model, reference))


def test_chat_with_audio_replies_as_transformers(model, folder, wavs, engine):
    """`chat --audio A` and `/audio A` then the question: transformers' greedy reply."""
    reference = processor_inputs(folder, [audio.open_audio(wavs[0]).samples], QUESTION)
    expected = engine.tokenizer.decode(greedy_tokens(model, reference))
    check_chat_with_audio(folder, wavs[0], QUESTION, expected)


def test_a_clip_over_30_seconds_is_one_error_line(folder, engine, tmp_path):
    """The feature extractor cuts a clip at 30 seconds; llmrun refuses it rather than drop
    audio, and one too short for a token."""
    long = tmp_path / "long.wav"
    long.write_bytes(wav_bytes(chirp(30.5, 8000, seed=3), 8000))
    result = llmrun("run", str(folder), "--audio", str(long), QUESTION)
    assert result.returncode == 2
    # After the note that the vision tower loads at the first image.
    [line] = [x for x in result.stderr.strip().splitlines() if not x.startswith("note: ")]
    assert line == (
        f"error: {long}: 30.5 seconds of audio; Gemma 4 takes 30 seconds a clip at most "
        "(cut it into clips)"
    )
    with pytest.raises(UsageError, match="too short for Gemma 4"):
        engine.audio_tokens(audio.Clip(np.zeros(160, np.float32), "tiny"))


def test_audio_places_must_match_the_clips(engine, clips):
    with pytest.raises(UsageError, match=r"marks 1 audio place \(<\|audio\|>\) for 2 clips"):
        engine.audio_prompt("<|turn>user\n<|audio|>two?<turn|>\n", clips)


def test_serve_replies_to_an_input_audio_part_as_run_does(engine, wavs):
    check_served_audio_reply(engine, "gemma4-audio", wavs[0].read_bytes(), QUESTION)

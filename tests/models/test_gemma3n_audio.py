"""Gemma 3n with audio against transformers: a tiny random Gemma3nForConditionalGeneration
with its audio tower (gemma3n_audio_helpers: a 2-layer conformer of width 32; no vision
tower, which needs timm) and Gemma3nProcessor (Gemma3nAudioFeatureExtractor, a Gemma 3n
chat template, a blank line, <start_of_audio>, a fixed 24 <audio_soft_token>,
<end_of_audio> and a blank line for each clip) make the reference, for a 2-second clip at
16 kHz and a 1.3-second one at 22.05 kHz. The log-mel features, the input ids, the rows the
language model takes for a clip (its soft tokens, the padding after them and
<end_of_audio>, embedded by the audio embedder), the logits and 8 greedy tokens match, and
serve's reply to an `input_audio` part equals run's. Planted bugs (relative positions one
off, the subsampling's frames padded on the wrong side) move the embeddings far past the
tolerance.

transformers pads a batch's clips to the longest, which moves a shorter clip's last token;
llmrun encodes each clip alone, so each clip is compared with transformers given it alone.

Tolerances: features 1e-5 (measured 0); ids and tokens exact; embeddings and logits 1e-4
(measured ~1e-6).
"""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audio_checks import (
    check_chat_with_audio,
    check_run_with_audio,
    check_served_audio_reply,
    two_rate_wavs,
)
from gemma3n_audio_helpers import (
    AUDIO,
    BOA,
    EOA,
    TOKENS_PER_CLIP,
    greedy_tokens,
    processor_inputs,
    save_gemma3n_audio_dir,
    tiny_gemma3n_audio,
)
from in_process import llmrun
from vision_checks import check_prompt_logits, greedy_ids
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, audio_families, gemma3n_audio_clips
from llmrun.errors import UnsupportedError, UsageError
from llmrun.loading import gemma3n_audio
from llmrun.models import gemma3n_audio as model_audio

transformers = pytest.importorskip("transformers")
QUESTION = "What do you hear?"
SPAN = TOKENS_PER_CLIP + 1  # a clip's rows: its soft tokens, their padding, <end_of_audio>


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3n_audio()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma3n_audio_dir(model, tmp_path_factory.mktemp("gemma3n-audio"))


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
    """transformers' inputs for the first clip alone."""
    return processor_inputs(folder, [clips[0].samples], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), clips[:1])


def language_model_rows(model, inputs) -> torch.Tensor:
    """The rows the language model takes from each clip's first <audio_soft_token>
    through its <end_of_audio>, as transformers makes them: [clips * SPAN, hidden]."""
    taken = {}

    def keep(module, args, kwargs):
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    ids = inputs["input_ids"][0].tolist()
    starts = [i + 1 for i, t in enumerate(ids) if t == BOA]
    return torch.cat([taken["embeds"][s : s + SPAN] for s in starts])


def extractor(**settings):
    from transformers.models.gemma3n.feature_extraction_gemma3n import (
        Gemma3nAudioFeatureExtractor,
    )

    return Gemma3nAudioFeatureExtractor(**settings)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="defaults"),
        pytest.param(
            dict(
                preemphasis=0.0,
                fft_overdrive=False,
                input_scale_factor=0.5,
                mel_floor=1e-3,
                per_bin_mean=[0.1] * 128,
                per_bin_stddev=[2.0] * 128,
            ),
            id="plain-per-bin",
        ),
        pytest.param(dict(preemphasis=0.9, preemphasis_htk_flavor=False), id="plain-preemphasis"),
    ],
)
def test_features_match_the_feature_extractor(clips, settings):
    ours = gemma3n_audio_clips.FeatureSettings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    )
    for clip in [*clips, audio.Clip(clips[0].samples[:5000], "odd")]:
        expected = extractor(**settings)([clip.samples], return_tensors="np")
        features, valid = gemma3n_audio_clips.features(clip, ours)
        np.testing.assert_allclose(features, expected["input_features"][0], atol=1e-5, rtol=0)
        assert valid == expected["input_features_mask"][0].sum()


def test_a_folders_feature_extractor_settings_read_as_transformers_does(clips, tmp_path):
    from transformers.models.gemma3n.feature_extraction_gemma3n import (
        Gemma3nAudioFeatureExtractor,
    )

    saved = extractor(preemphasis=0.9, per_bin_mean=[0.1] * 128, per_bin_stddev=[2.0] * 128,
                      mel_floor=1e-4, frame_length_ms=25.0, max_frequency=7000.0)  # fmt: skip
    saved.save_pretrained(tmp_path)
    reloaded = Gemma3nAudioFeatureExtractor.from_pretrained(tmp_path)
    settings = gemma3n_audio.feature_settings(
        tmp_path, gemma3n_audio_clips.FeatureSettings, gemma3n_audio.EXTRACTOR
    )
    expected = reloaded([clips[0].samples], return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(
        gemma3n_audio_clips.features(clips[0], settings)[0], expected, atol=1e-5, rtol=0
    )


def test_the_prompt_is_laid_out_as_gemma3n_processor_does(folder, engine, clips):
    reference = processor_inputs(folder, [clip.samples for clip in clips], QUESTION)
    ids, prompt_audio = engine.audio_prompt(engine.prompt_text(QUESTION, audio=2), clips)
    assert ids == reference["input_ids"][0].tolist()
    assert [engine.audio_tokens(clip) for clip in clips] == [TOKENS_PER_CLIP] * 2
    assert [len(e) for e in prompt_audio.embeds] == [SPAN] * 2
    for start in prompt_audio.starts:
        assert ids[start - 1] == BOA and ids[start + TOKENS_PER_CLIP] == EOA
        assert ids[start : start + TOKENS_PER_CLIP] == [AUDIO] * TOKENS_PER_CLIP
    # Loading the tower drops the note that it is not run.
    assert not [n for n in engine.checkpoint.notes if "audio tower" in n]


def test_audio_embeddings_match_transformers(model, folder, engine, clips):
    """Each clip's soft tokens (2 s: 13 of them; 1.3 s: 9), the padding up to 24 and
    <end_of_audio>, as transformers gives the language model each clip alone."""
    for clip, embeds in zip(clips, engine.encode_audio(clips), strict=True):
        expected = language_model_rows(model, processor_inputs(folder, [clip.samples], QUESTION))
        assert expected[:9].abs().max() > 0.5
        torch.testing.assert_close(embeds, expected, atol=1e-4, rtol=0)


def test_logits_with_audio_match_transformers(model, engine, prompt, reference):
    expected = check_prompt_logits(model, engine, prompt, reference, chunk=20, context=128)
    assert expected.abs().max() > 1.0


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert greedy_ids(engine, *prompt) == expected


original_keys = model_audio.LocalAttention.relative_keys
original_pad = F.pad


def _shifted_keys(self, distances, dtype):
    return original_keys(self, distances + 1, dtype)[1:]


def _frames_padded_before(x, pad, *args, **kwargs):
    """F.pad with the subsampling's frame padding (after) put before."""
    if len(pad) == 4 and pad[2] == 0 and pad[3] > 0:
        pad = (pad[0], pad[1], pad[3], 0)
    return original_pad(x, pad, *args, **kwargs)


@pytest.mark.parametrize(
    "owner, name, planted",
    [
        pytest.param(
            model_audio.LocalAttention,
            "relative_keys",
            _shifted_keys,
            id="relative-positions-one-off",
        ),  # fmt: skip
        pytest.param(F, "pad", _frames_padded_before, id="frames-padded-before"),
    ],
)
def test_a_planted_bug_fails(model, engine, clips, reference, monkeypatch, owner, name, planted):
    expected = language_model_rows(model, reference)
    monkeypatch.setattr(owner, name, planted)
    bugged = engine.encode_audio(clips[:1])[0]
    assert bugged.shape == expected.shape
    assert (bugged - expected).abs().max() > 1e-2


def test_run_with_audio_replies_as_transformers(model, folder, wavs, reference):
    """`llmrun run FOLDER --audio A "prompt"`: transformers' greedy reply."""
    check_run_with_audio(folder, wavs[:1], QUESTION, greedy_tokens(model, reference))


def test_chat_with_audio_replies_as_transformers(model, folder, wavs, engine, reference):
    """`chat --audio A` and `/audio A` then the question: transformers' greedy reply."""
    expected = engine.tokenizer.decode(greedy_tokens(model, reference))
    check_chat_with_audio(folder, wavs[0], QUESTION, expected)


def test_a_clip_past_its_tokens_is_one_error_line(folder, engine, tmp_path):
    """24 tokens take 3.84 seconds here (188 take 30 in Gemma 3n); a longer clip is
    refused rather than cut, and one too short for a frame."""
    long = tmp_path / "long.wav"
    long.write_bytes(wav_bytes(chirp(3.9, 8000, seed=3), 8000))
    result = llmrun("run", str(folder), "--audio", str(long), QUESTION)
    assert result.returncode == 2
    [line] = [x for x in result.stderr.strip().splitlines() if not x.startswith("note: ")]
    assert line == (
        f"error: {long}: 25 audio tokens, more than the 24 Gemma 3n takes a clip "
        "(cut it into clips)"
    )
    with pytest.raises(UsageError, match="30.5 seconds of audio; Gemma 3n takes 30 seconds"):
        engine.audio_tokens(audio.Clip(np.zeros(488000, np.float32), "long"))
    with pytest.raises(UsageError, match="too short for Gemma 3n"):
        engine.audio_tokens(audio.Clip(np.zeros(500, np.float32), "tiny"))


def test_audio_places_must_match_the_clips(engine, clips):
    with pytest.raises(UsageError, match=r"marks 1 audio place \(<audio_soft_token>\) for 2"):
        engine.audio_prompt("<start_of_turn>user\n<audio_soft_token>two?<end_of_turn>\n", clips)


def test_images_and_llama_cpp_audio_projectors_are_refused(folder, tmp_path):
    """Gemma 3n's vision tower (MobileNetV5) is not run; llama.cpp's gemma3na projector is
    named as Gemma 3n's and refused (llama.cpp does not run it either)."""
    image = tmp_path / "image.png"
    image.write_bytes(picture(32, 32, 1))
    result = llmrun("run", str(folder), "--image", str(image), QUESTION)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {folder}: Gemma 3n's vision tower (MobileNetV5) is not supported; it takes "
        "text and audio (--audio)"
    )
    mmproj = tmp_path / "mmproj.gguf"
    writer = gguf.GGUFWriter(mmproj, "clip")
    writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
    writer.add_string(gguf.Keys.ClipAudio.PROJECTOR_TYPE, gguf.VisionProjectorType.GEMMA3NA)
    writer.add_tensor("a.conv1d.0.weight", np.zeros((8, 1, 3, 3), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    family = audio_families.of_mmproj(mmproj)
    assert family is not None and family.name == "Gemma 3n"
    with pytest.raises(UnsupportedError, match="Gemma 3n's audio encoder from an mmproj GGUF"):
        family.from_mmproj(mmproj, 64)


def test_serve_replies_to_an_input_audio_part_as_run_does(engine, wavs):
    check_served_audio_reply(engine, "gemma3n-audio", wavs[0].read_bytes(), QUESTION)

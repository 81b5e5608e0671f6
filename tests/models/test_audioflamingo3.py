"""Audio Flamingo 3 with audio against transformers: a tiny random
AudioFlamingo3ForConditionalGeneration (a Qwen2 under Whisper's tower with an average pool
and a two-layer projector) and AudioFlamingo3Processor (WhisperFeatureExtractor's 30-second
windows, its token counts, the chat template NVIDIA's conversion writes) make the
reference, for a 31.3-second clip (two windows, the second short) and a 0.7-second one.
The log-mel features, the input ids, the audio embeddings (as the language model takes
them), the logits and 8 greedy tokens match; so do the text GGUF and mmproj GGUF that
llama.cpp's converter writes. A transcription prompt's ids are
apply_transcription_request's, and an answer reads as decode(strip_prefix=True) reads it.
`run --audio` and `chat` with `/audio` reply as transformers. A window whose padding is
attended to, or a pool that keeps each pair's second frame, fails. Music Flamingo (its
rotary time embeddings, <|sound_bos|> and <|sound_eos|> around a clip's tokens) matches
MusicFlamingoForConditionalGeneration and MusicFlamingoProcessor on the long clip; its
second window turned as the first fails.

Tolerances: ids and tokens exact; features within 1e-5 of the extractor's numpy (float64)
implementation, 5e-5 of its torch STFT (float32) that the processor runs; embeddings and
logits within 1e-4.
"""

import numpy as np
import pytest
import torch
from audio_checks import check_clip_prompt, check_run_and_chat_with_a_clip, chirp_wavs, placed
from audioflamingo3_helpers import (
    SOUND,
    SOUND_BOS,
    SOUND_EOS,
    processor,
    save_audioflamingo3_dir,
    tiny_audioflamingo3,
)
from helpers import CONVERTER, needs_converter
from in_process import llmrun
from qwen3_asr_helpers import converted

from llmrun import api, audio, audioflamingo3_clips
from llmrun.errors import UsageError
from llmrun.models import whisper_encoder
from llmrun.models.audioflamingo3_audio import MusicFlamingoEncoder

transformers = pytest.importorskip("transformers")
QUESTION = "What is said?"


@pytest.fixture(scope="module")
def model():
    return tiny_audioflamingo3(seed=1)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_audioflamingo3_dir(model, tmp_path_factory.mktemp("audioflamingo3"))


@pytest.fixture(scope="module")
def made(folder):
    return processor(folder)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return chirp_wavs(tmp_path_factory.mktemp("wavs"), 31.3)


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def references(made, clips):
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}
    ]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [made(text=text, audio=[clip.samples], sampling_rate=16000) for clip in clips]


def greedy_tokens(model, reference) -> list[int]:
    with torch.no_grad():
        out = model.generate(**reference, max_new_tokens=8, do_sample=False)
    return out[0, reference["input_ids"].shape[1] :].tolist()


def check_matches(model, engine, clip, reference, same_ids: bool = True) -> list[int]:
    args = (model, engine, clip, reference, QUESTION, SOUND, 1024, 64)
    return check_clip_prompt(*args, same_ids=same_ids)


def test_features_and_token_counts_are_the_processor_s(engine, made, clips, references):
    """The processor's call runs the extractor's torch STFT (float32): within 5e-5; its
    numpy implementation (float64): within 1e-5."""
    extractor = made.feature_extractor
    window = audioflamingo3_clips.WINDOW
    for clip, reference in zip(clips, references, strict=True):
        for i, expected in enumerate(reference["input_features"].numpy()):
            padded = np.pad(clip.samples[i * window : (i + 1) * window], (0, window))[:window]
            ours = audio.log_mel(padded, 128)
            np.testing.assert_allclose(ours, expected, atol=5e-5, rtol=0)
            exact = extractor._np_extract_fbank_features(padded[None], "cpu")[0]
            np.testing.assert_allclose(ours, exact, atol=1e-5, rtol=0)
        assert engine.audio_tokens(clip) == int((reference["input_ids"] == SOUND).sum())
    assert [len(r["input_features"]) for r in references] == [2, 1]
    assert [engine.audio_tokens(clip) for clip in clips] == [782, 17]


def test_audio_prompts_match_transformers(model, engine, clips, references):
    for clip, reference in zip(clips, references, strict=True):
        check_matches(model, engine, clip, reference)


def test_padding_attended_to_or_frames_not_averaged_fails(
    model, engine, clips, references, monkeypatch
):
    short = clips[1]
    expected = placed(model, references[1], SOUND)
    tower = engine.audio.encoder.audio_tower
    features = audioflamingo3_clips._features(short.samples, 128)
    with torch.no_grad():
        whole = tower(features)[0, : len(expected)]
        padded = engine.audio.encoder.multi_modal_projector(whole)
    assert (padded - expected).abs().max() > 1e-2
    # Each pair's second frame kept instead of the pair averaged.
    monkeypatch.setattr(whisper_encoder.F, "avg_pool1d", lambda x, size: x[..., 1::size])
    unpooled = engine.encode_audio([short])[0]
    assert unpooled.shape == expected.shape
    assert (unpooled - expected).abs().max() > 1e-2


def test_a_transcription_prompt_is_apply_transcription_request_s(engine, made, clips):
    short = clips[1]

    def render(messages, add_generation_prompt=False):
        return engine.render(messages, add_generation_prompt=add_generation_prompt)

    text = audioflamingo3_clips.transcription(engine.tokenizer, render, None)
    ids, _ = engine.audio_prompt(text, [short])
    expected = made.apply_transcription_request(short.samples)
    assert ids == expected["input_ids"][0].tolist()
    with pytest.raises(UsageError, match="language 'en': Audio Flamingo 3's transcription"):
        audioflamingo3_clips.transcription(engine.tokenizer, render, "en")
    for answer in ('The spoken content of the audio is "Hello there."', "plain words", ""):
        stripped = made._strip_assistant_prefix_and_quotes(answer)
        assert audioflamingo3_clips.transcript(answer) == stripped


def test_the_converter_s_ggufs_match_transformers(model, folder, wavs, clips, references, tmp_path):
    """Also `chat GGUF --mmproj MMPROJ` with `/audio A`: the audio encoder loads at the
    first clip."""
    if not CONVERTER.is_file():
        pytest.skip(needs_converter.kwargs["reason"])
    text, mmproj = converted(folder, tmp_path)
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    # The converter's SentencePiece vocabulary puts a space before the text as the tiny
    # tokenizer.json does not.
    expected = check_matches(model, engine, clips[1], references[1], same_ids=False)
    options = ("--mmproj", mmproj, "-n", "8", "--temperature", "0")
    chat = llmrun("chat", text, *options, input=f"/audio {wavs[1]}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"


def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, references):
    """`llmrun run FOLDER --audio A "prompt"` and `chat` with `/audio A` then the question:
    transformers' greedy reply."""
    expected = greedy_tokens(model, references[1])
    check_run_and_chat_with_a_clip(engine, folder, wavs[1], QUESTION, expected)


def test_music_flamingo_matches_transformers(clips, tmp_path, monkeypatch):
    music = tiny_audioflamingo3(seed=2, music=True)
    folder = save_audioflamingo3_dir(music, tmp_path / "music")
    engine = api.load(str(folder), device="cpu", audio=True)
    long = clips[0]
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}
    ]
    made = processor(folder, music=True)
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reference = made(text=text, audio=[long.samples], sampling_rate=16000)
    check_matches(music, engine, long, reference)
    ids = reference["input_ids"][0].tolist()
    start, end = ids.index(SOUND_BOS), ids.index(SOUND_EOS)
    assert end - start - 1 == engine.audio_tokens(long) - 2 == 782
    turned = MusicFlamingoEncoder._turned
    monkeypatch.setattr(MusicFlamingoEncoder, "_turned", lambda self, x, window: turned(self, x, 0))
    planted = engine.encode_audio([long])[0]
    expected = placed(music, reference, SOUND)
    assert (planted[:750] - expected[:750]).abs().max() < 1e-4
    assert (planted[750:] - expected[750:]).abs().max() > 1e-2

"""GLM-ASR with audio against transformers: a tiny random GlmAsrForConditionalGeneration (a
Llama under a Whisper-style tower whose attention turns half of each head by RoPE, 4
frames a token) and GlmAsrProcessor (WhisperFeatureExtractor's 30-second windows, its
token counts, the Hub's chat template) make the reference, for a 31.3-second clip (two
windows, the second short) and a 0.7-second one. The log-mel features, the input ids,
the audio embeddings (as the language model takes them), the logits and 8 greedy tokens
match; so do the text GGUF and mmproj GGUF that llama.cpp's converter writes of zai-org's
original layout (q/k rows interleaved, learned positions, boi/eoi embeddings). A
transcription prompt's ids are apply_transcription_request's, and an answer reads as
decode(strip_prefix=True) reads it. `run --audio` and `chat` with `/audio` reply as
transformers. The tower without RoPE (llama.cpp's graph adds the learned positions
instead), a window encoded without its padding, or the mmproj's q/k rows left in their
order, fails.

Tolerances: ids and tokens exact; features within 1e-5 of the extractor's numpy (float64)
implementation, 5e-5 of its torch STFT (float32) that the processor runs; embeddings and
logits within 1e-4.
"""

import copy

import numpy as np
import pytest
import torch
from audio_checks import (
    audio_user_turn,
    check_clip_prompt,
    check_run_and_chat_with_a_clip,
    chirp_wavs,
    placed,
)
from glmasr_helpers import (
    AUDIO,
    BEGIN_AUDIO,
    END_AUDIO,
    converted,
    greedy_tokens,
    original_layout,
    processor,
    processor_inputs,
    save_glmasr_dir,
    tiny_glmasr,
)
from helpers import CONVERTER, needs_converter
from in_process import llmrun

from llmrun import api, audio, glmasr_clips
from llmrun.errors import UsageError
from llmrun.loading import glmasr
from llmrun.models import glmasr_encoder

transformers = pytest.importorskip("transformers")
QUESTION = "What is said?"


@pytest.fixture(scope="module")
def model():
    return tiny_glmasr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glmasr_dir(model, tmp_path_factory.mktemp("glmasr"))


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
    return [processor_inputs(made, audio_user_turn(QUESTION), [clip.samples]) for clip in clips]


def check_matches(model, engine, clip, reference, same_ids: bool = True) -> list[int]:
    args = (model, engine, clip, reference, QUESTION, AUDIO, 512, 64, (BEGIN_AUDIO, END_AUDIO))
    return check_clip_prompt(*args, same_ids=same_ids)


def test_features_and_token_counts_are_the_processor_s(engine, made, clips, references):
    """The processor's call runs the extractor's torch STFT (float32): within 5e-5; its
    numpy implementation (float64): within 1e-5."""
    extractor = made.feature_extractor
    for clip, reference in zip(clips, references, strict=True):
        windows = reference["input_features"].numpy()
        for i, expected in enumerate(windows):
            window = clip.samples[i * glmasr_clips.WINDOW : (i + 1) * glmasr_clips.WINDOW]
            padded = np.pad(window, (0, glmasr_clips.WINDOW - len(window)))
            ours = audio.log_mel(padded, 128)
            np.testing.assert_allclose(ours, expected, atol=5e-5, rtol=0)
            exact = extractor._np_extract_fbank_features(padded[None], "cpu")[0]
            np.testing.assert_allclose(ours, exact, atol=1e-5, rtol=0)
        assert engine.audio_tokens(clip) == int((reference["input_ids"] == AUDIO).sum())
    assert [len(r["input_features"]) for r in references] == [2, 1]
    assert [engine.audio_tokens(clip) for clip in clips] == [391, 8]


def test_audio_prompts_match_transformers(model, engine, clips, references):
    for clip, reference in zip(clips, references, strict=True):
        check_matches(model, engine, clip, reference)


def test_the_tower_without_rope_or_a_window_unpadded_fails(
    model, engine, clips, references, monkeypatch
):
    short = clips[1]
    expected = placed(model, references[1], AUDIO)
    with monkeypatch.context() as patched:
        patched.setattr(glmasr_encoder, "_rotated", lambda x, cos, sin: x)
        unturned = engine.encode_audio([short])[0]
    assert unturned.shape == expected.shape
    assert (unturned - expected).abs().max() > 1e-2
    encoder = engine.audio.encoder
    features = torch.from_numpy(audio.log_mel(short.samples, 128))[None]
    with torch.no_grad():
        rows = encoder.audio_tower(features)[0, : 4 * len(expected)]
        unpadded = encoder.multi_modal_projector(rows.reshape(len(expected), -1))
    assert (unpadded - expected).abs().max() > 1e-2


def test_a_transcription_prompt_is_apply_transcription_request_s(engine, made, clips):
    short = clips[1]

    def render(messages, add_generation_prompt=False):
        return engine.render(messages, add_generation_prompt=add_generation_prompt)

    text = glmasr_clips.transcription(engine.tokenizer, render, None)
    ids, _ = engine.audio_prompt(text, [short])
    expected = made.apply_transcription_request(short.samples)
    assert ids == expected["input_ids"][0].tolist()
    with pytest.raises(UsageError, match="language 'en': GLM-ASR's transcription prompt takes no"):
        glmasr_clips.transcription(engine.tokenizer, render, "en")


@pytest.mark.parametrize(
    "answer",
    [
        'The spoken content of the audio is "Hello there."',
        "  The transcription of the audio is 'Bonjour' . ",
        "The content of the input audio is Guten Tag.",
        "plain words",
        '"quoted"',
        "",
    ],
)
def test_an_answer_reads_as_decode_with_strip_prefix_reads_it(made, answer):
    assert glmasr_clips.transcript(answer) == made._strip_assistant_prefix_and_quotes(answer)


def test_the_converter_s_ggufs_match_transformers(
    model, folder, wavs, clips, references, tmp_path, monkeypatch
):
    """Also `chat GGUF --mmproj MMPROJ` with `/audio A`: the audio encoder loads at the
    first clip."""
    if not CONVERTER.is_file():
        pytest.skip(needs_converter.kwargs["reason"])
    original = original_layout(folder, tmp_path / "original")
    text, mmproj = converted(original, tmp_path)
    # F32 but the tower's convolutions, which the converter keeps F16: transformers with
    # those rounded is the reference.
    rounded = copy.deepcopy(model)
    tower = rounded.model.audio_tower
    for layer in (tower.conv1, tower.conv2):
        layer.weight.data = layer.weight.data.half().float()
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    # The converter gives the text GGUF the folder's template; its SentencePiece vocabulary
    # puts a space before the text as the tiny tokenizer.json does not.
    expected = check_matches(rounded, engine, clips[1], references[1], same_ids=False)
    options = ("--mmproj", mmproj, "-n", "8", "--temperature", "0")
    chat = llmrun("chat", text, *options, input=f"/audio {wavs[1]}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"
    monkeypatch.setattr(glmasr, "_halves_order", lambda args: torch.arange(args.hidden_size))
    unordered = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    planted = unordered.encode_audio([clips[1]])[0]
    assert (planted - engine.encode_audio([clips[1]])[0]).abs().max() > 1e-2


def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, references):
    """`llmrun run FOLDER --audio A "prompt"` and `chat` with `/audio A` then the question:
    transformers' greedy reply."""
    expected = greedy_tokens(model, references[1])
    check_run_and_chat_with_a_clip(engine, folder, wavs[1], QUESTION, expected)

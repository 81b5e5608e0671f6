"""Qwen3-ASR with audio against transformers: a tiny random Qwen3ASRForConditionalGeneration
(a Qwen3 under Qwen3-Omni's Conv2d audio tower, attending within windows, its projector
apart) and Qwen3ASRProcessor (Qwen3ASRFeatureExtractor, its token counts, its chat
template) make the reference, for a 2.5-second clip (chunks of 100, 100 and 50 frames; two
attention windows) and a 0.3-second one (which the feature extractor zero-pads to half a
second). The log-mel features, the input ids, the audio embeddings (as the language model
takes them), the logits and 8 greedy tokens match; so do Qwen's own layout (thinker_config,
thinker.* weights) and the text GGUF and mmproj GGUF that llama.cpp's converter writes of
that folder. A transcription prompt's ids are apply_transcription_request's, with and
without a language and with a context, and an answer reads as parse_output reads it.
`run --audio` and `chat` with `/audio` reply as transformers. Audio attending across its windows, a short clip's
chunk left short of a whole one, or the clip left unpadded, fails.

Tolerances: ids and tokens exact; features within 1e-5; embeddings and logits within 1e-4.
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
from helpers import CONVERTER, needs_converter
from in_process import llmrun
from qwen3_asr_helpers import (
    ASR_TEXT,
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    converted,
    greedy_tokens,
    processor,
    processor_inputs,
    qwen_layout,
    save_qwen3_asr_dir,
    tiny_qwen3_asr,
)

from llmrun import api, audio, qwen3_asr_clips
from llmrun.errors import UsageError

transformers = pytest.importorskip("transformers")
QUESTION = "What is said?"


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_asr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qwen3_asr_dir(model, tmp_path_factory.mktemp("qwen3-asr"))


@pytest.fixture(scope="module")
def made(folder):
    return processor(folder)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return chirp_wavs(tmp_path_factory.mktemp("wavs"), 2.5, 0.3)


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def references(folder, made, clips):
    return [
        processor_inputs(folder, audio_user_turn(QUESTION), [clip.samples], made) for clip in clips
    ]


def check_matches(model, engine, clip, reference, same_ids: bool = True) -> list[int]:
    args = (model, engine, clip, reference, QUESTION, AUDIO, 256, 16, (AUDIO_START, AUDIO_END))
    return check_clip_prompt(*args, same_ids=same_ids)


def test_features_and_token_counts_are_the_processor_s(engine, clips, references):
    for clip, reference in zip(clips, references, strict=True):
        frames = int(reference["input_features_mask"][0].sum())
        expected = reference["input_features"][0, :, :frames].numpy()
        padded = np.pad(clip.samples, (0, max(0, 8000 - len(clip.samples))))
        features = audio.log_mel(padded, 128)
        assert features.shape == expected.shape
        np.testing.assert_allclose(features, expected, atol=1e-5, rtol=0)
        assert engine.audio_tokens(clip) == int((reference["input_ids"] == AUDIO).sum())
    assert [engine.audio_tokens(clip) for clip in clips] == [33, 7]


def test_audio_prompts_match_transformers(model, engine, clips, references):
    for clip, reference in zip(clips, references, strict=True):
        check_matches(model, engine, clip, reference)


def test_audio_across_windows_or_a_short_clip_unpadded_fail(
    model, engine, clips, references, monkeypatch
):
    long, short = clips
    with monkeypatch.context() as patched:
        patched.setattr(engine.audio.encoder.args, "n_window_infer", 1000)
        planted = engine.encode_audio([long])[0]
    expected = placed(model, references[0], AUDIO)
    assert planted.shape == expected.shape
    assert (planted - expected).abs().max() > 1e-2
    padded = np.pad(short.samples, (0, 8000 - len(short.samples)))
    features = torch.from_numpy(audio.log_mel(padded, 128))
    with torch.no_grad():
        unpadded_chunk = engine.audio.encoder(features, whole_chunks=False)
    assert (unpadded_chunk - placed(model, references[1], AUDIO)).abs().max() > 1e-2
    monkeypatch.setattr(qwen3_asr_clips, "MIN_SAMPLES", 0)
    assert engine.audio_tokens(short) != int((references[1]["input_ids"] == AUDIO).sum())


@pytest.mark.parametrize(("language", "context"), [("en", None), (None, None), ("de", "Ada")])
def test_a_transcription_prompt_is_apply_transcription_request_s(
    engine, made, clips, language, context
):
    long = clips[0]

    def render(messages):
        return engine.render(messages, add_generation_prompt=False)

    text = qwen3_asr_clips.transcription(engine.tokenizer, render, language, context)
    ids, _ = engine.audio_prompt(text, [long])
    expected = made.apply_transcription_request(long.samples, language=language, prompt=context)
    assert ids == expected["input_ids"][0].tolist()
    with pytest.raises(UsageError, match="language 'xx': Qwen3-ASR transcribes ar, cs"):
        qwen3_asr_clips.transcription(engine.tokenizer, render, "xx")


@pytest.mark.parametrize(
    "answer",
    [
        "language English<asr_text>Hello there.",
        "  language None<asr_text> \n",
        "no marker at all ",
        "language Chinese<asr_text>" + "ha" * 30 + " then " + "x" * 25 + " end",
        "system\nassistant\nlanguage French<asr_text>Bonjour",
        "",
    ],
)
def test_an_answer_reads_as_parse_output_reads_it(made, answer):
    assert qwen3_asr_clips.transcript(answer) == made.parse_output(answer)["transcription"]


def test_the_answer_s_marker_survives_decoding(engine):
    """<asr_text> is no special token: a stream's text keeps it, as transformers' decode
    with skip_special_tokens does, so the transcription can be found after it."""
    ids = engine.tokenizer.encode("language English<asr_text>Hello")
    assert ASR_TEXT in ids
    assert qwen3_asr_clips.transcript(engine.tokenizer.decode(ids)) == "Hello"


def test_qwen_s_layout_and_the_converter_s_ggufs_match_transformers(
    model, folder, wavs, clips, references, tmp_path
):
    """Also `chat GGUF --mmproj MMPROJ` with `/audio A`: the audio encoder loads at the
    first clip."""
    qwen = qwen_layout(folder, tmp_path / "qwen")
    engine = api.load(str(qwen), device="cpu", audio=True)
    check_matches(model, engine, clips[0], references[0])
    if not CONVERTER.is_file():
        pytest.skip(needs_converter.kwargs["reason"])
    text, mmproj = converted(qwen, tmp_path)
    # F32 but the tower's convolutions and conv_out, which the converter keeps F16: transformers
    # with those rounded is the reference. The mmproj holds no attention windows: llmrun takes
    # the Hub's (800 frames).
    rounded = copy.deepcopy(model)
    tower = rounded.model.audio_tower
    for layer in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
        layer.weight.data = layer.weight.data.half().float()
    tower.n_window_infer = 800
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    assert engine.audio.encoder.args.n_window_infer == 800
    # The converter gives the text GGUF a ChatML template of text content, which takes
    # the audio part as Qwen3-ASR's markers; its SentencePiece vocabulary puts a space
    # before the text as the tiny tokenizer.json does not.
    expected = check_matches(rounded, engine, clips[0], references[0], same_ids=False)
    options = ("--mmproj", mmproj, "-n", "8", "--temperature", "0")
    chat = llmrun("chat", text, *options, input=f"/audio {wavs[0]}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"


def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, references):
    """`llmrun run FOLDER --audio A "prompt"` and `chat` with `/audio A` then the question:
    transformers' greedy reply."""
    expected = greedy_tokens(model, references[1])
    check_run_and_chat_with_a_clip(engine, folder, wavs[1], QUESTION, expected)

"""Fun-ASR-Nano with audio against transformers: a tiny random FunAsrNanoForConditionalGeneration
(a Qwen3 under SenseVoice's SAN-M encoder and a Transformer adaptor, a token per 60 ms) and
FunAsrNanoProcessor (its chat template, its token counts) make the reference, for a
2.5-second clip and a 0.7-second one. The fbank features are Kaldi's (kaldi-native-fbank),
stacked as the extractor's own _apply_lfr stacks them; the input ids, the audio embeddings
(as the language model takes them), the logits and 8 greedy tokens match. A transcription
prompt's ids are apply_transcription_request's (with a language and a context text).
`run --audio` and `chat` with `/audio` reply as transformers. The encoder without its FSMN
memory, or its positions counted from zero, fails.

Tolerances: ids and tokens exact; the stacking exact; fbank within 5e-4 of kaldi-native-fbank
(whose own float32 arithmetic differs as much from torchaudio's, which the extractor runs and
llmrun's is within 5e-5 of); embeddings and logits within 1e-4, transformers run on llmrun's
features.
"""

import json

import numpy as np
import pytest
import torch
from audio_checks import audio_user_turn, chirp_wavs, placed
from fun_asr_nano_helpers import (
    AUDIO,
    kaldi_fbank,
    processor,
    save_fun_asr_nano_dir,
    tiny_fun_asr_nano,
    transformers_lfr,
)
from in_process import llmrun
from serving import GREEDY

from llmrun import api, audio, fun_asr_nano_clips
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.models import fun_asr_nano_audio

transformers = pytest.importorskip("transformers")
pytest.importorskip("kaldi_native_fbank")
QUESTION = "What is said?"


@pytest.fixture(scope="module")
def model():
    return tiny_fun_asr_nano()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_fun_asr_nano_dir(model, tmp_path_factory.mktemp("fun_asr_nano"))


@pytest.fixture(scope="module")
def made(folder):
    return processor(folder)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return chirp_wavs(tmp_path_factory.mktemp("wavs"), 2.5)


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def references(made, engine, clips):
    """The processor's inputs for a user turn of each clip and QUESTION, its features
    replaced by llmrun's (checked against the extractor's in the first test)."""
    out = []
    for clip in clips:
        text = made.apply_chat_template(
            audio_user_turn(QUESTION), add_generation_prompt=True, tokenize=False
        )
        inputs = made(text=text, audio=[clip.samples], sampling_rate=16000)
        ours = fun_asr_nano_clips.features(engine.audio, clip)
        out.append({**inputs, "input_features": ours[None]})
    return out


def test_features_are_the_extractor_s(engine, made, clips, references):
    lfr = transformers_lfr()
    for clip, reference in zip(clips, references, strict=True):
        kaldi = kaldi_fbank(clip.samples)
        ours = fun_asr_nano_clips.fbank(clip.samples, 80)
        torch.testing.assert_close(ours, kaldi, atol=5e-4, rtol=0)
        stacked = fun_asr_nano_clips.stacked(kaldi, 7, 6)
        assert torch.equal(stacked, lfr(made.feature_extractor, kaldi))
        extracted = made.feature_extractor(clip.samples)["input_features"][0]
        torch.testing.assert_close(reference["input_features"][0], extracted, atol=5e-4, rtol=0)
        assert engine.audio_tokens(clip) == int((reference["input_ids"] == AUDIO).sum())
    assert [engine.audio_tokens(clip) for clip in clips] == [42, 12]
    name = "long.wav"
    with pytest.raises(UsageError, match=f"{name}: 24.1 seconds of audio; Fun-ASR-Nano takes 24.0"):
        engine.audio_tokens(audio.Clip(np.zeros(int(24.1 * 16000)), name))
    with pytest.raises(UsageError, match="shorter than Fun-ASR-Nano's 25 ms frame"):
        engine.audio_tokens(audio.Clip(np.zeros(399), "tiny.wav"))


def test_audio_prompts_match_transformers(model, engine, clips, references):
    for clip, reference in zip(clips, references, strict=True):
        ids, prompt_images = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
        assert ids == reference["input_ids"][0].tolist()
        torch.testing.assert_close(
            prompt_images.embeds[0], placed(model, reference, AUDIO), atol=1e-4, rtol=0
        )
        with torch.no_grad():
            expected = model(**reference).logits[0]
            state = KVState(engine.model.new_cache(1, 512, torch.float32, "cpu"))
            last = prefill(engine.model, state, ids, chunk=64, images=prompt_images)
            logits = engine.model(
                torch.tensor([ids]),
                torch.arange(len(ids))[None],
                images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
            )[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
        with torch.no_grad():
            out = model.generate(**reference, max_new_tokens=8, do_sample=False)
        tokens = out[0, len(ids) :].tolist()
        stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
        assert [r.token for r in stream if r.token is not None] == tokens


def test_the_encoder_without_its_memory_or_positions_from_zero_fails(
    model, engine, clips, references, monkeypatch
):
    short, expected = clips[1], placed(model, references[1], AUDIO)
    table = fun_asr_nano_audio.positions
    for name, planted in (
        ("forward", lambda self, values: values),
        # The tower drops the table's first row: this one begins with it twice.
        (
            "positions",
            lambda length, channels: torch.cat([table(1, channels), table(length - 1, channels)]),
        ),
    ):
        with monkeypatch.context() as patched:
            owner = fun_asr_nano_audio.FSMN if name == "forward" else fun_asr_nano_audio
            patched.setattr(owner, name, planted)
            wrong = engine.encode_audio([short])[0]
        assert wrong.shape == expected.shape
        assert (wrong - expected).abs().max() > 1e-2


def test_a_transcription_prompt_is_apply_transcription_request_s(engine, made, clips):
    short = clips[1]

    def render(messages, add_generation_prompt=False):
        return engine.render(messages, add_generation_prompt=add_generation_prompt)

    for language, context in ((None, None), ("en", "Ada met Bob."), ("ja", None)):
        text = fun_asr_nano_clips.transcription(engine.tokenizer, render, language, context)
        ids, _ = engine.audio_prompt(text, [short])
        expected = made.apply_transcription_request(
            short.samples, language=language, prompt=context
        )
        assert ids == expected["input_ids"][0].tolist()
    with pytest.raises(UsageError, match="language 'fr': Fun-ASR-Nano's transcription prompt"):
        fun_asr_nano_clips.transcription(engine.tokenizer, render, "fr")


def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, references):
    """`llmrun run FOLDER --audio A "prompt"` and `chat` with `/audio A` then the question:
    transformers' greedy reply."""
    with torch.no_grad():
        out = model.generate(**references[1], max_new_tokens=8, do_sample=False)
    expected = out[0, references[1]["input_ids"].shape[1] :].tolist()
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, "--audio", wavs[1], QUESTION, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    chat = llmrun("chat", folder, *options, input=f"/audio {wavs[1]}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"


def test_run_with_audio_and_no_prompt_transcribes(model, folder, engine, made, wavs, clips):
    """`llmrun run FOLDER --audio A --language en`: transformers' greedy reply to
    apply_transcription_request's prompt."""
    inputs = made.apply_transcription_request(clips[1].samples, language="en")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected = engine.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :].tolist())
    result = llmrun("run", folder, "--audio", wavs[1], "--language", "en", "-n", "8")
    assert result.returncode == 0, result.stderr
    # The stream keeps the first token's leading space, which a whole decode drops.
    assert result.stdout.lstrip(" ") == expected + "\n"
    verbose = llmrun(
        "run",
        folder,
        "--audio",
        wavs[1],
        "--language",
        "en",
        "-n",
        "8",
        "--output-format",
        "verbose_json",
    )
    assert verbose.returncode == 0, verbose.stderr
    body = json.loads(verbose.stdout)
    assert (body["text"].lstrip(" "), body["language"]) == (expected, "english")
    assert body["duration"] == len(clips[1].samples) / 16000 and "segments" not in body
    usage = json.loads(
        llmrun("run", folder, "--audio", wavs[1], "-n", "8", "--output-format", "json").stdout
    )["usage"]
    assert usage["output_tokens"] == 8 == usage["total_tokens"] - usage["input_tokens"]
    refused = llmrun("run", folder, "--audio", wavs[1], "--language", "fr")
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: language 'fr': Fun-ASR-Nano's transcription")
    subtitles = llmrun("run", folder, "--audio", wavs[1], "--output-format", "srt")
    assert subtitles.returncode == 2
    assert subtitles.stderr == (
        f"error: --output-format srt: {engine.name} is an audio-language model, which "
        "predicts no timestamps\n"
    )

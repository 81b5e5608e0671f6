"""VibeVoice-ASR with audio against transformers: a tiny random VibeVoiceAsrForConditionalGeneration
(a Qwen2 under acoustic and semantic convolutional tokenizer encoders of the 24 kHz
waveform, the released 3200-sample hop, in 9600-sample chunks) and VibeVoiceAsrProcessor
(its feature extractor's scaling and padding, its token counts and durations, the Hub's
chat template) make the reference, for a 2-second clip and a 0.7-second one (both over
several chunks). The scaled samples, the input ids, the audio embeddings (as the language
model takes them), the logits and 8 greedy tokens match, transformers run with
sample=False (the acoustic latents' mean, without the sigma-VAE's noise). A transcription
prompt's ids are apply_transcription_request's, and an answer reads as
decode(return_format="transcription_only") reads it. `run --audio` and `chat` with
`/audio` reply as transformers; `run --audio` without a prompt transcribes. The encoders
without their carried inputs between chunks, or without the acoustic stream, fail.

Tolerances: ids and tokens exact; samples within 1e-6; embeddings and logits within 1e-4.
"""

import json

import pytest
import torch
from audio_checks import audio_user_turn, chirp_wavs, placed
from in_process import llmrun
from serving import GREEDY
from vibevoice_asr_helpers import AUDIO, processor, save_vibevoice_asr_dir, tiny_vibevoice_asr

from llmrun import api, audio, vibevoice_asr_clips
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.models import vibevoice_asr_audio

transformers = pytest.importorskip("transformers")
QUESTION = "Two speakers."


@pytest.fixture(scope="module")
def model():
    return tiny_vibevoice_asr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_vibevoice_asr_dir(model, tmp_path_factory.mktemp("vibevoice_asr"))


@pytest.fixture(scope="module")
def made(folder):
    return processor(folder)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return chirp_wavs(tmp_path_factory.mktemp("wavs"), 2.0)


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def references(made, clips):
    out = []
    for clip in clips:
        text = made.apply_chat_template(audio_user_turn(QUESTION), tokenize=False)
        out.append({**made(text=text, audio=[clip.at(24000)]), "sample": False})
    return out


def greedy(model, inputs, tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**{"sample": False, **inputs}, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_samples_and_token_counts_are_the_processor_s(engine, clips, references):
    for clip, reference in zip(clips, references, strict=True):
        ours = vibevoice_asr_clips.samples(engine.audio, clip)
        torch.testing.assert_close(ours, reference["input_values"][0, 0], atol=1e-6, rtol=0)
        assert engine.audio_tokens(clip) == int((reference["input_ids"] == AUDIO).sum())
    assert [engine.audio_tokens(clip) for clip in clips] == [15, 6]


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
        stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
        assert [r.token for r in stream if r.token is not None] == greedy(model, reference)


def test_chunks_without_carried_inputs_or_the_acoustic_stream_fail(
    model, engine, clips, references, monkeypatch
):
    expected = placed(model, references[0], AUDIO)
    projector = vibevoice_asr_audio.Projector
    project = projector.forward
    for owner, name, planted in (
        (vibevoice_asr_audio.CausalConv1d, "forward", _uncarried),
        (projector, "forward", lambda self, a, s: project(self, a * 0, s)),
    ):
        with monkeypatch.context() as patched:
            patched.setattr(owner, name, planted)
            wrong = engine.encode_audio([clips[0]])[0]
        assert wrong.shape == expected.shape
        assert (wrong - expected).abs().max() > 1e-2


def _uncarried(self, x, carry):
    """A causal convolution that pads every chunk with zeros."""
    return self.conv(torch.nn.functional.pad(x, (self.left, 0)))


def test_a_transcription_prompt_is_apply_transcription_request_s(engine, made, clips):
    short = clips[1]

    def render(messages, add_generation_prompt=False):
        return engine.render(messages, add_generation_prompt=add_generation_prompt)

    for context in (None, "Ada and Bob."):
        text = vibevoice_asr_clips.transcription(engine.tokenizer, render, None, context)
        ids, _ = engine.audio_prompt(text, [short])
        expected = made.apply_transcription_request(short.at(24000), prompt=context)
        assert ids == expected["input_ids"][0].tolist()
    with pytest.raises(UsageError, match="language 'en': VibeVoice-ASR's transcription prompt"):
        vibevoice_asr_clips.transcription(engine.tokenizer, render, "en")


@pytest.mark.parametrize(
    "answer",
    [
        'assistant\n[{"Start":0.0,"End":1.5,"Speaker":0,"Content":"Hello there."},'
        '{"Start":1.5,"End":2,"Speaker":1,"Content":"Hi."}]\n',
        'assistant\n[{"Start":0,"End":1.2,"Speaker":0,"Content":"cut"}, {"Start":1.2,"En',
        '[{"Start":"soon","End":1,"Speaker":0,"Content":"x"}]',
        "plain words",
        "",
    ],
)
def test_an_answer_reads_as_the_processor_reads_it(made, answer):
    expected = made.extract_transcription(answer)
    assert vibevoice_asr_clips.transcript(answer) == expected


def test_run_chat_and_a_transcription_reply_as_transformers(
    model, folder, engine, made, wavs, clips, references
):
    """`llmrun run FOLDER --audio A "prompt"`, `chat` with `/audio A` then the question, and
    `run FOLDER --audio A` (a transcription): transformers' greedy replies."""
    expected = greedy(model, references[1])
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, "--audio", wavs[1], QUESTION, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    chat = llmrun("chat", folder, *options, input=f"/audio {wavs[1]}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    # The stream keeps the first token's leading space, which a whole decode drops.
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"
    inputs = made.apply_transcription_request(clips[1].at(24000))
    answer = engine.tokenizer.decode(greedy(model, inputs))
    transcribed = llmrun("run", folder, "--audio", wavs[1], "-n", "8")
    assert transcribed.returncode == 0, transcribed.stderr
    assert transcribed.stdout == vibevoice_asr_clips.transcript(answer) + "\n"

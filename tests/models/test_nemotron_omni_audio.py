"""Nemotron 3 Nano Omni with audio against transformers: the tiny random
NemotronH_Omni_Reasoning_V3 of nemotron_omni_helpers (a Parakeet tower of 2 blocks over 16
mel bins, its projector; a Nemotron-H of a Mamba-2 and an attention layer), its folder as
save_pretrained writes it (the Hub's tensor names), ParakeetFeatureExtractor and the
processor's own prompt expansion as the reference.

Clips of 0.8 s (81 frames, 11 tokens: the last past the 80 frames the extractor's mask
gives the tower, so it attends as a masked row, as in transformers) and 0.37 s (38 frames,
5 tokens):
the features, the prompt ids (each clip between <so_start> and <so_end>), the audio
embeddings, the logits (whole, and prefilled in chunks) and 8 greedy tokens match;
`run --audio` and `chat` with /audio reply with transformers' tokens; so does a message
with an image and a clip. A relative-position shift off by one, or a tower that masks no
position, fails.

Tolerances: features 1e-5, embeddings and logits 1e-4 (absolute); ids and tokens exact.
"""

import json

import numpy as np
import pytest
import torch
from in_process import llmrun
from nemotron_omni_helpers import (
    AUDIO,
    SO_END,
    SO_START,
    SOUND,
    greedy_tokens,
    processor_inputs,
    save_nemotron_omni_dir,
    tiny_nemotron_omni,
)
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, nemotron_omni_clips
from llmrun.audio import SAMPLE_RATE, Clip, open_audio
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.models import parakeet_encoder
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What do you hear?"
SECONDS = (0.8, 0.37)
TOKENS = (11, 5)


@pytest.fixture(scope="module")
def model():
    return tiny_nemotron_omni()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_nemotron_omni_dir(model, tmp_path_factory.mktemp("nemotron_omni_audio"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    out = tmp_path_factory.mktemp("nemotron_omni_wavs")
    paths = []
    for seed, seconds in enumerate(SECONDS):
        path = out / f"clip{seed}.wav"
        path.write_bytes(wav_bytes(chirp(seconds, SAMPLE_RATE, seed), SAMPLE_RATE))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def clips(wavs):
    return [open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def references(folder, engine, clips):
    return [processor_inputs(folder, None, [], QUESTION, [clip.samples]) for clip in clips]


def audio_embeddings(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.get_audio_features(
            reference["input_features"], reference["input_features_mask"]
        )
    return out.pooler_output


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def test_features_prompt_embeddings_logits_and_tokens_are_transformers(
    model, engine, clips, references
):
    for clip, reference, tokens in zip(clips, references, TOKENS, strict=True):
        ours = nemotron_omni_clips.features(clip.samples, AUDIO["num_mel_bins"])
        torch.testing.assert_close(ours, reference["input_features"][0], atol=1e-5, rtol=0)
        ids, prompt_images = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
        assert ids == reference["input_ids"][0].tolist()
        (start,) = prompt_images.starts
        count = len(prompt_images.embeds[0])
        assert count == tokens == nemotron_omni_clips.clip_tokens(engine.audio, clip)
        assert ids[start - 1 : start + count + 1] == [SO_START, *[SOUND] * count, SO_END]
        expected = audio_embeddings(model, reference)
        torch.testing.assert_close(prompt_images.embeds[0], expected, atol=1e-4, rtol=0)
        with torch.no_grad():
            whole = model(**reference).logits[0]
            state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
            last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
        torch.testing.assert_close(logits(engine, ids, prompt_images), whole, atol=1e-4, rtol=0)
        torch.testing.assert_close(last, whole[-1], atol=1e-4, rtol=0)
    assert [len(r["input_features"][0]) for r in references] == [81, 38]
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == greedy_tokens(model, reference)


def test_planted_bugs_give_other_embeddings(engine, clips, monkeypatch):
    """Scores shifted by one relative position more, or no position masked (the last
    token of the 0.8 s clip attending as a valid one), move the embeddings."""
    expected = nemotron_omni_clips.encode(engine.audio, clips)
    original = parakeet_encoder.relative_positions

    def shifted(length: int, hidden: int) -> torch.Tensor:
        return torch.roll(original(length, hidden), 1, dims=0)

    with monkeypatch.context() as patch:
        patch.setattr(parakeet_encoder, "relative_positions", shifted)
        moved = nemotron_omni_clips.encode(engine.audio, clips)
    assert max((a - b).abs().max() for a, b in zip(moved, expected, strict=True)) > 1e-2
    with monkeypatch.context() as patch:
        patch.setattr(parakeet_encoder.EncoderArgs, "tokens", lambda self, frames: frames)
        unmasked = [engine.audio(nemotron_omni_clips.features(c.samples, 16)) for c in clips]
    assert max((a[-1] - b[-1]).abs().max() for a, b in zip(unmasked, expected, strict=True)) > 1e-2


def test_a_clip_under_two_frames_is_refused(engine):
    with pytest.raises(UsageError, match="too short"):
        engine.audio_prompt(
            engine.prompt_text(QUESTION, audio=1), [Clip(np.zeros(300, np.float32), "tiny.wav")]
        )


def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, references):
    """`llmrun run FOLDER --audio A "prompt"` and `chat` with `/audio A` then the question:
    transformers' greedy reply (to its EOS, where run stops)."""
    expected = greedy_tokens(model, references[0])
    expected = expected[: expected.index(2)] if 2 in expected else expected
    assert len(expected) >= 4
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, "--audio", wavs[0], QUESTION, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    ids, _ = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [open_audio(wavs[0])])
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", folder, *options, input=f"/audio {wavs[0]}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"


def test_an_image_and_a_clip_in_one_prompt_are_transformers(model, folder, clips):
    """One message with an image then a clip (the processor takes both): the ids, logits
    and 8 greedy tokens are transformers'."""
    from vision_helpers import picture

    from llmrun.images import open_image

    engine = api.load(str(folder), device="cpu", vision=True, audio=True)
    image = open_image(picture(56, 72, 4))
    text = engine.prompt_text(QUESTION, images=1, audio=1)
    ids, media = engine.media_prompt(text, [image], clips[:1])
    reference = processor_inputs(folder, engine.vision, [image], QUESTION, [clips[0].samples])
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in media.embeds] == [20, TOKENS[0]]
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, media), expected, atol=1e-4, rtol=0)
    stream = engine.generate(ids, GREEDY, 8, images=media)
    assert [r.token for r in stream if r.token is not None] == greedy_tokens(model, reference)

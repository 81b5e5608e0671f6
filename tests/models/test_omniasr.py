"""OmniASR with audio against transformers: a tiny random OmniASRForConditionalGeneration (a
Llama under a wav2vec2-style encoder of the raw samples, a token per 320 samples) and
OmniASRProcessor (OmniASRFeatureExtractor's normalization, its token counts, the folder's
chat template) make the reference, for a 2.3-second clip and a 0.7-second one. The
normalized samples, the transcription prompt's ids (apply_transcription_request's, with a
language, an ISO 639-1 code or the model's own, and without), the audio embeddings (as the
language model takes them), the logits and 8 greedy tokens match; `run --audio` transcribes
as generate does and `show` names the architecture. Unnormalized samples, or the
positional convolution left out, fail.

Tolerances: ids and tokens exact; samples within 1e-6; embeddings and logits within 1e-4.
"""

import pytest
import torch
from audio_checks import chirp_wavs, placed
from in_process import llmrun
from omniasr_helpers import (
    AUDIO,
    LANG_ENG,
    greedy_tokens,
    processor,
    save_fuse_tokenizer,
    save_omniasr_dir,
    tiny_omniasr,
)
from serving import GREEDY

from llmrun import api, audio, omniasr_clips
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return tiny_omniasr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_omniasr_dir(model, tmp_path_factory.mktemp("omniasr"))


@pytest.fixture(scope="module")
def made(folder):
    return processor(folder)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return chirp_wavs(tmp_path_factory.mktemp("wavs"), 2.3)


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


def request(made, clip, language=None):
    return made.apply_transcription_request(clip.samples, language=language, return_tensors="pt")


def test_prompts_embeddings_logits_and_greedy_tokens_match_transformers(model, engine, made, clips):
    for clip in clips:
        reference = request(made, clip, "en")
        values = made.feature_extractor(clip.samples, sampling_rate=16000)["input_values"]
        ours = omniasr_clips.normalized(torch.tensor(clip.samples))
        torch.testing.assert_close(ours, values[0, 0], atol=1e-6, rtol=0)
        ids, prompt_images = engine.audio_prompt(engine.transcription_prompt("en"), [clip])
        assert ids == reference["input_ids"][0].tolist()
        assert engine.audio_tokens(clip) == int((reference["input_ids"] == AUDIO).sum())
        assert ids[-2:] == [LANG_ENG, engine.tokenizer.bos_id]
        torch.testing.assert_close(
            prompt_images.embeds[0], placed(model, reference, AUDIO), atol=1e-4, rtol=0
        )
        with torch.no_grad():
            expected = model(**reference).logits[0]
            logits = engine.model(
                torch.tensor([ids]),
                torch.arange(len(ids))[None],
                images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
            )[0]
            state = KVState(engine.model.new_cache(1, 512, torch.float32, "cpu"))
            last = prefill(engine.model, state, ids, chunk=16, images=prompt_images)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
        stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
        assert [r.token for r in stream if r.token is not None] == greedy_tokens(model, reference)
    assert [engine.audio_tokens(clip) for clip in clips] == [115, 35]


def test_a_language_is_the_processor_s(engine, made, clips):
    short = clips[1]
    for language in (None, "eng_Latn", "FR", "auto"):
        ids, _ = engine.audio_prompt(engine.transcription_prompt(language), [short])
        assert ids == request(made, short, language)["input_ids"][0].tolist()
    with pytest.raises(ValueError, match="Unknown `language='de'`"):
        request(made, short, "de")
    with pytest.raises(UsageError, match="language 'de': the model has no <|lang:deu_latn|>"):
        engine.transcription_prompt("de")


def test_unnormalized_samples_or_no_positions_fail(model, engine, made, clips, monkeypatch):
    short = clips[1]
    expected = placed(model, request(made, short), AUDIO)
    with monkeypatch.context() as patched:
        patched.setattr(omniasr_clips, "normalized", lambda samples: samples)
        raw = engine.encode_audio([short])[0]
    assert raw.shape == expected.shape
    assert (raw - expected).abs().max() > 1e-2
    positions = engine.audio.encoder.audio_tower.encode_positions
    with monkeypatch.context() as patched:
        patched.setattr(positions, "forward", lambda x: torch.zeros_like(x))
        unplaced = engine.encode_audio([short])[0]
    assert (unplaced - expected).abs().max() > 1e-2


def test_run_transcribes_as_generate_and_show_names_it(model, folder, engine, made, wavs, clips):
    """`llmrun run FOLDER --audio A --language en`: the decode of transformers' greedy
    tokens on apply_transcription_request's inputs."""
    expected = greedy_tokens(model, request(made, clips[1], "en"))
    options = ("--language", "en", "-n", "8", "--temperature", "0")
    result = llmrun("run", folder, "--audio", wavs[1], *options)
    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.tokenizer.decode(expected) + "\n"
    bad = llmrun("run", folder, "--audio", wavs[1], "--language", "xx")
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: language 'xx': the model has no <|lang:xx|> token; give an ISO 639-1 code "
        "(en), one of its language codes (eng_Latn), or auto"
    )
    shown = llmrun("show", folder)
    assert shown.returncode == 0, shown.stderr
    assert "architecture   omniasr\n" in shown.stdout


def test_an_omniasr_tokenizer_decodes_as_transformers(tmp_path):
    """OmniASRConverter's tokenizer.json (pieces with their spaces, the Fuse decoder): ids
    and text as transformers' tokenizer gives them."""
    folder = save_fuse_tokenizer(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_hf_dir(folder)
    text = "  hello world  ça va é "
    ids = reference(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, add_bos=False) == ids
    assert " " in reference.convert_ids_to_tokens(ids)[5]
    spoken = [1, *ids, 2]
    assert ours.decode(spoken) == reference.decode(spoken, skip_special_tokens=True)
    assert ours.decode(spoken) == "hello world ça va é"

"""Voxtral with audio against transformers: a tiny random VoxtralForConditionalGeneration
(Whisper encoder, projector, Llama) and WhisperFeatureExtractor (as VoxtralProcessor runs
it: the clip zero-padded to whole 30-second chunks) make the reference; the prompt is laid
out as mistral_common lays out a user turn with audio ([BEGIN_AUDIO], then 375 [AUDIO] per
chunk), written out here by hand. The features, the audio embeddings, the logits of a
prompt with a one-chunk and a two-chunk clip and 8 greedy tokens match; so does the same
model as a text GGUF and an mmproj GGUF laid out as llama.cpp's converter writes them
(benchmarks/llama_cpp_voxtral.py checks that layout against the converter). Frames
grouped in the wrong order fail."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from in_process import llmrun
from voxtral_helpers import (
    AUDIO,
    BEGIN_AUDIO,
    chirp,
    save_voxtral_dir,
    tiny_voxtral,
    wav_bytes,
    write_mmproj,
    write_text_gguf,
)

from llmrun import api, audio, audio_families
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.loading.voxtral_audio import from_hf_dir, from_mmproj
from llmrun.models import whisper_encoder
from llmrun.sampling import SamplingParams
from llmrun.voxtral_clips import encode

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What do you hear?"
INST, END_INST = 512, 513
# A 2-second clip (one chunk) at 16 kHz and a 30.5-second one at 22.05 kHz (two chunks).
TOKENS = [375, 750]


@pytest.fixture(scope="module")
def model():
    return tiny_voxtral()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_voxtral_dir(model, tmp_path_factory.mktemp("voxtral"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wavs")
    short, long = tmp / "short.wav", tmp / "long.wav"
    short.write_bytes(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    long.write_bytes(wav_bytes(chirp(30.5, 22050, seed=2), 22050))
    return short, long


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


@pytest.fixture(scope="module")
def reference(folder, clips):
    """input_ids of the user turn as mistral_common lays it out (each clip's [BEGIN_AUDIO]
    and [AUDIO]s, then the text), tokenized by transformers; input_features as
    VoxtralProcessor makes them (WhisperFeatureExtractor, chunks stacked)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    clips_text = "".join("[BEGIN_AUDIO]" + "[AUDIO]" * count for count in TOKENS)
    text = f"<s>[INST]{clips_text}{QUESTION}[/INST]"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:3] == [1, INST, BEGIN_AUDIO] and ids[-1] == END_INST
    assert ids.count(AUDIO) == sum(TOKENS)
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    features = []
    for clip in clips:
        padded = extractor(
            clip.samples,
            sampling_rate=16000,
            padding=True,
            pad_to_multiple_of=480000,
            truncation=False,
            return_tensors="pt",
        ).input_features
        features.append(padded.reshape(128, -1, 3000).transpose(0, 1))
    return dict(input_ids=torch.tensor([ids]), input_features=torch.cat(features))


@pytest.fixture(scope="module")
def prompt(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)


def audio_features(model, features) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_audio_features(features).pooler_output


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def greedy_tokens(model, reference, tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**reference, max_new_tokens=tokens, do_sample=False)
    return out[0, reference["input_ids"].shape[1] :].tolist()


def test_the_prompt_is_laid_out_as_mistral_common_does(engine, clips, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [engine.audio_tokens(clip) for clip in clips] == TOKENS
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    assert prompt_images.starts == [3, 3 + TOKENS[0] + 1]


def test_features_match_whisper_feature_extractor(clips, reference):
    ours = np.concatenate([audio.chunked_features(clip, 128) for clip in clips])
    assert ours.shape == (3, 128, 3000)
    # VoxtralProcessor's call runs the extractor's torch STFT (float32): within 5e-5.
    np.testing.assert_allclose(ours, reference["input_features"].numpy(), atol=5e-5, rtol=0)
    # Its numpy implementation (float64): within 1e-5.
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    for clip, chunks in zip(clips, (ours[:1], ours[1:]), strict=True):
        padded = np.zeros(len(chunks) * 480000, dtype=np.float32)
        padded[: len(clip.samples)] = clip.samples
        expected = extractor._np_extract_fbank_features(padded[None], "cpu")[0]
        got = chunks.transpose(1, 0, 2).reshape(128, -1)
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_audio_embeddings_match_transformers(model, prompt, reference):
    expected = audio_features(model, reference["input_features"])
    torch.testing.assert_close(torch.cat(prompt[1].embeds), expected, atol=1e-4, rtol=0)


def test_logits_with_audio_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 500, moved so that no clip is split.
        state = KVState(engine.model.new_cache(1, 2048, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=500, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_frames_grouped_in_the_wrong_order_fail(model, engine, clips, reference, monkeypatch):
    """A projector row of 4 frames 375 apart (the chunk's frames transposed) instead of 4
    consecutive ones: the embeddings move."""

    def strided(self, features):
        frames = self.audio_tower(features)
        b, t, width = frames.shape
        stack = self.args.stack
        rows = frames.reshape(b, stack, t // stack, width).transpose(1, 2)
        return self.multi_modal_projector(rows.reshape(-1, self.args.intermediate_size))

    monkeypatch.setattr(whisper_encoder.AudioEncoder, "forward", strided)
    planted = torch.cat(encode(engine.audio, clips))
    expected = audio_features(model, reference["input_features"])
    assert (planted - expected).abs().max() > 1e-2


def test_gguf_with_mmproj_matches_transformers(model, clips, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32 but the conv weights, which the converter keeps F16 whatever --outtype says:
    # transformers with those weights rounded the same way is the reference.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)
    rounded = copy.deepcopy(model)
    for conv in (rounded.model.audio_tower.conv1, rounded.model.audio_tower.conv2):
        conv.weight.data = conv.weight.data.half().float()
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    assert engine.vision is None
    ids, prompt_images = engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)
    assert ids == reference["input_ids"][0].tolist()
    expected_features = audio_features(rounded, reference["input_features"])
    torch.testing.assert_close(
        torch.cat(prompt_images.embeds), expected_features, atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = rounded(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(rounded, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", audio=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF with an audio encoder"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_transformers_5s_key_names_load_the_same_encoder(folder, engine, tmp_path):
    """save_pretrained writes the Hub's names (language_model.*, audio_tower.*,
    multi_modal_projector.*); transformers 5's own are under model.*."""
    from safetensors.torch import load_file, save_file

    renames = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "audio_tower.": "model.audio_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    other = shutil.copytree(folder, tmp_path / "transformers-5")
    state = load_file(other / "model.safetensors")
    renamed = {}
    for key, value in state.items():
        old = next(old for old in renames if key.startswith(old))
        renamed[renames[old] + key[len(old) :]] = value
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    loaded = from_hf_dir(other, 64).encoder.state_dict()
    expected = engine.audio.encoder.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_folder_opened_without_audio_says_its_tower_loads_at_the_first_clip(folder):
    """`chat FOLDER` runs the language model at once; its note says when the audio tower
    loads (as a vision folder's says for its tower), and the tower then loads on demand."""
    engine = api.load(str(folder), device="cpu")
    assert engine.checkpoint.notes == [
        f"{folder}: a multimodal Voxtral; running its language model, without the audio tower"
        " until a clip is given (--audio, /audio)"
    ]


def test_audio_places_must_match_the_clips(engine, clips):
    with pytest.raises(UsageError, match=r"marks 1 audio place \(\[BEGIN_AUDIO\]\) for 2 clips"):
        engine.audio_prompt("[INST][BEGIN_AUDIO]two?[/INST]", clips)
    with pytest.raises(UsageError, match="of its own"):
        engine.audio_prompt("[INST][BEGIN_AUDIO][AUDIO][/INST]", clips[:1])


def test_run_with_audio_replies_as_transformers(model, folder, wavs, reference):
    """`llmrun run FOLDER --audio A --audio B "prompt"`: transformers' greedy reply."""
    args = ["run", str(folder), "--audio", str(wavs[0]), "--audio", str(wavs[1]), QUESTION]
    result = llmrun(*args, "-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ids = [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]
    assert ids == greedy_tokens(model, reference)


def test_audio_for_a_model_without_an_audio_tower_is_one_error_line(wavs):
    result = llmrun("run", "--audio", str(wavs[0]), "hello")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"audio goes to {audio_families.NAMES} models" in line


def test_a_chat_with_audio_replies_as_transformers_in_every_turn(model, folder, wavs, reference):
    """`chat --audio` and `/audio`: the clip goes with the first message, and every turn's
    greedy reply is transformers' over the whole conversation with it."""
    from llmrun.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    questions = (QUESTION, "And then?")
    messages, expected = [], ""
    for question in questions:
        content = [{"type": "audio"}, {"type": "text", "text": question}]
        messages.append({"role": "user", "content": question if messages else content})
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False)
        text = text.replace("[BEGIN_AUDIO]", "[BEGIN_AUDIO]" + "[AUDIO]" * TOKENS[0])
        ids = hf_tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        inputs = dict(input_ids=ids, input_features=reference["input_features"][:1])
        answer = tokenizer.decode(greedy_tokens(model, inputs))
        messages.append({"role": "assistant", "content": answer})
        expected += answer + "\n\n"
    options = ("-n", "8", "--temperature", "0")
    flag = llmrun("chat", folder, "--audio", wavs[0], *options, input="\n".join(questions))
    assert flag.returncode == 0, flag.stderr
    assert flag.stdout == expected
    command = llmrun("chat", folder, *options, input="\n".join([f"/audio {wavs[0]}", *questions]))
    assert command.returncode == 0, command.stderr
    assert command.stdout == expected

"""Qwen2-Audio with audio against transformers: a tiny random
Qwen2AudioForConditionalGeneration (Whisper encoder with its average pool, linear
projector, Qwen2) and Qwen2AudioProcessor (WhisperFeatureExtractor, its chat template and
its count of <|AUDIO|> per clip) make the reference, for a prompt with a 2-second clip at
16 kHz and a 1.3-second one at 22.05 kHz. The input ids, the audio embeddings (as the
language model takes them), the logits and 8 greedy tokens match; so does the same model
as a text GGUF and an mmproj GGUF laid out as llama.cpp's converter writes them
(benchmarks/llama_cpp_qwen2_audio.py checks that layout against the converter), and
serve's reply to an `input_audio` part equals run's. A pool skipped or of the wrong
stride fails.

Tolerances: ids and tokens exact; embeddings and logits within 1e-4.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from audio_checks import audio_body, check_run_with_audio, placed, two_rate_wavs
from in_process import llmrun
from qwen2_audio_helpers import (
    AUDIO,
    AUDIO_BOS,
    AUDIO_EOS,
    greedy_tokens,
    processor_inputs,
    save_qwen2_audio_dir,
    tiny_qwen2_audio,
    write_mmproj,
    write_text_gguf,
)
from serving import GREEDY
from starlette.testclient import TestClient
from vision_checks import check_prompt_logits, greedy_ids, logits
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio
from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import vl_text
from llmrun.loading.qwen2_audio import encoder_args, from_mmproj
from llmrun.models.qwen2 import ModelArgs as Qwen2ModelArgs
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
QUESTION = "What do you hear?"
# 2 s at 16 kHz: 200 feature frames, 100 after the convolutions, 50 tokens; 1.3 s at
# 22.05 kHz: 20800 samples at 16 kHz, 130 frames, 65 positions, 32 tokens.
TOKENS = [50, 32]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2_audio()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qwen2_audio_dir(model, tmp_path_factory.mktemp("qwen2-audio"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return two_rate_wavs(tmp_path_factory.mktemp("wavs"))


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


def user_turn(clips: int, question: str = QUESTION) -> list[dict]:
    content = [{"type": "audio"}] * clips + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def reference(folder, clips):
    """Qwen2AudioProcessor's inputs for one user turn with both clips."""
    return processor_inputs(folder, [clip.samples for clip in clips], user_turn(len(clips)))


@pytest.fixture(scope="module")
def prompt(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)


def test_the_prompt_is_laid_out_as_qwen2_audio_processor_does(engine, clips, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [engine.audio_tokens(clip) for clip in clips] == TOKENS
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1] == AUDIO_BOS and ids[start + count] == AUDIO_EOS
        assert ids[start : start + count] == [AUDIO] * count


def test_audio_embeddings_match_transformers(model, prompt, reference):
    expected = placed(model, reference, AUDIO)
    torch.testing.assert_close(torch.cat(prompt[1].embeds), expected, atol=1e-4, rtol=0)


def test_logits_with_audio_match_transformers(model, engine, prompt, reference):
    check_prompt_logits(model, engine, prompt, reference, chunk=40, context=256)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert greedy_ids(engine, *prompt) == expected


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(lambda x, kernel: x[..., : x.shape[-1] // kernel], id="pool-skipped"),
        pytest.param(
            lambda x, kernel, average=F.avg_pool1d: average(x, kernel, stride=1)[
                ..., : x.shape[-1] // kernel
            ],
            id="stride-1",
        ),
    ],
)
def test_a_wrong_pool_fails(model, engine, clips, reference, monkeypatch, pool):
    expected = placed(model, reference, AUDIO)
    monkeypatch.setattr(F, "avg_pool1d", pool)
    planted = torch.cat(engine.encode_audio(clips))
    assert planted.shape == expected.shape
    assert (planted - expected).abs().max() > 1e-2


def test_gguf_with_mmproj_matches_transformers(model, clips, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32 but the conv weights, which the converter keeps F16 whatever --outtype says:
    # transformers with those weights rounded the same way is the reference.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    rounded = copy.deepcopy(model)
    for conv in (rounded.model.audio_tower.conv1, rounded.model.audio_tower.conv2):
        conv.weight.data = conv.weight.data.half().float()
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    assert engine.vision is None
    ids, prompt_images = engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)
    assert ids == reference["input_ids"][0].tolist()
    expected_embeddings = placed(rounded, reference, AUDIO)
    torch.testing.assert_close(
        torch.cat(prompt_images.embeds), expected_embeddings, atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = rounded(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert greedy_ids(engine, ids, prompt_images) == greedy_tokens(rounded, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", audio=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF with an audio encoder"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_run_with_audio_replies_as_transformers(model, folder, wavs, reference):
    """`llmrun run FOLDER --audio A --audio B "prompt"`: transformers' greedy reply."""
    check_run_with_audio(folder, wavs, QUESTION, greedy_tokens(model, reference))


def test_a_clip_over_30_seconds_is_one_error_line(folder, engine, tmp_path):
    """The processor cuts a clip at 30 seconds; llmrun refuses it rather than drop audio."""
    long = tmp_path / "long.wav"
    long.write_bytes(wav_bytes(chirp(30.5, 8000, seed=3), 8000))
    result = llmrun("run", str(folder), "--audio", str(long), QUESTION)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line == (
        f"error: {long}: 30.5 seconds of audio; Qwen2-Audio takes 30 seconds a clip at most "
        "(cut it into clips)"
    )
    with pytest.raises(UsageError, match="too short for Qwen2-Audio"):
        engine.audio_tokens(audio.Clip(torch.zeros(320).numpy(), "tiny"))


def test_audio_places_must_match_the_clips(engine, clips):
    with pytest.raises(UsageError, match=r"marks 1 audio place \(<\|AUDIO\|>\) for 2 clips"):
        engine.audio_prompt("<|im_start|>user\n<|AUDIO|>two?<|im_end|>\n", clips)
    with pytest.raises(UsageError, match="not apart"):
        engine.audio_prompt("<|AUDIO|><|AUDIO|>", clips)


def test_serve_replies_to_an_input_audio_part_as_run_does(engine, wavs):
    data = wavs[0].read_bytes()
    too_long = wav_bytes(chirp(31.0, 8000, seed=3), 8000)
    service = Service("qwen2-audio", set(), None, parallel=1, queue=2)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            response = http.post("/v1/chat/completions", json=audio_body(data, QUESTION))
            refused = http.post("/v1/chat/completions", json=audio_body(too_long, QUESTION))
    finally:
        service.close()
    assert refused.status_code == 400
    param = "messages.0.content.0.input_audio.data"
    assert refused.json()["error"]["param"] == param
    assert refused.json()["error"]["message"] == (
        f"{param}: 31.0 seconds of audio; Qwen2-Audio takes 30 seconds a clip at most "
        "(cut it into clips)"
    )
    assert response.status_code == 200, response.text
    ids, prompt_images = engine.audio_prompt(
        engine.prompt_text(QUESTION, audio=1), [audio.open_audio(data)]
    )
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=prompt_images))
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_hub_config_leaving_fields_to_their_defaults_reads_as_transformers_does(tmp_path):
    """Qwen2-Audio-7B-Instruct's config.json leaves most of its text_config (and may leave
    some of its audio_config) to Qwen2Config's and Qwen2AudioConfig's defaults."""
    hub = {
        "model_type": "qwen2_audio",
        "audio_token_index": 151646,
        "audio_config": {"model_type": "qwen2_audio_encoder", "encoder_layers": 32},
        "text_config": {
            "model_type": "qwen2",
            "intermediate_size": 11008,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "vocab_size": 156032,
        },
    }
    expected = transformers.Qwen2AudioConfig(**copy.deepcopy(hub))
    text, _, name = vl_text.language_model(copy.deepcopy(hub), {}, tmp_path)
    assert name == "Qwen2-Audio"
    args = Qwen2ModelArgs.from_config(text)
    want = expected.text_config
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert getattr(args, field) == getattr(want, field), field
    assert args.rope_parameters == want.rope_parameters
    encoder = encoder_args(hub, tmp_path)
    heard = expected.audio_config
    assert (
        encoder.hidden_size,
        encoder.intermediate_size,
        encoder.num_hidden_layers,
        encoder.num_attention_heads,
        encoder.num_mel_bins,
        encoder.max_source_positions,
        encoder.text_hidden_size,
    ) == (
        heard.d_model,
        heard.encoder_ffn_dim,
        heard.encoder_layers,
        heard.encoder_attention_heads,
        heard.num_mel_bins,
        heard.max_source_positions,
        want.hidden_size,
    )

"""A tiny random Voxtral (VoxtralForConditionalGeneration: a Whisper encoder, Voxtral's
projector, a Llama) for the audio tests: as a Hugging Face folder (stories260K's tokenizer
plus Mistral's instruction and audio tokens, a chat template that writes an audio part as
mistral_common does: [BEGIN_AUDIO]), and as llama.cpp's converter writes it, a text GGUF
plus an mmproj GGUF (conversion/ultravox.py VoxtralWhisperEncoderModel); a tekken.json with
Voxtral's special tokens and audio settings, as mistral_common reads Voxtral's; and
synthetic audio written as WAV files."""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens (Voxtral's own are [AUDIO] 24, [BEGIN_AUDIO] 25).
VOXTRAL_TOKENS = ("[INST]", "[/INST]", "[AUDIO]", "[BEGIN_AUDIO]")
AUDIO, BEGIN_AUDIO = 514, 515
VOCAB = 516
# mistral_common's user turn: each audio part "[BEGIN_AUDIO]" (its [AUDIO] tokens follow),
# then the text, in the order given.
VOXTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}
                    {{- block['text'] }}
                {%- elif block['type'] in ['audio', 'input_audio'] %}
                    {{- '[BEGIN_AUDIO]' }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""


def tiny_voxtral(
    seed: int = 0, audio_layers: int = 2, vocab_size: int = VOCAB, audio_token: int = AUDIO
):
    """A random transformers VoxtralForConditionalGeneration: text hidden 64 (two layers),
    a Whisper encoder of width 32 (`audio_layers` layers, 128 mel bins, 1500 positions)
    whose intermediate_size is 4x its width, as Voxtral's (the projector takes 4 frames a
    row)."""
    import transformers

    text = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=vocab_size,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    audio = dict(
        model_type="voxtral_encoder",
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=audio_layers,
        num_attention_heads=2,
        num_mel_bins=128,
        max_source_positions=1500,
    )
    config = transformers.VoxtralConfig(
        text_config=text, audio_config=audio, audio_token_id=audio_token
    )
    torch.manual_seed(seed)
    model = transformers.VoxtralForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_voxtral_dir(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with the tokenizer files."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(VOXTRAL_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": VOXTRAL_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


# Voxtral's tekken.json: Mistral's special tokens ([AUDIO] 24, [BEGIN_AUDIO] 25, [TRANSCRIBE]
# 34 among them), then plain tokens; TEKKEN_RANKS of Mistral Nemo's ranks keep it small.
TEKKEN_AUDIO, TEKKEN_SPECIALS, TEKKEN_RANKS = 24, 40, 1000
TEKKEN_VOCAB = TEKKEN_SPECIALS + TEKKEN_RANKS


def write_voxtral_tekken(path: Path) -> Path:
    """A tekken.json in `path` as Voxtral's (version v7, its special tokens, its `audio`
    settings: 16 kHz, 12.5 tokens a second, 128 mel bins, 30-second chunks, instruct
    transcription), with Mistral Nemo's first TEKKEN_RANKS ranks, which mistral_common ships."""
    import mistral_common

    from llmrun import tekken

    nemo = json.loads(
        (Path(mistral_common.__file__).parent / "data" / "tekken_240718.json").read_text()
    )
    names = dict(enumerate(tekken.DEFAULT_SPECIALS))
    names.update({TEKKEN_AUDIO: "[AUDIO]", TEKKEN_AUDIO + 1: "[BEGIN_AUDIO]", 34: "[TRANSCRIBE]"})
    data = {
        "config": {
            **nemo["config"],
            "num_vocab_tokens": TEKKEN_RANKS,
            "default_vocab_size": TEKKEN_VOCAB,
            "default_num_special_tokens": TEKKEN_SPECIALS,
            "version": "v7",
        },
        "vocab": nemo["vocab"][:TEKKEN_RANKS],
        "special_tokens": [
            {"rank": i, "token_str": names.get(i, f"<SPECIAL_{i}>"), "is_control": True}
            for i in range(TEKKEN_SPECIALS)
        ],
        "audio": {
            "sampling_rate": 16000,
            "frame_rate": 12.5,
            "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
            "chunk_length_s": 30.0,
            "transcription_format": "instruct",
        },
    }
    (path / "tekken.json").write_text(json.dumps(data), encoding="utf-8")
    return path


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes Voxtral's (arch llama, q/k
    permuted; F32) with stories260K's vocabulary plus VOXTRAL_TOKENS as control tokens."""
    config = model.config.text_config.to_dict()
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith((prefix, "lm_head."))
    }

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *VOXTRAL_TOKENS])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(VOXTRAL_TOKENS)])
        control = [gguf.TokenType.CONTROL] * len(VOXTRAL_TOKENS)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(VOXTRAL_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


# HF names after audio_tower. / multi_modal_projector. -> the mmproj's (gguf-py's
# tensor_mapping for MODEL_ARCH.MMPROJ).
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "self_attn_layer_norm": "ln1",
    "final_layer_norm": "ln2",
    "fc1": "ffn_up",
    "fc2": "ffn_down",
}
_NAMES = {
    "audio_tower.conv1": "a.conv1d.1",
    "audio_tower.conv2": "a.conv1d.2",
    "audio_tower.embed_positions": "a.position_embd",
    "audio_tower.layer_norm": "a.post_ln",
    "multi_modal_projector.linear_1": "mm.a.mlp.1",
    "multi_modal_projector.linear_2": "mm.a.mlp.2",
}


def mmproj_name(hf_name: str) -> str:
    """An audio tensor's name in the mmproj (model.audio_tower.* as audio_tower.*)."""
    name = hf_name.removeprefix("model.")
    module, suffix = name.rsplit(".", 1)
    if module in _NAMES:
        return f"{_NAMES[module]}.{suffix}"
    parts = module.split(".", 3)  # audio_tower, layers, N, rest
    return f"a.blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{suffix}"


def write_mmproj(model, path: Path, f16: bool = True) -> Path:
    """The audio tower and projector as llama.cpp's converter writes an mmproj GGUF from
    the folder (checked against it in benchmarks/llama_cpp_voxtral.py): clip.audio.*
    metadata with projector type voxtral and stack factor 4, the 2-D and 3-D weights F16 but
    the positions', the rest F32, the conv biases as [channels, 1]; without `f16`, as
    its --outtype f32 writes it: F32 but the conv weights, which it keeps F16."""
    audio = model.config.audio_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.VOXTRAL)
    key = gguf.Keys.ClipAudio
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.EMBEDDING_LENGTH, audio.hidden_size),
        (key.FEED_FORWARD_LENGTH, audio.intermediate_size),
        (key.BLOCK_COUNT, audio.num_hidden_layers),
        (key.Attention.HEAD_COUNT, audio.num_attention_heads),
        (key.NUM_MEL_BINS, audio.num_mel_bins),
        (key.Projector.STACK_FACTOR, 4),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-5)
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.audio_tower.", "model.multi_modal_projector.")):
            continue
        array = tensor.float().numpy()
        if name.endswith(("conv1.bias", "conv2.bias")):
            array = array[:, None]
        matrix = name.endswith(".weight") and array.ndim >= 2 and "embed_positions" not in name
        if matrix and (f16 or ".conv" in name):
            array = array.astype(np.float16)
        writer.add_tensor(mmproj_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def chirp(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A rising tone under seeded noise, in [-1, 1] (float64)."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    tone = 0.5 * np.sin(2 * np.pi * (200 * t + 400 * t**2))
    return np.clip(tone + 0.1 * rng.standard_normal(t.shape), -1, 1)


def wav_bytes(samples: np.ndarray, rate: int, width: int = 2) -> bytes:
    """A WAV file of float samples [frames] or [frames, channels] in [-1, 1] as PCM ints
    of `width` bytes (1: unsigned 8-bit)."""
    frames = samples if samples.ndim == 2 else samples[:, None]
    if width == 1:
        data = np.round(frames * 127 + 128).astype(np.uint8).tobytes()
    else:
        scale = 2 ** (8 * width - 1) - 1
        ints = np.round(frames * scale).astype(np.int64)
        if width == 3:
            data = (ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3]).tobytes()
        else:
            data = ints.astype(f"<i{width}").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data)
    return out.getvalue()

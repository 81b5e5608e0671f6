"""A tiny random Qwen2-Audio (Qwen2AudioForConditionalGeneration: a Whisper encoder with
an average pool, a linear projector, a Qwen2) for the audio tests: as a Hugging Face
folder (stories260K's tokenizer plus Qwen's chat and audio tokens, Qwen2AudioProcessor's
chat template), as llama.cpp's converter writes it (a text GGUF of arch qwen2 plus an
mmproj GGUF of projector type qwen2a; benchmarks/llama_cpp_qwen2_audio.py checks that
layout against the converter), and transformers' Qwen2AudioProcessor inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf
from voxtral_helpers import mmproj_name

# Ids 512 on, after stories260K's 512 tokens.
QWEN2_AUDIO_TOKENS = ("<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
IM_START, IM_END, AUDIO, AUDIO_BOS, AUDIO_EOS = range(512, 517)
VOCAB = 520
# Qwen2AudioProcessor's chat template (its default_chat_template, which the Hub's
# Qwen2-Audio-7B-Instruct has too).
QWEN2_AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or message['type'] == 'audio' "
    "or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)


def tiny_qwen2_audio(seed: int = 0, audio_layers: int = 2):
    """A random transformers Qwen2AudioForConditionalGeneration: a Qwen2 of hidden 64 in two
    layers, a Whisper encoder of width 32 in `audio_layers` layers (128 mel bins, 1500
    positions)."""
    import transformers

    text = dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    audio = dict(
        model_type="qwen2_audio_encoder",
        d_model=32,
        encoder_ffn_dim=64,
        encoder_layers=audio_layers,
        encoder_attention_heads=2,
        num_mel_bins=128,
        max_source_positions=1500,
    )
    config = transformers.Qwen2AudioConfig(
        text_config=text, audio_config=audio, audio_token_index=AUDIO
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_qwen2_audio_dir(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with the tokenizer files and the
    feature extractor's settings (Qwen2-Audio's: 128 mel bins)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(QWEN2_AUDIO_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": QWEN2_AUDIO_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    extractor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "padding_value": 0.0,
        "return_attention_mask": True,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(extractor))
    return path


def processor_inputs(folder: Path, clips: list[np.ndarray], messages: list[dict]):
    """Qwen2AudioProcessor's inputs (input_ids, attention_mask, input_features,
    feature_attention_mask) for `messages` (their audio parts take `clips`, 16 kHz float
    samples, in order), with the generation prompt."""
    import transformers

    processor = transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=QWEN2_AUDIO_TEMPLATE,
    )
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(
        text=text, audio=clips, sampling_rate=16000, return_tensors="pt", add_special_tokens=False
    )


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes Qwen2-Audio's (conversion/qwen.py
    Qwen2Model: arch qwen2), F32, with stories260K's vocabulary plus QWEN2_AUDIO_TOKENS as
    control tokens and the chat template."""
    config = model.config.text_config.to_dict()
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith(prefix) or k == "lm_head.weight"
    }
    padding = VOCAB - 512 - len(QWEN2_AUDIO_TOKENS)
    added = [*QWEN2_AUDIO_TOKENS, *(f"<pad{i}>" for i in range(padding))]

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *added])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(added)])
        control = [gguf.TokenType.CONTROL] * len(added)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(QWEN2_AUDIO_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


def write_mmproj(model, path: Path) -> Path:
    """The audio tower and projector as llama.cpp's converter writes an mmproj GGUF from the
    folder with --outtype f32: clip.audio.* metadata with projector type qwen2a, F32 but the
    conv weights, which it keeps F16, the conv biases as [channels, 1], the projector as
    mm.a.fc."""
    audio = model.config.audio_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN2A)
    key = gguf.Keys.ClipAudio
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.EMBEDDING_LENGTH, audio.d_model),
        (key.FEED_FORWARD_LENGTH, audio.encoder_ffn_dim),
        (key.BLOCK_COUNT, audio.encoder_layers),
        (key.Attention.HEAD_COUNT, audio.encoder_attention_heads),
        (key.NUM_MEL_BINS, audio.num_mel_bins),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-5)
    for name, tensor in model.state_dict().items():
        if name.startswith("model.multi_modal_projector.linear."):
            writer.add_tensor("mm.a.fc." + name.rsplit(".", 1)[1], tensor.float().numpy())
            continue
        if not name.startswith("model.audio_tower."):
            continue
        array = tensor.float().numpy()
        if name.endswith(("conv1.bias", "conv2.bias")):
            array = array[:, None]
        if name.endswith(("conv1.weight", "conv2.weight")):
            array = array.astype(np.float16)
        writer.add_tensor(mmproj_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

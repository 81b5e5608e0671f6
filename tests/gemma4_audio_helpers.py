"""A tiny random Gemma 4 with its vision and audio towers (Gemma4ForConditionalGeneration,
gemma4_vision_helpers' model plus a 2-layer conformer) for the audio tests: its
Gemma4Processor inputs for clips, and the mmproj GGUF that llama.cpp's converter writes
for it (conversion/gemma.py Gemma4VisionAudioModel: the image encoder as
gemma4_vision_helpers writes it, and the audio encoder's clip.audio.* keys and a.* /
mm.a.* tensors: softplus(per_dim_scale), the depthwise kernel as [channels, kernel], the
clipping bounds as 1-element tensors; benchmarks/llama_cpp_gemma4_audio.py checks this
layout against the converter's own file)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gemma4_vision_helpers import processor, tiny_gemma4_vl, write_mmproj

AUDIO_BEGIN, AUDIO, AUDIO_END = 517, 518, 519  # <|audio>, <|audio|>, <audio|>
# Width 32 in 2 heads, 2 layers; the subsampling's first convolution has 128 channels
# because transformers sizes its projection for 128 mel bins cut by four; an output
# projection to 48 (not the width, nor the text's 64).
AUDIO_CONFIG = dict(
    model_type="gemma4_audio",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    subsampling_conv_channels=[128, 8],
    conv_kernel_size=5,
    output_proj_dims=48,
)


def tiny_gemma4_audio(seed: int = 0):
    """gemma4_vision_helpers' tiny Gemma 4 with an audio tower (AUDIO_CONFIG) whose norms
    are near 1 (they scale by w, not 1 + w) and whose clipping bounds cut the largest
    values only."""
    model = tiny_gemma4_vl(seed, audio=AUDIO_CONFIG)
    with torch.no_grad():
        for name, p in model.model.audio_tower.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
        for name, buffer in model.model.audio_tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-4.0)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(4.0)
    return model


def processor_inputs(folder: Path, clips: list[np.ndarray], question: str):
    """Gemma4Processor's inputs (input_ids, input_features, input_features_mask,
    mm_token_type_ids) for one user message of `clips` (16 kHz float samples) then
    `question`, with the generation prompt."""
    proc = processor(folder)
    content = [{"type": "audio"}] * len(clips) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes BOS already.
    return proc(text=text, audio=clips, return_tensors="pt", add_special_tokens=False)


def _audio_name(name: str) -> str | None:
    """The converter's GGUF name of an audio tensor (conversion/gemma.py's renames, then
    gguf-py's map), None for another."""
    if not name.startswith(("model.audio_tower.", "model.embed_audio.")):
        return None
    name = name.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
    if name.endswith("per_dim_scale"):
        name += ".weight"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, AUDIO_CONFIG["num_hidden_layers"])
    suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
    return names.get_name(name, try_suffixes=suffixes)


def write_audio_mmproj(model, path: Path) -> Path:
    """The image and audio encoders in one mmproj GGUF (F32), as the converter writes
    E2B's and E4B's with --outtype f32."""
    config = model.config.audio_config

    def audio(writer) -> None:
        writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
        writer.add_string(gguf.Keys.ClipAudio.PROJECTOR_TYPE, gguf.VisionProjectorType.GEMMA4A)
        key = gguf.Keys.ClipAudio
        writer.add_uint32(key.PROJECTION_DIM, model.config.text_config.hidden_size)
        writer.add_uint32(key.EMBEDDING_LENGTH, config.hidden_size)
        writer.add_uint32(key.FEED_FORWARD_LENGTH, config.hidden_size * 4)
        writer.add_uint32(key.BLOCK_COUNT, config.num_hidden_layers)
        writer.add_uint32(key.Attention.HEAD_COUNT, config.num_attention_heads)
        writer.add_uint32(key.NUM_MEL_BINS, 128)
        writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
        for name, tensor in model.state_dict().items():
            gguf_name = _audio_name(name)
            if gguf_name is None:
                continue
            data = tensor.detach().float()
            if data.dim() == 0:
                data = data[None]
            if name.endswith("per_dim_scale"):
                data = torch.nn.functional.softplus(data)
            if "depthwise_conv1d" in name:
                data = data.reshape(data.shape[0], data.shape[2])
            writer.add_tensor(gguf_name, np.ascontiguousarray(data.numpy()))

    return write_mmproj(model, path, extra=audio)

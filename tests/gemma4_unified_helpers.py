"""A tiny random Gemma 4 Unified (Gemma4UnifiedForConditionalGeneration: Gemma 4's
language model without per-layer inputs or experts, an encoder-free image embedder and a
raw-waveform audio embedder) for the Gemma 4 Unified tests: as a Hugging Face folder
(gemma4_vision_helpers' tokenizer and chat template, the image processor's and feature
extractor's settings), the reference inputs transformers makes for it, and as llama.cpp's
converter writes it (conversion/gemma.py Gemma4UnifiedModel: a gemma4 text GGUF, as
gemma4_vision_helpers writes Gemma 4's; Gemma4UnifiedVisionAudioModel: an mmproj of
projector types gemma4uv and gemma4ua, the patch norm and projection's columns in
channel-major order, the position table as [2, positions, width], the LayerNorms as
v.patch_norm.1, .2, .3;
benchmarks/llama_cpp_gemma4_unified.py checks this layout against the converter's own
files).

transformers' Gemma4UnifiedImageProcessor needs torchvision, which the tests do without:
its pixels are Gemma4ImageProcessorPil's 4-pixel patches (the same resize) merged by the
unified processor's own patches_merge, read from its source.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from unittest.mock import patch

import gguf
import numpy as np
import torch
from gemma4_vision_helpers import (
    BOI,
    EOI,
    IMAGE,
    VOCAB,
    image_processor,
    save_gemma4_vl_dir,
)
from helpers import randomize

from llmrun.loading.gemma4_unified import AUDIO_PROJECTOR, VISION_PROJECTOR

PATCH, POOL, MAX_SOFT_TOKENS = 4, 3, 70  # as gemma4_vision_helpers': 12-pixel model patches
SAMPLES = 640  # per audio token: llama.cpp's gemma4ua takes no other
AUDIO_BEGIN, AUDIO, AUDIO_END = 517, 518, 519  # <|audio>, <|audio|>, <audio|>
S, F = "sliding_attention", "full_attention"
WINDOW = 8


def tiny_gemma4_unified(seed: int = 0):
    """A random transformers Gemma4UnifiedForConditionalGeneration: text hidden 64 (a
    sliding layer of window 8, then a global one with its own head width; soft-capped
    logits), image patches of 12 pixels embedded 64 wide with a table of 280 positions (an mmproj's images take up to 280 tokens),
    audio frames of 640 samples."""
    import transformers

    text = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        layer_types=[S, F],
        sliding_window=WINDOW,
        vocab_size=VOCAB,
        final_logit_softcapping=10.0,
        max_position_embeddings=512,
        rope_parameters={
            F: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=10000.0),
            S: dict(rope_type="default", rope_theta=1000.0),
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    # The embedder's width is the text's: its projection takes output_proj_dims features.
    vision = dict(patch_size=PATCH, pooling_kernel_size=POOL, mm_embed_dim=64,
                  mm_posemb_size=280, output_proj_dims=64)  # fmt: skip
    config = transformers.Gemma4UnifiedConfig(
        text_config=text,
        vision_config=vision,
        audio_config=dict(audio_embed_dim=SAMPLES),
        boi_token_id=BOI,
        eoi_token_id=EOI,
        image_token_id=IMAGE,
        video_token_id=VOCAB,  # none: past the vocabulary
        audio_token_id=AUDIO,
        boa_token_id=AUDIO_BEGIN,
        eoa_token_index=AUDIO_END,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4UnifiedForConditionalGeneration(config).eval()
    # As gemma4_vision_helpers' (its notes say why), the position table at a fifth, the
    # final norm at 8 times (the logits of small tied embeddings would span ±0.7).
    scales = {"q_norm.weight": 0.5, "k_norm.weight": 0.5, "embed_tokens.weight": 0.1,
              "pos_embedding": 0.2, "language_model.norm.weight": 8.0}  # fmt: skip
    randomize(model, scales)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.layer_scalar.fill_(0.7)
    return model


def save_gemma4_unified_dir(model, path: Path) -> Path:
    """The model's folder (gemma4_vision_helpers' tokenizer files), with the image
    processor's and the feature extractor's settings as the Hub's folder has them."""
    save_gemma4_vl_dir(model, path)
    settings = image_processor().to_dict()
    settings["image_processor_type"] = "Gemma4UnifiedImageProcessor"
    settings["feature_extractor_type"] = "Gemma4UnifiedAudioFeatureExtractor"
    settings.update(feature_size=SAMPLES, audio_samples_per_token=SAMPLES, sampling_rate=16000)
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path


def patches_merge():
    """transformers' patches_merge (image_processing_gemma4_unified.py), taken from its
    source: the module imports torchvision at the top."""
    from transformers.models.gemma4 import modeling_gemma4

    source = Path(modeling_gemma4.__file__).parents[1] / "gemma4_unified"
    tree = ast.parse((source / "image_processing_gemma4_unified.py").read_text())
    node = next(n for n in tree.body if getattr(n, "name", None) == "patches_merge")
    namespace = {"math": math, "torch": torch}
    exec(compile(ast.Module([node], []), "patches_merge", "exec"), namespace)
    return namespace["patches_merge"]


def unified_pixels(images: list, tokens: int = MAX_SOFT_TOKENS) -> dict[str, torch.Tensor]:
    """Gemma4UnifiedImageProcessor's pixel_values [images, tokens, 12 * 12 * 3] and
    image_position_ids [images, tokens, 2] (padding: zeros at (-1, -1)): the Gemma 4
    processor's resized 4-pixel patches, merged 3x3 by patches_merge."""
    merge = patches_merge()
    out = image_processor(tokens)(images, return_tensors="pt")
    pixels, positions = [], []
    for patches, where in zip(out["pixel_values"], out["image_position_ids"], strict=True):
        real = (where >= 0).all(-1)
        count = int(real.sum()) // POOL**2
        merged, at = merge(patches[real][None], where[real][None], count)
        pad = tokens - count
        pixels.append(torch.cat([merged[0], merged.new_zeros(pad, merged.shape[-1])]))
        positions.append(torch.cat([at[0], at.new_full((pad, 2), -1)]))
    return {"pixel_values": torch.stack(pixels), "image_position_ids": torch.stack(positions)}


def processor(folder: Path, tokens: int = MAX_SOFT_TOKENS):
    """transformers' Gemma4UnifiedProcessor of the folder: its feature extractor, the
    Gemma 4 PIL image processor for the token counts (the unified one needs torchvision;
    its pixels come from unified_pixels)."""
    import transformers
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {
        "boi_token": "<|image>",
        "image_token": "<|image|>",
        "eoi_token": "<image|>",
        "boa_token": "<|audio>",
        "audio_token": "<|audio|>",
        "eoa_token": "<audio|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None):  # fmt: skip
        return transformers.Gemma4UnifiedProcessor(
            feature_extractor=Gemma4UnifiedAudioFeatureExtractor(),
            image_processor=image_processor(tokens),
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            video_processor=None,
            chat_template=config["chat_template"],
        )


def processor_inputs(
    folder: Path, question: str, images=(), clips=(), tokens: int = MAX_SOFT_TOKENS
):
    """Gemma4UnifiedProcessor's inputs for one user message of `images`, then `clips`
    (16 kHz float samples), then `question`, with the generation prompt; the pixels
    replaced by unified_pixels'; `tokens`: the soft-token budget of an image."""
    proc = processor(folder, tokens)
    content = [{"type": "image"}] * len(images) + [{"type": "audio"}] * len(clips)
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    media = {"images": list(images)} if images else {}
    if clips:
        media["audio"] = list(clips)
    # The template writes BOS already.
    inputs = proc(text=text, return_tensors="pt", add_special_tokens=False, **media)
    if images:
        inputs.update(unified_pixels(list(images), tokens))
    return inputs


def _channel_major(p: int) -> torch.Tensor:
    """The converter's column order for a p x p patch: channel, row, column."""
    i = torch.arange(p * p * 3)
    channel, row, column = i // (p * p), (i % (p * p)) // p, i % p
    return row * p * 3 + column * 3 + channel


def write_mmproj(model, path: Path, vision: bool = True, audio: bool = True) -> Path:
    """The embedders as conversion/gemma.py Gemma4UnifiedVisionAudioModel writes an
    mmproj GGUF with --outtype f32: clip.* metadata (the tower-less block counts 0),
    gguf's mmproj tensor names, the patch norm and projection in the channel-major
    order of ggml's im2col, the position table [2, positions, width], the three
    LayerNorms as v.patch_norm.1, .2, .3."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if vision:
        v = config.vision_config
        key = gguf.Keys.ClipVision
        writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
        writer.add_string(key.PROJECTOR_TYPE, VISION_PROJECTOR)
        for name, value in ((key.IMAGE_SIZE, 224), (key.PATCH_SIZE, v.patch_size),
                            (key.EMBEDDING_LENGTH, v.mm_embed_dim), (key.FEED_FORWARD_LENGTH, 0),
                            (key.BLOCK_COUNT, 0), (key.Attention.HEAD_COUNT, 0),
                            (key.PROJECTION_DIM, config.text_config.hidden_size)):  # fmt: skip
            writer.add_uint32(name, value)
        writer.add_float32(key.Attention.LAYERNORM_EPS, v.rms_norm_eps)
        writer.add_array(key.IMAGE_MEAN, [0.0, 0.0, 0.0])
        writer.add_array(key.IMAGE_STD, [1.0, 1.0, 1.0])
        order = _channel_major(v.patch_size * v.pooling_kernel_size)
        prefix = "model.embed_vision."
        tensors = {
            "v.patch_norm.1.weight": state[prefix + "patch_ln1.weight"][order],
            "v.patch_norm.1.bias": state[prefix + "patch_ln1.bias"][order],
            "v.patch_embd.weight": state[prefix + "patch_dense.weight"][:, order],
            "v.patch_embd.bias": state[prefix + "patch_dense.bias"],
            "v.patch_norm.2.weight": state[prefix + "patch_ln2.weight"],
            "v.patch_norm.2.bias": state[prefix + "patch_ln2.bias"],
            "v.patch_norm.3.weight": state[prefix + "pos_norm.weight"],
            "v.patch_norm.3.bias": state[prefix + "pos_norm.bias"],
            "v.position_embd.weight": state[prefix + "pos_embedding"].permute(1, 0, 2),
            "mm.input_projection.weight": state[
                prefix + "multimodal_embedder.embedding_projection.weight"
            ],
        }
        for name, tensor in tensors.items():
            writer.add_tensor(name, np.ascontiguousarray(tensor.numpy()))
    if audio:
        key = gguf.Keys.ClipAudio
        writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
        writer.add_string(key.PROJECTOR_TYPE, AUDIO_PROJECTOR)
        for name, value in ((key.NUM_MEL_BINS, 128),  # the converter's; llama.cpp takes 640
                            (key.EMBEDDING_LENGTH, config.audio_config.audio_embed_dim),
                            (key.FEED_FORWARD_LENGTH, 0), (key.BLOCK_COUNT, 0),
                            (key.Attention.HEAD_COUNT, 0),
                            (key.PROJECTION_DIM, config.text_config.hidden_size)):  # fmt: skip
            writer.add_uint32(name, value)
        writer.add_float32(key.Attention.LAYERNORM_EPS, config.audio_config.rms_norm_eps)
        weight = state["model.embed_audio.embedding_projection.weight"]
        writer.add_tensor("mm.a.input_projection.weight", np.ascontiguousarray(weight.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

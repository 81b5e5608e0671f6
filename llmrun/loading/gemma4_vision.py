"""Gemma 4's image encoder from either format: its Hugging Face folder
(Gemma4ForConditionalGeneration: model.vision_tower.*, model.embed_vision.*; its audio
tower is loading.gemma4_audio's), or the mmproj GGUF that llama.cpp's converter writes beside the text
model's GGUF (conversion/gemma.py Gemma4VisionAudioModel: projector type gemma4v, the
patch projection stored as a [hidden, 3, patch, patch] convolution, each clipped linear's
bounds as 1-element tensors beside its weight, gguf-py's mmproj tensor names). Both give
the encoder HF's weights.

How many soft tokens an image may take is the image processor's max_soft_tokens
(preprocessor_config.json, or processor_config.json's "image_processor"; transformers'
default, 280, for an mmproj, which holds none:
llama.cpp itself allows up to 1120), its patch and pooling sizes the encoder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.vision import encoder_tensor, image_processor, projector_type, with_weights
from llmrun.models import gemma4_vision

MODEL_TYPE = "gemma4"
# Gemma4ImageProcessor's soft-token budgets, and its default.
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
DEFAULT_SOFT_TOKENS = 280
BICUBIC = 3  # PIL's filter number, as the processor's "resample" names it
# clip.cpp's pooling side where an mmproj names none (hparams.n_merge of gemma4v).
GGUF_POOL = 3
# Checkpoint key prefixes of the vision parts -> the encoder's.
_HF_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "model.embed_vision.": "embed_vision.",
}
# The GGUF names of a layer's tensors (gguf-py's tensor_mapping) -> Gemma 4's.
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj.linear",
    "attn_k": "self_attn.k_proj.linear",
    "attn_v": "self_attn.v_proj.linear",
    "attn_out": "self_attn.o_proj.linear",
    "ffn_gate": "mlp.gate_proj.linear",
    "ffn_up": "mlp.up_proj.linear",
    "ffn_down": "mlp.down_proj.linear",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ln1": "input_layernorm",
    "attn_post_norm": "post_attention_layernorm",
    "ln2": "pre_feedforward_layernorm",
    "ffn_post_norm": "post_feedforward_layernorm",
}
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
_PATCH = "v.patch_embd.weight"
_GGUF_NAMES = {
    _PATCH: "vision_tower.patch_embedder.input_proj.weight",
    "v.position_embd.weight": "vision_tower.patch_embedder.position_embedding_table",
    "v.std_bias": "vision_tower.std_bias",
    "v.std_scale": "vision_tower.std_scale",
    "mm.input_projection.weight": "embed_vision.embedding_projection.weight",
}
# E2B's and E4B's mmproj files hold the audio encoder too (gemma4a: loading.gemma4_audio).
_AUDIO = ("a.", "mm.a.")


@dataclass
class Gemma4Vision:
    """A loaded Gemma 4 image encoder and the image processor's token budget."""

    encoder: gemma4_vision.ImageEncoder
    max_soft_tokens: int

    @property
    def patch_size(self) -> int:
        return self.encoder.args.vision.patch_size

    @property
    def pool(self) -> int:
        return self.encoder.args.vision.pooling_kernel_size


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Gemma 4 with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    return has_vision(safetensors_io.read_config(path))


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Gemma 4's."""
    return projector_type(path) == VisionProjectorType.GEMMA4V


def from_hf_dir(path: Path, text_hidden: int) -> Gemma4Vision:
    """Gemma 4's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Gemma 4 with a vision_config")
    text = config.get("text_config")
    if not isinstance(text, dict) or not isinstance(text.get("hidden_size"), int):
        raise ModelFormatError(f"{path}: a Gemma 4 config.json without text_config.hidden_size")
    args = gemma4_vision.EncoderArgs(
        gemma4_vision.VisionArgs.from_config(config["vision_config"]), text["hidden_size"]
    )
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            prefix = next((p for p in _HF_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                weights[_HF_PREFIXES[prefix] + name[len(prefix) :]] = tensor
    tokens = max_soft_tokens(path, args.vision)
    return _build(args, weights, text_hidden, path, tokens)


def max_soft_tokens(path: Path, args: gemma4_vision.VisionArgs) -> int:
    """The image processor's max_soft_tokens (default 280), its patch and pooling sizes
    checked against the encoder's (`args`': any with Gemma 4's two fields), its resizing
    and scaling Gemma 4's."""
    file, processor = image_processor(path)
    tokens = processor.get("max_soft_tokens", DEFAULT_SOFT_TOKENS)
    if tokens not in SOFT_TOKEN_BUDGETS:
        raise ModelFormatError(
            f"{file}: max_soft_tokens {tokens!r}; Gemma 4 takes one of {SOFT_TOKEN_BUDGETS}"
        )
    for key, own in (("patch_size", args.patch_size),
                     ("pooling_kernel_size", args.pooling_kernel_size)):  # fmt: skip
        if processor.get(key, own) != own:
            raise ModelFormatError(
                f"{file}: {key} {processor[key]!r}, but the vision tower's is {own}"
            )
    plain = processor.get("do_rescale", True) and processor.get("resample", BICUBIC) == BICUBIC
    if processor.get("do_normalize") or not plain:
        raise UnsupportedError(
            f"{file}: pixels normalized by a mean and std, not scaled to [0, 1] or not "
            "resized bicubically; llmrun prepares Gemma 4's images as its processor does "
            "by default"
        )
    return tokens


def from_mmproj(path: str | Path, text_hidden: int) -> Gemma4Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type gemma4v)."""
    gg = gguf_io.read_gguf(path)
    meta = gg.metadata
    kind = meta.get(Keys.Clip.PROJECTOR_TYPE, meta.get(Keys.ClipVision.PROJECTOR_TYPE))
    if kind is None or not meta.get(Keys.Clip.HAS_VISION_ENCODER, False):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with a vision encoder")
    if kind != VisionProjectorType.GEMMA4V:
        raise UnsupportedError(
            f"{gg.path}: projector type {kind!r}; expected {VisionProjectorType.GEMMA4V!r}"
        )

    def need(key: str) -> Any:
        value = meta.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    vision = Keys.ClipVision
    hidden, heads = need(vision.EMBEDDING_LENGTH), need(vision.Attention.HEAD_COUNT)
    pool = meta.get(vision.Projector.SCALE_FACTOR, GGUF_POOL)
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1:
        raise ModelFormatError(f"{gg.path}: projector scale factor {pool!r}")
    table = gg.tensors.get("v.position_embd.weight")
    if table is None or len(table.shape) != 3 or table.shape[0] != 2:
        raise ModelFormatError(f"{gg.path}: no [2, positions, hidden] v.position_embd.weight")
    names = {info.name for info in gg.tensors.values() if not info.name.startswith(_AUDIO)}
    args = gemma4_vision.VisionArgs(
        hidden_size=hidden,
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,  # clip.cpp's d_head
        rms_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        patch_size=need(vision.PATCH_SIZE),
        pooling_kernel_size=pool,
        position_embedding_size=int(table.shape[1]),
        use_clipped_linears=any(n.endswith(".input_max") for n in names),
        standardize="v.std_bias" in names,
    )
    weights = {}
    for info in gg.tensors.values():
        if info.name.startswith(_AUDIO):
            continue
        name = _gguf_name(info.name)
        if name is None:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r} is not part of Gemma 4's image encoder"
            )
        tensor = encoder_tensor(gg, info)
        if name.endswith(_BOUNDS):
            if tensor.numel() != 1:
                raise ModelFormatError(f"{gg.path}: {info.name} is not one number")
            tensor = tensor.reshape(())
        if info.name == _PATCH:
            if tensor.dim() != 4:
                raise ModelFormatError(f"{gg.path}: {_PATCH} is not a 4-D convolution")
            # [hidden, 3, patch, patch] -> HF's [hidden, patch * patch * 3] (row, column, channel)
            tensor = tensor.permute(0, 2, 3, 1).reshape(tensor.shape[0], -1)
        weights[name] = tensor
    projection = weights.get(_GGUF_NAMES["mm.input_projection.weight"])
    if projection is None or projection.dim() != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D mm.input_projection.weight")
    # [text hidden, vision hidden]: the width it projects to.
    encoder_args = gemma4_vision.EncoderArgs(args, projection.shape[0])
    return _build(encoder_args, weights, text_hidden, gg.path, DEFAULT_SOFT_TOKENS)


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit():
        module = _GGUF_LAYER.get(parts[3])
        suffix = parts[4]
        if module is None or suffix not in ("weight", *_BOUNDS):
            return None
        if suffix in _BOUNDS:
            if not module.endswith(".linear"):
                return None
            module = module.removesuffix(".linear")  # the bounds sit beside the linear
        return f"vision_tower.encoder.layers.{parts[2]}.{module}.{suffix}"
    return None


def _build(
    args: gemma4_vision.EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    tokens: int,
) -> Gemma4Vision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(
        gemma4_vision.ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return Gemma4Vision(encoder, tokens)

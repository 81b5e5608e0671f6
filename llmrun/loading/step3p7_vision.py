"""Step 3.7's image encoder (a ViT with a 2-D RoPE, two downsampling convolutions and a
projector) from its Hugging Face folder (Step3p7ForConditionalGeneration) or llama.cpp's
mmproj GGUF, with the image processor's settings (preprocessor_config.json: the global view's size, the local crops'
size, the largest side kept). The language model (Step 3.5) loads as for text
(llmrun.loading.vl_text).

The folder holds StepFun's own names, which transformers' save_pretrained writes too
(conversion_mapping.py "step3p5_vision"): vision_model.conv1, positional_embedding,
ln_pre, transformer.resblocks.N.{attn.in_proj_*, attn.out_proj, ln_1, ln_2, ls_1.gamma,
ls_2.gamma, mlp.c_fc, mlp.c_proj}, vit_downsampler1/2 and vit_large_projector. Each fused
in_proj is split into q, k and v, and the q and k rows of each head reordered from
adjacent RoPE pairs to halves (PermuteForRope), as transformers loads them; transformers
5's own names (model.vision_model., model.multi_modal_projector.) are read as they are.

llama.cpp's mmproj GGUFs (projector type step3vl: conversion/step3.py Step3VLVisionModel,
which keeps StepFun's fused in_proj as v.blk.N.attn_qkv) are read under StepFun's names
and then as the folder's. An mmproj holds no crop size: mtmd's (504, Step3p7ImageProcessor's
default too) is taken, the global view its image_size, the largest side its
preproc_image_size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import CLIP_MEAN, CLIP_STD
from llmrun.loading.vision import (
    image_processor,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models import step3p7_vision

MODEL_TYPE = "step3p7"
TEXT_MODEL_TYPE = "step3p5"
BILINEAR = 2  # Pillow's filter number, as preprocessor_config.json gives it
# StepFun's names (in a vision_model.* tensor name) -> the encoder's.
_HUB_NAMES = (
    (re.compile(r"^vision_model\.conv1\."), "vision_model.embeddings.patch_embedding."),
    (
        re.compile(r"^vision_model\.positional_embedding$"),
        "vision_model.embeddings.position_embedding.weight",
    ),
    (re.compile(r"^vision_model\.ln_pre\."), "vision_model.pre_layernorm."),
    (re.compile(r"^vision_model\.transformer\.resblocks\."), "vision_model.layers."),
    (re.compile(r"^vision_model\.vit_downsampler(\d)\."), r"vision_model.downsampler\1."),
    (re.compile(r"^vit_large_projector\."), "multi_modal_projector."),
    (re.compile(r"\.attn\.out_proj\."), ".self_attn.out_proj."),
    (re.compile(r"\.ln_1\."), ".layernorm_before."),
    (re.compile(r"\.ln_2\."), ".layernorm_after."),
    (re.compile(r"\.ls_(\d)\.gamma$"), r".lambda_\1"),
    (re.compile(r"\.mlp\.c_fc\."), ".mlp.fc1."),
    (re.compile(r"\.mlp\.c_proj\."), ".mlp.fc2."),
)
_IN_PROJ = re.compile(r"(.*)\.attn\.in_proj_(weight|bias)$")
# transformers 5's names -> the encoder's.
_HF_PREFIXES = {
    "model.vision_model.": "vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}
_HUB_PREFIXES = ("vision_model.", "vit_large_projector.")
# Step3p7ImageProcessor's defaults.
GLOBAL_SIZE, CROP_SIZE, MAX_IMAGE_SIZE = 728, 504, 3024


@dataclass
class Step3p7Vision:
    """A loaded Step 3.7 image encoder and how images are cut for it
    (Step3p7ImageProcessor): a global view `size` pixels square, local crops resized to
    `crop` pixels square, images first scaled to at most `max_image_size` on their longer
    side; normalized by mean and std."""

    encoder: step3p7_vision.ImageEncoder
    size: int = GLOBAL_SIZE
    crop: int = CROP_SIZE
    max_image_size: int = MAX_IMAGE_SIZE
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @property
    def global_tokens(self) -> int:
        return self.encoder.args.tokens(self.size)

    @property
    def crop_tokens(self) -> int:
        return self.encoder.args.tokens(self.crop)


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a config.json is Step 3.7's with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == TEXT_MODEL_TYPE


def is_mmproj(path: str | Path) -> bool:
    return projector_type(path) == VisionProjectorType.STEP3VL


def from_mmproj(path: str | Path, text_hidden: int) -> Step3p7Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type step3vl)."""
    gg, need = open_mmproj(path, VisionProjectorType.STEP3VL)
    meta, vision = gg.metadata, Keys.ClipVision
    width = need(vision.EMBEDDING_LENGTH)
    layers = need(vision.BLOCK_COUNT)
    try:
        args = step3p7_vision.EncoderArgs(
            text_hidden_size=need(vision.PROJECTION_DIM),
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS, 1e-5)),
            projector_bias="mm.model.fc.bias" in gg.tensors,
        )
    except ModelFormatError as e:
        raise ModelFormatError(f"{gg.path}: {e}") from None
    hub = mmproj_tensors(gg, _hub_name, "Step 3.7's vision tower")
    encoder = with_weights(
        step3p7_vision.ImageEncoder,
        args,
        hub_weights(hub, args.num_attention_heads),
        gg.path,
        (args.text_hidden_size, text_hidden),
    )
    return Step3p7Vision(
        encoder,
        size=args.image_size,
        max_image_size=need(vision.PREPROC_IMAGE_SIZE, MAX_IMAGE_SIZE),
        mean=three_floats(meta.get(vision.IMAGE_MEAN, CLIP_MEAN), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD, CLIP_STD), gg.path, vision.IMAGE_STD),
    )


# llama.cpp's mmproj names (clip-impl.h) -> StepFun's.
_GGUF_TOP = {
    "v.patch_embd.weight": "vision_model.conv1.weight",
    "v.position_embd.weight": "vision_model.positional_embedding",
    "v.pre_ln.weight": "vision_model.ln_pre.weight",
    "v.pre_ln.bias": "vision_model.ln_pre.bias",
    "mm.model.fc.weight": "vit_large_projector.weight",
    "mm.model.fc.bias": "vit_large_projector.bias",
}
_GGUF_LAYER = {
    "attn_qkv.weight": "attn.in_proj_weight",
    "attn_qkv.bias": "attn.in_proj_bias",
    "attn_out": "attn.out_proj",
    "ln1": "ln_1",
    "ln2": "ln_2",
    "ls1.weight": "ls_1.gamma",
    "ls2.weight": "ls_2.gamma",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_GGUF_BLOCK = re.compile(r"v\.blk\.(\d+)\.(.+)")
_GGUF_DOWNSAMPLER = re.compile(r"mm\.([01])\.(weight|bias)")


def _hub_name(name: str) -> str | None:
    """StepFun's name of an mmproj tensor; None where it is not the tower's."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    if (down := _GGUF_DOWNSAMPLER.fullmatch(name)) is not None:
        return f"vision_model.vit_downsampler{int(down.group(1)) + 1}.{down.group(2)}"
    if (block := _GGUF_BLOCK.fullmatch(name)) is None:
        return None
    rest = block.group(2)
    for old, new in _GGUF_LAYER.items():
        if rest == old or rest.startswith(old + "."):
            return f"vision_model.transformer.resblocks.{block.group(1)}.{new}{rest[len(old) :]}"
    return None


def hub_weights(weights: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """StepFun's vision tensors under the encoder's names (see the module's docstring)."""
    out = {}
    for name, tensor in weights.items():
        fused = _IN_PROJ.fullmatch(name)
        for pattern, replacement in _HUB_NAMES:
            name = pattern.sub(replacement, name)
        if fused is None:
            out[name] = tensor
            continue
        layer = _IN_PROJ.fullmatch(name).group(1)
        if tensor.shape[0] % (3 * heads * 2):
            raise ModelFormatError(
                f"{name} has {tensor.shape[0]} rows: not q, k, v of {heads} heads"
            )
        q, k, v = tensor.chunk(3)
        kind = fused.group(2)
        out[f"{layer}.self_attn.q_proj.{kind}"] = _pairs_to_halves(q, heads)
        out[f"{layer}.self_attn.k_proj.{kind}"] = _pairs_to_halves(k, heads)
        out[f"{layer}.self_attn.v_proj.{kind}"] = v
    return out


def _pairs_to_halves(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows (RoPE pairs adjacent) in halves order: row 2i + j -> j * half + i."""
    width = rows.shape[0]
    return (
        rows.reshape(heads, width // heads // 2, 2, *rows.shape[1:])
        .transpose(1, 2)
        .reshape(rows.shape)
    )


def from_hf_dir(path: Path, text_hidden: int) -> Step3p7Vision:
    """The image encoder of a Step 3.7 Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Step 3.7 folder with a vision_config")
    args = step3p7_vision.EncoderArgs.from_config(config)
    hub, hf = {}, {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            if name.startswith(_HUB_PREFIXES):
                hub[name] = tensor
            for old, new in _HF_PREFIXES.items():
                if name.startswith(old):
                    hf[new + name[len(old) :]] = tensor
    weights = {**hub_weights(hub, args.num_attention_heads), **hf}
    encoder = with_weights(
        step3p7_vision.ImageEncoder, args, weights, path, (args.text_hidden_size, text_hidden)
    )
    return Step3p7Vision(encoder, **_processor_settings(path, args))


def _processor_settings(path: Path, args: step3p7_vision.EncoderArgs) -> dict[str, Any]:
    """The image processor's sizes and normalization, else Step3p7ImageProcessor's
    defaults; both views' sides must be whole multiples of the tower's 4 x patch_size (the
    processor counts soft tokens so)."""
    source, settings = image_processor(path)
    stride = args.patch_size * step3p7_vision.DOWNSAMPLE
    size = settings.get("size", {"height": GLOBAL_SIZE, "width": GLOBAL_SIZE})
    side = size.get("height") if isinstance(size, dict) else None
    crop = settings.get("patch_size", CROP_SIZE)
    if not positive_int(side) or size.get("width") != side or side % stride:
        raise ModelFormatError(
            f"{source}: size is {size!r}, not a square of a multiple of {stride} pixels"
        )
    if not positive_int(crop) or crop % stride:
        raise ModelFormatError(
            f"{source}: patch_size is {crop!r}, not a multiple of {stride} pixels"
        )
    largest = settings.get("max_image_size", MAX_IMAGE_SIZE)
    if not positive_int(largest):
        raise ModelFormatError(f"{source}: max_image_size is {largest!r}, not a positive integer")
    resample = settings.get("resample", BILINEAR)
    if resample != BILINEAR or isinstance(resample, bool):
        raise ModelFormatError(f"{source}: resample is {resample!r}; llmrun resizes bilinearly (2)")
    return dict(
        size=side,
        crop=crop,
        max_image_size=largest,
        mean=three_floats(settings.get("image_mean", CLIP_MEAN), source, "image_mean"),
        std=three_floats(settings.get("image_std", CLIP_STD), source, "image_std"),
    )

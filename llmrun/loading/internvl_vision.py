"""InternVL's image encoder (llmrun.models.internvl_vision) from either format: the
Hugging Face folder of an InternVLForConditionalGeneration (the "-hf" repos: vision_tower.*
and multi_modal_projector.*, model.* as transformers 5 saves them) with its
preprocessor_config.json (GotOcr2ImageProcessor's tiles), or the mmproj GGUF that llama.cpp's
converter writes from the original InternVL repos (conversion/internvl.py InternVisionModel:
projector type internvl, each qkv split into attn_q/k/v, ls1/ls2 layer scales, the projector
as mm.model.mlp.0/1/3; tools/mtmd/clip.cpp reads it). Both give the encoder HF's weights.

An mmproj does not say its norm type: clip.cpp takes RMSNorm for the 6B ViT (width 3200, 45
layers: InternVL 2.5/3 26B, 38B, 78B) and LayerNorm otherwise; llmrun does the same. clip.cpp
adds the position table with the class token after the patches, each patch taking its
neighbour's row; llmrun adds it as transformers and the original InternViT do, the class
token first (benchmarks/llama_cpp_internvl.py measures the difference).

Qianfan-OCR's folder (QianfanOCRForConditionalGeneration, Qwen3 text) holds InternVL's
encoder (its layers' drop paths do nothing at inference; q/k/v biases by default) under
the original InternVL-chat names, which transformers renames on loading
(conversion_mapping.py's qianfan_ocr, save_pretrained writes them back): vision_model.*
with each qkv fused, ls1/ls2 layer scales, the projector as mlp1.0/1/3; read here under
InternVL's HF names. Its prompts mark an image by processor_config.json's
image_placeholder_token (<image>), not <IMG_CONTEXT>. llama.cpp has no converter for it:
no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    image_processor,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models.internvl_vision import EncoderArgs, ImageEncoder, VisionArgs

MODEL_TYPE = "internvl"
QIANFAN_MODEL_TYPE = "qianfan_ocr"
# QianfanOCRProcessor's default image_placeholder_token.
QIANFAN_PLACEHOLDER = "<image>"
# GotOcr2ImageProcessor's defaults (OpenAI CLIP's mean and std; 1 to 12 tiles).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_TILES, MAX_TILES = 1, 12
# clip.cpp's test for the 6B ViT, whose norms are RMSNorm.
_RMS_VIT = (3200, 45)
_HF_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
_GGUF_LAYER = {
    "attn_q": "attention.q_proj",
    "attn_k": "attention.k_proj",
    "attn_v": "attention.v_proj",
    "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm",
    "attn_out": "attention.projection_layer",
    "ln1": "layernorm_before",
    "ln2": "layernorm_after",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
    "ls1": "lambda_1",
    "ls2": "lambda_2",
}
_EMBEDDINGS = "vision_tower.embeddings."
_LAYERS = "vision_tower.encoder.layer."
# The original InternVL-chat names (Qianfan-OCR's files) -> InternVL's HF names, as
# transformers renames them (no q/k norms: it reads none).
_ORIGINAL_MODULES = {
    "vision_model.embeddings.class_embedding": _EMBEDDINGS + "cls_token",
    "vision_model.embeddings.position_embedding": _EMBEDDINGS + "position_embeddings",
    "vision_model.embeddings.patch_embedding.": _EMBEDDINGS + "patch_embeddings.projection.",
    "mlp1.0.": "multi_modal_projector.layer_norm.",
    "mlp1.1.": "multi_modal_projector.linear_1.",
    "mlp1.3.": "multi_modal_projector.linear_2.",
}
_ORIGINAL_LAYERS = "vision_model.encoder.layers."
_ORIGINAL_LAYER = {
    "attn.proj.": "attention.projection_layer.",
    "norm1.": "layernorm_before.",
    "norm2.": "layernorm_after.",
    "ls1": "lambda_1",
    "ls2": "lambda_2",
}
_GGUF_NAMES = {
    "v.patch_embd.weight": _EMBEDDINGS + "patch_embeddings.projection.weight",
    "v.patch_embd.bias": _EMBEDDINGS + "patch_embeddings.projection.bias",
    "v.class_embd": _EMBEDDINGS + "cls_token",
    "v.position_embd.weight": _EMBEDDINGS + "position_embeddings",
    "mm.model.mlp.0.weight": "multi_modal_projector.layer_norm.weight",
    "mm.model.mlp.0.bias": "multi_modal_projector.layer_norm.bias",
    "mm.model.mlp.1.weight": "multi_modal_projector.linear_1.weight",
    "mm.model.mlp.1.bias": "multi_modal_projector.linear_1.bias",
    "mm.model.mlp.3.weight": "multi_modal_projector.linear_2.weight",
    "mm.model.mlp.3.bias": "multi_modal_projector.linear_2.bias",
}


@dataclass
class InternVLVision:
    """A loaded InternVL image encoder and how images are tiled for it: into
    min_tiles..max_tiles squares of `tile` pixels (and a thumbnail), normalized by mean
    and std."""

    encoder: ImageEncoder
    tile: int
    min_tiles: int
    max_tiles: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def tokens_per_tile(self) -> int:
        return self.encoder.args.tokens_per_tile(self.tile)


@dataclass
class QianfanOcrVision(InternVLVision):
    """A loaded Qianfan-OCR image encoder (InternVL's, its images tiled alike) and the text
    that marks an image's place in its prompts."""

    placeholder: str = QIANFAN_PLACEHOLDER


def folder_has_vision(path: Path, model_type: str = MODEL_TYPE) -> bool:
    """Whether a Hugging Face folder is an InternVLForConditionalGeneration's (or
    `model_type`'s) with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == model_type and isinstance(config.get("vision_config"), dict)


def folder_has_qianfan_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a QianfanOCRForConditionalGeneration's."""
    return folder_has_vision(path, QIANFAN_MODEL_TYPE)


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Qianfan-OCR mmproj: never one of its."""
    return False


def qianfan_from_mmproj(path: str | Path, text_hidden: int) -> QianfanOcrVision:
    """Refused: there is no Qianfan-OCR mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Qianfan-OCR projector; give its folder")


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is InternVL's."""
    return projector_type(path) == VisionProjectorType.INTERNVL


def from_hf_dir(path: Path, text_hidden: int) -> InternVLVision:
    """InternVL's image encoder from its Hugging Face folder (f32, on the CPU)."""
    return _from_hf_dir(path, text_hidden, MODEL_TYPE)


def qianfan_from_hf_dir(path: Path, text_hidden: int) -> QianfanOcrVision:
    """Qianfan-OCR's image encoder from its Hugging Face folder (f32, on the CPU)."""
    return _from_hf_dir(path, text_hidden, QIANFAN_MODEL_TYPE)


def _from_hf_dir(path: Path, text_hidden: int, model_type: str) -> Any:
    qianfan = model_type == QIANFAN_MODEL_TYPE
    config = safetensors_io.read_config(path)
    vision = config.get("vision_config")
    if config.get("model_type") != model_type or not isinstance(vision, dict):
        name = "a Qianfan-OCR" if qianfan else "an InternVL"
        raise UsageError(f"{path}: not {name} folder with a vision_config")
    if qianfan:  # QianfanOCRVisionConfig's default
        config = {**config, "vision_config": {"attention_bias": True, **vision}}
    args = EncoderArgs.from_config(config)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            if qianfan:
                weights.update(_from_original(name, tensor, file))
                continue
            for old, new in _HF_PREFIXES.items():
                if name.startswith(old):
                    if not name.endswith(".mask_token"):  # masked image modelling's only
                        weights[new + name[len(old) :]] = tensor
                    break
    settings = _processor_settings(path, args.vision.image_size)
    if qianfan:
        settings["placeholder"] = _placeholder(path)
    return _build(args, weights, text_hidden, path, **settings)


def _from_original(name: str, tensor: torch.Tensor, file: Path) -> dict[str, torch.Tensor]:
    """A weight of Qianfan-OCR's file (the original InternVL-chat names) under InternVL's HF
    names, a fused qkv as its three (none for the language model's; a name it does not
    know kept, for the encoder's check to refuse)."""
    for old, new in _ORIGINAL_MODULES.items():
        if name.startswith(old):
            return {new + name[len(old) :]: tensor}
    if not name.startswith(_ORIGINAL_LAYERS):
        return {}
    index, module = name[len(_ORIGINAL_LAYERS) :].split(".", 1)
    layer = f"{_LAYERS}{index}."
    if module.startswith("attn.qkv."):
        if tensor.shape[0] % 3:
            raise ModelFormatError(f"{file}: {name} of {tensor.shape[0]} rows is not q, k, v")
        suffix = module[len("attn.qkv.") :]
        pieces = tensor.chunk(3)
        return {
            f"{layer}attention.{p}_proj.{suffix}": t for p, t in zip("qkv", pieces, strict=True)
        }
    for old, new in _ORIGINAL_LAYER.items():
        if module.startswith(old):
            return {layer + new + module[len(old) :]: tensor}
    return {layer + module: tensor}


def _placeholder(path: Path) -> str:
    """processor_config.json's image_placeholder_token, else QianfanOCRProcessor's."""
    file = path / "processor_config.json"
    settings = safetensors_io.read_json(file) if file.is_file() else {}
    token = settings.get("image_placeholder_token", QIANFAN_PLACEHOLDER)
    if not isinstance(token, str) or not token:
        raise ModelFormatError(f"{file}: image_placeholder_token is {token!r}, not a text")
    return token


def _processor_settings(path: Path, image_size: int) -> dict[str, Any]:
    """The image processor's tile size, min_patches, max_patches, image_mean and
    image_std (preprocessor_config.json, or processor_config.json's image_processor);
    GotOcr2ImageProcessor's defaults where it has none, but tiles of the vision tower's
    image_size."""
    file, processor = image_processor(path)
    size = processor.get("size", {"height": image_size, "width": image_size})
    tile = size.get("height") if isinstance(size, dict) else None
    if not positive_int(tile) or size.get("width") != tile:
        raise ModelFormatError(f"{file}: size is {size!r}, not a square tile in pixels")
    tiles = [
        processor.get(k, d) for k, d in (("min_patches", MIN_TILES), ("max_patches", MAX_TILES))
    ]
    if not all(positive_int(t) for t in tiles) or tiles[0] > tiles[1]:
        raise ModelFormatError(f"{file}: min_patches and max_patches are {tiles}")
    return dict(
        tile=tile,
        min_tiles=tiles[0],
        max_tiles=tiles[1],
        mean=three_floats(processor.get("image_mean", CLIP_MEAN), file, "image_mean"),
        std=three_floats(processor.get("image_std", CLIP_STD), file, "image_std"),
    )


def from_mmproj(path: str | Path, text_hidden: int) -> InternVLVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type internvl)."""
    gg, need = open_mmproj(path, VisionProjectorType.INTERNVL)
    meta = gg.metadata
    vision = Keys.ClipVision

    if meta.get(vision.USE_SILU):
        act = "silu"
    elif meta.get(vision.USE_GELU):
        act = "gelu"
    else:
        raise UnsupportedError(
            f"{gg.path}: neither {vision.USE_GELU} nor {vision.USE_SILU}: clip.cpp's quick "
            "GELU, which InternVL's converter never writes"
        )
    width, layers = need(vision.EMBEDDING_LENGTH), need(vision.BLOCK_COUNT)
    merge = need(vision.Projector.SCALE_FACTOR, 2)
    args = EncoderArgs(
        VisionArgs(
            hidden_size=width,
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=layers,
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            attention_bias="v.blk.0.attn_q.bias" in gg.tensors,
            use_qk_norm="v.blk.0.attn_q_norm.weight" in gg.tensors,
            hidden_act=act,
            norm_type="rms_norm" if (width, layers) == _RMS_VIT else "layer_norm",
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        text_hidden_size=need(vision.PROJECTION_DIM),
        downsample_ratio=1 / merge,
    )
    weights = mmproj_tensors(gg, _gguf_name, "InternVL's encoder")
    for name, shape in _table_shapes(args).items():
        tensor = weights.get(name)
        if tensor is not None and tensor.numel() == shape.numel():
            weights[name] = tensor.reshape(shape)  # the class and position tables' leading 1s
    tiles = [need(vision.PREPROC_MIN_TILES, MIN_TILES), need(vision.PREPROC_MAX_TILES, MAX_TILES)]
    if tiles[0] > tiles[1]:
        raise ModelFormatError(f"{gg.path}: min and max tiles are {tiles}")
    return _build(
        args,
        weights,
        text_hidden,
        gg.path,
        tile=args.vision.image_size,
        min_tiles=tiles[0],
        max_tiles=tiles[1],
        mean=three_floats(meta.get(vision.IMAGE_MEAN, CLIP_MEAN), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD, CLIP_STD), gg.path, vision.IMAGE_STD),
    )


def _table_shapes(args: EncoderArgs) -> dict[str, torch.Size]:
    """The shapes of the embedding tables, whose leading 1s a GGUF may not keep."""
    hidden = args.vision.hidden_size
    return {
        _EMBEDDINGS + "cls_token": torch.Size([1, 1, hidden]),
        _EMBEDDINGS + "position_embeddings": torch.Size(
            [1, args.vision.patches_per_side**2 + 1, hidden]
        ),
    }


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit():
        layer = _GGUF_LAYER.get(parts[3])
        if layer is not None and parts[4] in ("weight", "bias"):
            suffix = "" if layer.startswith("lambda_") else f".{parts[4]}"
            return f"{_LAYERS}{parts[2]}.{layer}{suffix}"
    return None


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    **settings: Any,
) -> InternVLVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    unit = args.vision.patch_size * args.merge
    if settings["tile"] % unit:
        raise ModelFormatError(
            f"{source}: tiles of {settings['tile']} pixels are not whole tokens of {unit}"
        )
    encoder = with_weights(
        ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    kind = QianfanOcrVision if "placeholder" in settings else InternVLVision
    return kind(encoder, **settings)

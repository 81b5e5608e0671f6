"""Nemotron 3 Nano Omni's image encoder (RADIO, the pixel shuffle and the projector:
llmrun.models.nemotron_omni_vision) from its Hugging Face folder: model_type
nemotron_h_omni (transformers 5.25's NemotronH_Omni_Reasoning_V3) or the Hub's
NemotronH_Nano_Omni_Reasoning_V3, whose tensors both hold under the Hub's names
(vision_model.radio_model.model.patch_generator.*, ...blocks.N.{norm1, attn.qkv,
attn.proj, norm2, mlp.fc1, mlp.fc2}, mlp1.0/1/3, vision_projector.vision_final_layernorm),
which transformers' conversion mapping renames (and splits attn.qkv into q, k and v).

config.json is read as transformers reads it: vision_config under RadioConfig's names and
defaults (the Hub's RADIO config names none of the ViT-H's sizes), the Hub's older names
of the outer fields (llm_config, vit_hidden_size), the LayerNorm before the projector only
where the language model has MTP layers. preprocessor_config.json under the image
processor's names and defaults (norm_mean and norm_std the Hub's older ones).

llama.cpp's converter (conversion/nemotron.py) registers Nemotron Nano 12B v2 VL
(NemotronH_Nano_VL_V2), not this checkpoint's architecture, and its mmproj (projector
nemotron_v2_vl) resizes every image to one fixed square with the position table resampled
to it: not the Omni's images, so no mmproj is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import image_processor, positive_int, three_floats, with_weights
from llmrun.models.nemotron_omni_vision import EncoderArgs, ImageEncoder

# transformers 5.25's model_type, and the Hub's own (its remote code's).
MODEL_TYPES = ("nemotron_h_omni", "NemotronH_Nano_Omni_Reasoning_V3")
TEXT_MODEL_TYPE = "nemotron_h"
# OPENAI_CLIP_MEAN and _STD: RadioConfig's and the image processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# The image processor's defaults.
PROCESSOR_DEFAULTS = dict(
    patch_size=16,
    downsample_ratio=0.5,
    min_num_patches=1024,
    max_num_patches=13312,
    max_model_len=16384,
)
BICUBIC = 3  # PILImageResampling.BICUBIC, the only resampling the processor is run with
# RadioConfig's sizes and their defaults (C-RADIOv4-H's, the Omni's tower).
_VISION_FIELDS = dict(
    hidden_size=1280,
    num_hidden_layers=32,
    num_attention_heads=16,
    max_img_size=2048,
    patch_size=16,
    num_cls_tokens=3,
    num_registers=7,
)
_RADIO = "vision_model.radio_model."
_BLOCKS = _RADIO + "model.blocks."
_HUB_NAMES = {
    _RADIO + "model.patch_generator.embedder.weight": "embeddings.patch_projection.weight",
    _RADIO + "model.patch_generator.pos_embed": "embeddings.position_embedding",
    _RADIO + "model.patch_generator.cls_token.token": "embeddings.cls_register_token",
    "mlp1.0.weight": "multi_modal_projector.layer_norm.weight",
    "mlp1.1.weight": "multi_modal_projector.linear_1.weight",
    "mlp1.3.weight": "multi_modal_projector.linear_2.weight",
    "vision_projector.vision_final_layernorm.weight": "vision_final_layernorm.weight",
    "vision_projector.vision_final_layernorm.bias": "vision_final_layernorm.bias",
}
# What transformers does not load for images: the video embedding, the normalization the
# processor does instead, the summary tokens' indexes.
_UNUSED = (
    _RADIO + "model.patch_generator.video_embedder.",
    _RADIO + "input_conditioner.",
    _RADIO + "summary_idxs",
)
_VISION_PARTS = (_RADIO, "vision_model.", "mlp1.", "vision_projector.")


@dataclass
class NemotronOmniVision:
    """A loaded Nemotron 3 Nano Omni image encoder and how images are prepared for it
    (the image processor's settings; `max_patches` the budget of an image)."""

    encoder: ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_patches: int
    max_patches: int

    @property
    def patch_size(self) -> int:
        return self.encoder.args.patch_size

    @property
    def merge_size(self) -> int:
        return self.encoder.args.merge_size


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a config.json is Nemotron 3 Nano Omni's with its vision_config."""
    return config.get("model_type") in MODEL_TYPES and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Nemotron 3 Nano Omni with its tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """No mmproj holds the Omni's tower as transformers runs it (see the module's note)."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> NemotronOmniVision:
    """Refused: is_mmproj takes no file (see the module's note)."""
    raise UnsupportedError(f"{path}: llmrun takes Nemotron 3 Nano Omni's images from its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Nemotron-H's, which the Omni's text is."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def _outer(config: dict[str, Any], name: str, legacy: str, default: Any) -> Any:
    """An outer config field under transformers' name, else the Hub's older one."""
    return config.get(name, config.get(legacy, default))


def merge_size(ratio: Any, source: Path) -> int:
    """1 / downsample_ratio, which must be a whole number of patches a side."""
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise ModelFormatError(f"{source}: downsample_ratio is {ratio!r}")
    merge = round(1 / ratio)
    if abs(merge * ratio - 1) > 1e-9:
        raise UnsupportedError(f"{source}: downsample_ratio {ratio} is not 1 / a whole number")
    return merge


def encoder_args(config: dict[str, Any], path: Path) -> EncoderArgs:
    """The encoder's shape from a Nemotron 3 Nano Omni config.json."""
    vision = config["vision_config"]
    text = _outer(config, "text_config", "llm_config", None)
    if not isinstance(text, dict) or not positive_int(text.get("hidden_size")):
        raise ModelFormatError(f"{path}: a Nemotron 3 Nano Omni config without its text width")
    sizes = {}
    for name, default in _VISION_FIELDS.items():
        value = vision.get(name, default)
        if not positive_int(value):
            raise ModelFormatError(f"{path}: vision_config.{name} is {value!r}")
        sizes[name] = value
    if vision.get("use_swiglu_ffn", False):
        raise UnsupportedError(f"{path}: a RADIO tower with SwiGLU MLPs (llmrun runs GELU's)")
    if vision.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedError(f"{path}: vision hidden_act {vision['hidden_act']!r} (gelu runs)")
    width = _outer(config, "vision_hidden_size", "vit_hidden_size", 1280)
    if width != sizes["hidden_size"]:
        raise ModelFormatError(
            f"{path}: the projector takes {width!r} features a patch, the tower gives "
            f"{sizes['hidden_size']}"
        )
    projector = config.get("projector_hidden_size", 4096)
    if not positive_int(projector):
        raise ModelFormatError(f"{path}: projector_hidden_size is {projector!r}")
    mtp = text.get("num_nextn_predict_layers") or 0
    try:
        return EncoderArgs(
            **sizes,
            out_hidden_size=text["hidden_size"],
            projector_hidden_size=projector,
            mlp_ratio=float(vision.get("mlp_ratio", 4.0)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            qkv_bias=bool(vision.get("qkv_bias", True)),
            merge_size=merge_size(config.get("downsample_ratio", 0.5), path),
            final_norm=mtp > 0,
        )
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e}") from None


def processor_settings(path: Path, args: EncoderArgs) -> dict[str, Any]:
    """The image processor's mean, std and patch budget, refusing settings that would
    prepare images for another tower or that llmrun does not follow."""
    source, settings = image_processor(path)
    values = {k: settings.get(k, v) for k, v in PROCESSOR_DEFAULTS.items()}
    if values["patch_size"] != args.patch_size:
        raise ModelFormatError(
            f"{source}: patch_size {values['patch_size']!r}, the tower's is {args.patch_size}"
        )
    if merge_size(values["downsample_ratio"], source) != args.merge_size:
        raise ModelFormatError(f"{source}: downsample_ratio is not config.json's")
    for name in ("min_num_patches", "max_num_patches", "max_model_len"):
        if not positive_int(values[name]):
            raise UnsupportedError(f"{source}: {name} is {values[name]!r} (llmrun takes counts)")
    least, most = values["min_num_patches"], values["max_num_patches"]
    # The processor gives the images of a call one budget: the context's patches, at least
    # min_num_patches each, capped at max_num_patches; the same for any count of images
    # where the context's patches reach the cap (65,520 of 13,312 by default).
    if (values["max_model_len"] - 4) * args.merge_size**2 < most:
        raise UnsupportedError(
            f"{source}: max_model_len {values['max_model_len']} makes an image's patches "
            "depend on how many images a prompt has, which llmrun does not follow"
        )
    if settings.get("resample", BICUBIC) != BICUBIC:
        raise UnsupportedError(f"{source}: resample {settings['resample']!r} (bicubic runs)")
    for flag in ("do_rescale", "do_normalize", "do_convert_rgb"):
        if settings.get(flag, True) is not True:
            raise UnsupportedError(f"{source}: {flag} is {settings[flag]!r}")
    if settings.get("rescale_factor", 1 / 255) != 1 / 255:
        raise UnsupportedError(f"{source}: rescale_factor {settings['rescale_factor']!r}")
    mean = settings.get("image_mean", settings.get("norm_mean", CLIP_MEAN))
    std = settings.get("image_std", settings.get("norm_std", CLIP_STD))
    return dict(
        mean=three_floats(mean, source, "image_mean"),
        std=three_floats(std, source, "image_std"),
        min_patches=least,
        max_patches=max(most, least),
    )


def from_hf_dir(path: Path, text_hidden: int) -> NemotronOmniVision:
    """The image encoder of a Nemotron 3 Nano Omni folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Nemotron 3 Nano Omni folder with a vision_config")
    args = encoder_args(config, path)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            if name in _HUB_NAMES:
                weights[_HUB_NAMES[name]] = tensor
            elif name.startswith(_BLOCKS):
                weights.update(_block_tensor(name, tensor, path))
            elif name.startswith(_VISION_PARTS) and not name.startswith(_UNUSED):
                raise UnsupportedError(
                    f"{path}: tensor {name!r} is not part of Nemotron 3 Nano Omni's tower"
                )
    # The Hub's blocks have no LayerScale (transformers' default of layerscale_value, 1).
    scale = float(config["vision_config"].get("layerscale_value", 1.0))
    for layer in range(args.num_hidden_layers):
        for n in (1, 2):
            name = f"encoder.layer.{layer}.layer_scale{n}.lambda1"
            weights.setdefault(name, torch.full((args.hidden_size,), scale))
    encoder = with_weights(ImageEncoder, args, weights, path, (args.out_hidden_size, text_hidden))
    return NemotronOmniVision(encoder, **processor_settings(path, args))


def _block_tensor(name: str, tensor: torch.Tensor, path: Path) -> dict[str, torch.Tensor]:
    """A Hub block tensor under the encoder's name; attn.qkv as the three projections."""
    layer, _, rest = name[len(_BLOCKS) :].partition(".")
    into = f"encoder.layer.{layer}."
    if rest.startswith("attn.proj."):
        return {into + "attention.o_proj." + rest.removeprefix("attn.proj."): tensor}
    if not rest.startswith("attn.qkv."):
        return {into + rest: tensor}
    suffix = rest.removeprefix("attn.qkv.")
    if tensor.shape[0] % 3:
        raise ModelFormatError(f"{path}: {name}'s {tensor.shape[0]} rows are not q, k and v")
    q, k, v = tensor.chunk(3)
    return {
        f"{into}attention.q_proj.{suffix}": q,
        f"{into}attention.k_proj.{suffix}": k,
        f"{into}attention.v_proj.{suffix}": v,
    }

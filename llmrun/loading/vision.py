"""Image encoders of vision-language models, from either format: Gemma 3's vision tower
and projector from its Hugging Face folder (Gemma3ForConditionalGeneration), or from the
mmproj GGUF that llama.cpp's converter writes beside the text model's GGUF (`--mmproj`:
clip.* metadata, v.* and mm.* tensors, as tools/mtmd/clip.cpp reads them). Both give the
encoder HF's weights; the language model loads as for text (llmrun.loading.loader).
It also holds what the other families' encoder loaders share: opening an mmproj, naming
and reading its tensors (SigLIP's layer names among them), building an encoder from them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.loader import SkipInit
from llmrun.models import gemma3_vision, siglip
from llmrun.quant.blocks import dequantize

# How the loader's note on a multimodal folder ends (llmrun.loading.loader), dropped
# where the vision tower does load.
TEXT_ONLY = "without the vision tower"
# Gemma3ImageProcessor's (and llama.cpp's clip.cpp default) mean and std per channel.
GEMMA3_MEAN_STD = (0.5, 0.5, 0.5)
# Checkpoint key prefixes of Gemma 3's vision parts -> ImageEncoder's: the Hub's files
# (vision_tower.vision_model.), transformers 5's (model.vision_tower., no vision_model.).
_HF_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.vision_model.",
    "vision_tower.vision_model.": "vision_tower.vision_model.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# SiglipVisionModel's attention-pooling head, which Gemma 3 never runs (its checkpoints
# have none; transformers' default SiglipVisionConfig builds one).
_UNUSED = ".head."
# The GGUF names of a SigLIP (or CLIP) layer's tensors (clip-impl.h, gguf-py's
# tensor_mapping) -> transformers'.
SIGLIP_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_TOWER = "vision_tower.vision_model."
_INPUT_PROJECTION = "mm.input_projection.weight"
_SOFT_EMB_NORM = "multi_modal_projector.mm_soft_emb_norm.weight"
_GGUF_NAMES = {
    "v.patch_embd.weight": _TOWER + "embeddings.patch_embedding.weight",
    "v.patch_embd.bias": _TOWER + "embeddings.patch_embedding.bias",
    "v.position_embd.weight": _TOWER + "embeddings.position_embedding.weight",
    "v.post_ln.weight": _TOWER + "post_layernorm.weight",
    "v.post_ln.bias": _TOWER + "post_layernorm.bias",
    _INPUT_PROJECTION: "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": _SOFT_EMB_NORM,
}


@dataclass
class Vision:
    """A loaded image encoder and how images are prepared for it."""

    encoder: gemma3_vision.ImageEncoder
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def tokens_per_image(self) -> int:
        return self.encoder.args.mm_tokens_per_image


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Gemma 3 with its vision tower."""
    return config.get("model_type") == "gemma3" and isinstance(config.get("vision_config"), dict)


def from_hf_dir(path: Path, text_hidden: int) -> Vision:
    """Gemma 3's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a vision model llmrun runs (Gemma 3 with a vision_config)")
    args = gemma3_vision.EncoderArgs.from_config(config)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _hf_name(name)
            if new is not None:
                weights[new] = tensor
    mean, std = _processor_mean_std(path)
    return _build(args, weights, text_hidden, path, mean, std)


def _hf_name(name: str) -> str | None:
    for old, new in _HF_PREFIXES.items():
        if name.startswith(old):
            return None if _UNUSED in name else new + name[len(old) :]
    return None


def _processor_mean_std(path: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """preprocessor_config.json's image_mean and image_std, else Gemma 3's."""
    file = path / "preprocessor_config.json"
    if not file.is_file():
        return GEMMA3_MEAN_STD, GEMMA3_MEAN_STD
    try:
        processor = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    values = tuple(
        three_floats(processor.get(key, GEMMA3_MEAN_STD), file, key)
        for key in ("image_mean", "image_std")
    )
    return values[0], values[1]


def image_processor(path: Path) -> tuple[Path, dict[str, Any]]:
    """The image processor's settings: preprocessor_config.json, or transformers 5's
    processor_config.json, which holds them under "image_processor"; none where neither
    is there."""
    for name, key in (
        ("preprocessor_config.json", None),
        ("processor_config.json", "image_processor"),
    ):
        file = path / name
        if not file.is_file():
            continue
        try:
            settings = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
        settings = settings.get(key) if key and isinstance(settings, dict) else settings
        if isinstance(settings, dict):
            return file, settings
    return path, {}


def feature_extractor(path: Path) -> tuple[Path, dict[str, Any]]:
    """The audio feature extractor's settings, as image_processor finds an image
    processor's: transformers 5's processor_config.json "feature_extractor", or
    preprocessor_config.json; none where neither is there."""
    for name, key in (
        ("processor_config.json", "feature_extractor"),
        ("preprocessor_config.json", None),
    ):
        file = path / name
        if not file.is_file():
            continue
        try:
            settings = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
        settings = settings.get(key) if key and isinstance(settings, dict) else settings
        if isinstance(settings, dict):
            return file, settings
    return path, {}


def three_floats(value: Any, source: Path, key: str) -> tuple[float, ...]:
    """A per-channel mean or std (`key` of `source`) as three floats, a std positive."""
    ok = isinstance(value, list | tuple) and len(value) == 3
    if not ok or not all(isinstance(v, int | float) for v in value):
        raise ModelFormatError(f"{source}: {key} is {value!r}, not three numbers")
    if key.endswith("std") and any(v <= 0 for v in value):
        raise ModelFormatError(f"{source}: {key} is {value!r}; it divides, so must be positive")
    return tuple(float(v) for v in value)


def pixel_settings(
    gg: gguf_io.GGUFFile,
    need: Callable[[str, int], int],
    mean: tuple[float, ...],
    std: tuple[float, ...],
    min_pixels: int,
    max_pixels: int,
) -> dict[str, Any]:
    """An mmproj's image settings for the processors that resize by pixel count (Qwen2-VL's
    and its kin): the mean and std per channel and the least and most pixels, each the
    given default where the file has none (`need` reads the counts, checked positive)."""
    vision, meta = Keys.ClipVision, gg.metadata
    settings = dict(
        mean=three_floats(meta.get(vision.IMAGE_MEAN, mean), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD, std), gg.path, vision.IMAGE_STD),
        min_pixels=need(vision.IMAGE_MIN_PIXELS, min_pixels),
        max_pixels=need(vision.IMAGE_MAX_PIXELS, max_pixels),
    )
    if settings["min_pixels"] > settings["max_pixels"]:
        raise ModelFormatError(f"{gg.path}: image_min_pixels > image_max_pixels")
    return settings


def positive_int(value: Any) -> bool:
    """Whether a config value is a positive integer (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def projector_type(path: str | Path) -> Any:
    """An mmproj GGUF's projector type (clip.projector_type), None where it names none."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    return meta.get(Keys.Clip.PROJECTOR_TYPE, meta.get(Keys.ClipVision.PROJECTOR_TYPE))


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Gemma 3's."""
    return projector_type(path) == VisionProjectorType.GEMMA3


def open_mmproj(path: str | Path, projector: str) -> tuple[gguf_io.GGUFFile, Callable[..., Any]]:
    """An mmproj GGUF that must hold a vision encoder of projector type `projector`, and its
    `need(key, default=None)`: a positive number from the metadata, else one error naming
    the key."""
    gg = gguf_io.read_gguf(path)
    meta = gg.metadata
    kind = meta.get(Keys.Clip.PROJECTOR_TYPE, meta.get(Keys.ClipVision.PROJECTOR_TYPE))
    if kind is None or not meta.get(Keys.Clip.HAS_VISION_ENCODER, False):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with a vision encoder")
    if kind != projector:
        raise UnsupportedError(f"{gg.path}: projector type {kind!r}, not {projector!r}")

    def need(key: str, default: Any = None) -> Any:
        value = meta.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    return gg, need


def prefixed_weights(path: Path, prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """A folder's tensors whose names begin with a key of `prefixes`, renamed to begin
    with its value instead (the encoder's names); the language model's are left out."""
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            for old, new in prefixes.items():
                if name.startswith(old):
                    weights[new + name[len(old) :]] = tensor
                    break
    return weights


def from_mmproj(path: str | Path, text_hidden: int) -> Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type gemma3)."""
    gg, need = open_mmproj(path, VisionProjectorType.GEMMA3)
    meta = gg.metadata
    vision = Keys.ClipVision
    args = siglip.VisionArgs(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        image_size=need(vision.IMAGE_SIZE),
        patch_size=need(vision.PATCH_SIZE),
        layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
    )
    # clip.cpp's n_merge: the pooling side, 4 unless the file says otherwise.
    pool = meta.get(vision.Projector.SCALE_FACTOR, 4)
    if not isinstance(pool, int) or pool < 1 or args.patches_per_side % pool:
        raise ModelFormatError(f"{gg.path}: projector scale factor {pool!r}")
    tokens = (args.patches_per_side // pool) ** 2
    projection = gg.tensors.get(_INPUT_PROJECTION)
    if projection is None or len(projection.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D {_INPUT_PROJECTION}")
    # [vision hidden, text hidden]: the width it projects to.
    encoder_args = gemma3_vision.EncoderArgs(args, projection.shape[1], tokens)
    weights = mmproj_tensors(gg, _gguf_name, "Gemma 3's encoder")
    if _SOFT_EMB_NORM in weights:
        weights[_SOFT_EMB_NORM] = weights[_SOFT_EMB_NORM].float() - 1.0  # Gemma's 1 + w
    mean = three_floats(meta.get(vision.IMAGE_MEAN, GEMMA3_MEAN_STD), gg.path, vision.IMAGE_MEAN)
    std = three_floats(meta.get(vision.IMAGE_STD, GEMMA3_MEAN_STD), gg.path, vision.IMAGE_STD)
    return _build(encoder_args, weights, text_hidden, gg.path, mean, std)


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, _TOWER + "encoder.layers.")


def mmproj_name(
    name: str,
    names: dict[str, str],
    layers: dict[str, str],
    into: str,
    suffixes: tuple[str, ...] = ("weight", "bias"),
    tower: str = "v",
) -> str | None:
    """An mmproj tensor's name in the encoder: `names[name]` for one of the whole names,
    `<into>N.<layers[part]>.<suffix>` for a layer's `<tower>.blk.N.<part>.<suffix>` whose
    suffix is one of `suffixes`; None for any other."""
    if name in names:
        return names[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == [tower, "blk"] and parts[2].isdigit():
        layer = layers.get(parts[3])
        if layer is not None and parts[4] in suffixes:
            return f"{into}{parts[2]}.{layer}.{parts[4]}"
    return None


def with_suffixes(modules: dict[str, str]) -> dict[str, str]:
    """Whole tensor names from module names: `<module>.weight` and `<module>.bias` -> the
    encoder module's `.weight` and `.bias`."""
    return {
        f"{module}.{suffix}": f"{new}.{suffix}"
        for module, new in modules.items()
        for suffix in ("weight", "bias")
    }


def mmproj_tensors(
    gg: gguf_io.GGUFFile,
    name_of: Callable[[str], str | None],
    encoder: str,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of an mmproj GGUF under the encoder's name `name_of(its name)`, read by
    encoder_tensor (only those whose name `keep` keeps, where given); one `name_of` does not
    name is refused as not part of `encoder` ("Gemma 3's encoder")."""
    weights = {}
    for info in gg.tensors.values():
        name = name_of(info.name)
        if name is None:
            raise UnsupportedError(f"{gg.path}: tensor {info.name!r} is not part of {encoder}")
        if keep is None or keep(name):
            weights[name] = encoder_tensor(gg, info)
    return weights


def _build(
    args: gemma3_vision.EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Vision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(
        gemma3_vision.ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return Vision(encoder, args.vision.image_size, mean, std)


def encoder_tensor(gg: gguf_io.GGUFFile, info: Any) -> torch.Tensor:
    """An mmproj tensor as the encoders take it: F32, F16 and BF16 as stored, a quantized one
    dequantized to its shape (the towers run in f32; with_weights converts)."""
    tensor = gguf_io.load_tensor(gg, info)
    if info.ggml_type in (
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
    ):
        return tensor
    return dequantize(tensor, info.ggml_type).reshape(info.shape)


def with_weights(
    encoder_class: Callable[[Any], torch.nn.Module],
    args: Any,
    weights: dict[str, torch.Tensor],
    source: Path,
    widths: tuple[int, int],
) -> torch.nn.Module:
    """An image (or audio) encoder built from `args` on the meta device and given `weights`
    (each checked against the shape the config implies) in f32, frozen, in eval mode;
    `widths`: the width it projects to and the language model's, which must agree."""
    projects_to, text_hidden = widths
    if projects_to != text_hidden:
        raise ModelFormatError(
            f"{source}: the encoder projects to {projects_to} features, but the language "
            f"model's width is {text_hidden}"
        )
    with torch.device("meta"), SkipInit():
        encoder = encoder_class(args)
    expected = encoder.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        names = missing or unexpected
        what = "missing encoder tensors" if missing else "tensors the encoder does not have"
        raise ModelFormatError(
            f"{source}: {what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        )
    state = {}
    for name, tensor in weights.items():
        shape = tuple(expected[name].shape)
        if tuple(tensor.shape) != shape:
            raise ModelFormatError(
                f"{source}: encoder tensor {name} has shape {list(tensor.shape)}, but the "
                f"config implies {list(shape)}"
            )
        state[name] = tensor.to(torch.float32)
    encoder.load_state_dict(state, assign=True)
    encoder.requires_grad_(False)
    return encoder.eval()

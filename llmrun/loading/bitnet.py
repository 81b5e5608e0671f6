"""BitNet b1.58 checkpoints as the model (llmrun/models/bitnet.py) takes them.

Hub folders (model_type "bitnet") as transformers reads them: the -bf16 master weights
without a quantization_config as they are; with quant_method "bitnet"
(integrations/bitnet.py), each projection's ternary weights with its scale folded in:
BitLinear's (the packed 2B-4T's) uint8 rows hold four ternary rows each (row block i in
bits 2i and 2i + 1, stored as t + 1) and its weight_scale is the reciprocal of the
weights' scale (y = x W^T / weight_scale); AutoBitLinear "offline" multiplies by
weight_scale instead (its weight packed so or already ternary), and "online" ternarizes
the master weights by their mean magnitude (WeightQuant), done here once. Where the
scale is 16-bit (the 2B-4T's bf16) the weights load as TQ2_0 blocks, 2 bits a weight,
the codes exact and the folded scale rounded to f16; a float32 scale gives float32
weights. The activations' int8 quantization is the model's (its quantization_config).

The older 1bitLLM/bitnet_b1_58-* folders (BitnetForCausalLM under model_type "llama") are
remote code that transformers does not run: they are refused, with llama.cpp's converter
as the way in.

GGUFs (arch "bitnet") as llama.cpp's converter writes them (conversion/bitnet.py: the
1bitLLM names, every projection ternarized with its scale folded in, F16, TQ1_0 or
TQ2_0) and read as src/models/bitnet.cpp reads them: sub-norms before attn_output and
ffn_down, a SiLU-gated feed-forward, the token embedding as the output head. A file with
the optional per-projection `.scale` tensors (which this converter never writes) is
refused. The converter maps neither transformers' sub-norm names nor a tokenizer.json, so
the 2B-4T's folders reach llmrun as folders, not as its GGUFs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

if TYPE_CHECKING:  # torch only where weights load: `list` and `show` read the config
    import torch

ARCH = MODEL_TYPE = "bitnet"
QUANT_METHOD = "bitnet"
REMOTE_ARCHITECTURE = "BitnetForCausalLM"  # 1bitLLM's (transformers' is BitNetForCausalLM)
LAYER_NAMES = {
    "attn_sub_norm": "self_attn.attn_sub_norm",
    "ffn_sub_norm": "mlp.ffn_sub_norm",
}
PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
ROWS_PER_BYTE = 4  # 2-bit codes
LINEAR_CLASSES = ("bitlinear", "autobitlinear")
MODES = ("offline", "online")
# A checkpoint's 16-bit scale (the 2B-4T's bf16) fits TQ2_0's f16 d with its ternary codes
# exact; a float32 one is folded into float32 weights, as transformers computes in f32.
HALF_SCALES = ("torch.bfloat16", "torch.float16")
TQ2_0_BLOCK = 256


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """Ternary float32 weights [4 R, C] of BitNet's packed uint8 rows [R, C]: row r of
    block i (rows i R .. i R + R - 1) is bits 2i and 2i + 1 of packed row r, minus 1.
    A code of 3 (no ternary value) is refused."""
    import torch

    codes = torch.stack([(packed >> (2 * i)) & 3 for i in range(ROWS_PER_BYTE)])
    if bool((codes == 3).any()):
        raise ModelFormatError("packed ternary weights hold the code 3, which is no -1, 0 or 1")
    # [4, R, C] -> [4 R, C]
    return codes.reshape(-1, packed.shape[-1]).float() - 1


def refuse_remote(config: dict[str, Any], path: Path) -> None:
    """Refuse a 1bitLLM BitNet folder (BitnetForCausalLM under another model_type)."""
    if (config.get("architectures") or [None])[0] == REMOTE_ARCHITECTURE:
        raise UnsupportedError(
            f"{path}: a {REMOTE_ARCHITECTURE} folder (1bitLLM's BitNet b1.58) is remote code "
            "that transformers does not run; convert it with llama.cpp's convert_hf_to_gguf.py "
            "and run the GGUF"
        )


def hf_weights(config: dict[str, Any], weights: dict[str, Any], path: Path, weight: type) -> dict:
    """A BitNet folder's weights as the model takes them: master weights as they are, or
    (quant_method "bitnet") each projection's ternary weights times their scale, in the
    checkpoint's float type. `weight` is the loader's Weight."""
    import torch

    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD:
        if quant is not None:
            raise UnsupportedError(
                f"{path}: a BitNet folder quantized by {quant.get('quant_method')!r} "
                f"(quantization_config); llmrun reads {QUANT_METHOD!r} only"
            )
        return weights
    linear = quant.get("linear_class", "bitlinear")
    mode = quant.get("quantization_mode", "offline")
    if linear not in LINEAR_CLASSES or mode not in MODES:
        raise UnsupportedError(
            f"{path}: quantization_config's linear_class {linear!r} / quantization_mode "
            f"{mode!r}; transformers knows {' and '.join(LINEAR_CLASSES)}, {' and '.join(MODES)}"
        )
    if quant.get("use_rms_norm"):
        raise UnsupportedError(
            f"{path}: quantization_config's use_rms_norm (an RMSNorm inside each BitLinear) "
            "is not supported"
        )
    kept = [m for m in quant.get("modules_to_not_convert") or [] if not m.startswith("lm_head")]
    if kept:
        raise UnsupportedError(
            f"{path}: quantization_config leaves {', '.join(kept)} unquantized; llmrun "
            "supports BitNet folders whose every projection is ternary"
        )
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".weight") and n[:-7].endswith(PROJECTIONS)]:
        scale_name = f"{name}_scale"
        if mode == "online" and linear == "autobitlinear":
            out[name] = weight(_ternarized(weights[name].tensor))
            continue
        if scale_name not in weights:
            raise ModelFormatError(f"{path}: {name} has no {scale_name}")
        scale = weights[scale_name].tensor
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise ModelFormatError(
                f"{path}: {scale_name} is {scale.dtype} {list(scale.shape)}, not one float"
            )
        stored = weights[name].tensor
        if stored.dtype == torch.uint8:
            try:
                ternary = unpack_ternary(stored)
            except ModelFormatError as e:
                raise ModelFormatError(f"{path}: {name}: {e}") from None
        elif linear == "autobitlinear":
            ternary = stored.float()  # transformers takes an unpacked weight as it is
        else:
            raise ModelFormatError(
                f"{path}: {name} is {stored.dtype}; a BitLinear weight is packed uint8"
            )
        value = scale.float().reshape(())
        # BitLinear divides its products by weight_scale; AutoBitLinear multiplies them.
        factor = 1 / value if linear == "bitlinear" else value
        if str(scale.dtype) in HALF_SCALES and ternary.shape[-1] % TQ2_0_BLOCK == 0:
            blocks = tq2_0_blocks(ternary, factor)
            out[name] = weight(blocks, GGMLQuantizationType.TQ2_0, tuple(ternary.shape))
        else:
            out[name] = weight((ternary * factor).to(scale.dtype))
        del out[scale_name]
    return out


def tq2_0_blocks(ternary: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Ternary weights [R, C] (C a multiple of 256) times `factor` as TQ2_0 blocks, uint8
    [R, C / 256 * 66]: per 256 weights 64 bytes of 2-bit codes t + 1 (weight 128 h + 32 l
    + k in bits 2 l, 2 l + 1 of byte 32 h + k), then d = factor as f16."""
    import torch

    rows = ternary.shape[0]
    # [R, C] -> [R, blocks, h 2, l 4, k 32]
    codes = (ternary + 1).to(torch.uint8).reshape(rows, -1, 2, 4, 32)
    qs = sum(codes[:, :, :, level] << (2 * level) for level in range(4)).reshape(rows, -1, 64)
    d = factor.to(torch.float16).reshape(1, 1, 1).expand(rows, qs.shape[1], 1)
    return torch.cat([qs, d.contiguous().view(torch.uint8)], dim=-1).reshape(rows, -1)


def _ternarized(master: torch.Tensor) -> torch.Tensor:
    """AutoBitLinear "online"'s WeightQuant: the weights rounded to -1, 0, 1 times their
    mean magnitude (at least 1e-5), computed in float32, in the weights' type."""

    w = master.float()
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return ((w * scale).round().clamp(-1, 1) / scale).to(master.dtype)


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """The bitnet graph's settings in the HF-style config config_from_gguf built: a
    SiLU gate, the embedding as the output head, no biases (llama.cpp loads none)."""
    for name in ("output.weight", "blk.0.attn_q.bias", "blk.0.attn_output.bias"):
        if name in gg.tensors:
            raise ModelFormatError(
                f"{gg.path}: tensor {name!r} is not read by llama.cpp's bitnet graph "
                f"(the token embedding is its output head; no projection has a bias)"
            )
    config.update(hidden_act="silu", tie_word_embeddings=True)

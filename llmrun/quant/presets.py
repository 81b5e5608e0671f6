"""llama-quantize's presets (Q4_K_M, IQ4_XS, IQ2_M, ...) and the GGML type each tensor of a
model gets under one, chosen exactly as llama.cpp chooses it (src/llama-quant.cpp:
tensor_allows_quantization, llama_tensor_get_type and its callers).

Every preset but MXFP4_MOE is here. Which tensor stays as it is, which gets more bits
(attn_v and ffn_down by layer, output.weight, GQA and 8-expert models, and where an
importance matrix is given or not), and the fallback where a row length is not a multiple
of the type's block all follow llama.cpp, as does the order of the tensors (non-layer
tensors first, then each layer's, by name), on which the layer counters depend. So does
the refusal of a mix whose very low-bit tensors need an importance matrix when none is
given (tensor_requires_imatrix).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError

T = GGMLQuantizationType
F = LlamaFileType

# The presets llmrun writes, by llama-quantize's name, with their file type and default
# tensor type (llama_ftype_get_default_type); Q3_K, Q4_K and Q5_K are its aliases of the
# _M mixes.
PRESETS: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "F32": (F.ALL_F32, T.F32),
    "F16": (F.MOSTLY_F16, T.F16),
    "BF16": (F.MOSTLY_BF16, T.BF16),
    "Q8_0": (F.MOSTLY_Q8_0, T.Q8_0),
    "Q4_0": (F.MOSTLY_Q4_0, T.Q4_0),
    "Q4_1": (F.MOSTLY_Q4_1, T.Q4_1),
    "Q5_0": (F.MOSTLY_Q5_0, T.Q5_0),
    "Q5_1": (F.MOSTLY_Q5_1, T.Q5_1),
    "Q2_K": (F.MOSTLY_Q2_K, T.Q2_K),
    "Q3_K_S": (F.MOSTLY_Q3_K_S, T.Q3_K),
    "Q3_K_M": (F.MOSTLY_Q3_K_M, T.Q3_K),
    "Q3_K_L": (F.MOSTLY_Q3_K_L, T.Q3_K),
    "Q4_K_S": (F.MOSTLY_Q4_K_S, T.Q4_K),
    "Q4_K_M": (F.MOSTLY_Q4_K_M, T.Q4_K),
    "Q5_K_S": (F.MOSTLY_Q5_K_S, T.Q5_K),
    "Q5_K_M": (F.MOSTLY_Q5_K_M, T.Q5_K),
    "Q6_K": (F.MOSTLY_Q6_K, T.Q6_K),
    "Q2_K_S": (F.MOSTLY_Q2_K_S, T.Q2_K),
    "IQ4_NL": (F.MOSTLY_IQ4_NL, T.IQ4_NL),
    "IQ4_XS": (F.MOSTLY_IQ4_XS, T.IQ4_XS),
    "IQ3_M": (F.MOSTLY_IQ3_M, T.IQ3_S),
    "IQ3_S": (F.MOSTLY_IQ3_S, T.IQ3_S),
    "IQ3_XS": (F.MOSTLY_IQ3_XS, T.IQ3_S),
    "IQ3_XXS": (F.MOSTLY_IQ3_XXS, T.IQ3_XXS),
    "IQ2_M": (F.MOSTLY_IQ2_M, T.IQ2_S),
    "IQ2_S": (F.MOSTLY_IQ2_S, T.IQ2_XS),
    "IQ2_XS": (F.MOSTLY_IQ2_XS, T.IQ2_XS),
    "IQ2_XXS": (F.MOSTLY_IQ2_XXS, T.IQ2_XXS),
    "IQ1_M": (F.MOSTLY_IQ1_M, T.IQ1_M),
    "IQ1_S": (F.MOSTLY_IQ1_S, T.IQ1_S),
    "TQ2_0": (F.MOSTLY_TQ2_0, T.TQ2_0),
    "TQ1_0": (F.MOSTLY_TQ1_0, T.TQ1_0),
}
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
# llama-quantize's presets llmrun cannot write (no quantizer for their types here).
NOT_WRITTEN = ("MXFP4_MOE",)
# The tensor types llmrun writes (llmrun/native/quantize.c, quantize_iq.c), for
# --output-tensor-type and --token-embedding-type too.
WRITABLE = frozenset(
    {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
    | {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
    | {T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS}
    | {T.TQ1_0, T.TQ2_0}
)
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
# A 256-weight block type's type where a row is not a whole number of its blocks
# (tensor_type_fallback); a 32-weight one that does not fit, and these where theirs does
# not, become F16.
FALLBACK = {
    **dict.fromkeys([T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S], T.IQ4_NL),
    **dict.fromkeys([T.IQ3_XXS, T.IQ3_S, T.IQ4_XS], T.IQ4_NL),
    **dict.fromkeys([T.Q2_K, T.Q3_K, T.TQ1_0, T.TQ2_0], T.Q4_0),
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}
# The tensor types that need an importance matrix (tensor_requires_imatrix), Q2_K only in
# a Q2_K_S mix; never token_embd.weight, per_layer_token_embd.weight or output.weight.
_NEED_IMATRIX = frozenset({T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS})
_NO_IMATRIX_NAMES = ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")
# llama.cpp's IQ1 and IQ2 mixes, which share one set of rules.
_VERY_LOW_BIT = (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)
_VERY_LOW_BIT += (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M)

# Names of tensors never quantized (llama.cpp's tensor_allows_quantization).
_KEPT_PARTS = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    *(
        f"time_mix_{part}.weight"
        for part in "first w0 w1 w2 v0 v1 v2 a0 a1 a2 g1 g2 decay_w1 decay_w2 lerp_fused".split()
    ),
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
_KEPT_NAMES = ("position_embd.weight", "token_types.weight")
_KEPT_GLM5_NEXT = (
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    *(f"{name}.weight" for name in "ssm_f_a ssm_f_b ssm_g_a ssm_g_b ssm_beta".split()),
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
)
_GLM5_NEXT_Q8 = ("attn_q_a", "attn_q_b", "nextn.eh_proj")
_LAYER = re.compile(r"blk\.\s*([+-]?\d+)")  # as C's sscanf(name, "blk.%d.") reads it


@dataclass(frozen=True)
class Preset:
    name: str  # as llama-quantize spells it
    file_type: LlamaFileType  # general.file_type of the output
    default_type: GGMLQuantizationType


@dataclass(frozen=True)
class Model:
    """What the rules read of a model's metadata."""

    arch: str
    n_layer: int  # {arch}.block_count
    n_head: int  # of the first layer
    n_head_kv: int
    n_expert: int

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B, which gives attn_v more bits."""
        if self.arch == "llama":
            return self.n_expert != 8 and self.n_layer == 80 and self.n_head != self.n_head_kv
        return (self.arch in ("qwen2", "deci", "olmo") and self.n_layer == 80) or (
            self.arch == "jais2" and self.n_layer == 68
        )


@dataclass(frozen=True)
class Overrides:
    """llama-quantize's options that change the types chosen."""

    leave_output_tensor: bool = False  # keep output.weight's type
    pure: bool = False  # every quantized tensor the default type (no mix)
    output_tensor_type: GGMLQuantizationType | None = None
    token_embedding_type: GGMLQuantizationType | None = None


def parse_preset(name: str) -> Preset:
    """A preset by llama-quantize's name, in any case (`q4_k_m`)."""
    key = name.upper()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return Preset(key, *PRESETS[key])
    if key in NOT_WRITTEN:
        raise UnsupportedError(f"llmrun quantize cannot write {key} yet; choose from {_names()}")
    raise UsageError(f"unknown quantization type {name!r}; choose from {_names()}")


def parse_tensor_type(name: str, option: str) -> GGMLQuantizationType:
    """A GGML tensor type by name, in any case (`q6_K`), for `option`."""
    found = next((t for t in GGMLQuantizationType if t.name == name.upper()), None)
    if found is None:
        raise UsageError(f"{option}: unknown tensor type {name!r}")
    if found not in WRITABLE:
        raise UnsupportedError(
            f"{option}: llmrun quantize cannot write {found.name}; choose from "
            + ", ".join(t.name for t in sorted(WRITABLE))
        )
    return found


def _names() -> str:
    return ", ".join(PRESETS)


def block_size(ggml_type: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[ggml_type][0]


def is_quantized(ggml_type: GGMLQuantizationType) -> bool:
    """A block type (ggml_is_quantized), as against F32, F16, BF16 and the integer types."""
    return block_size(ggml_type) > 1


def layer_of(name: str) -> int:
    """The layer a tensor belongs to (blk.N.), -1 for none."""
    found = _LAYER.match(name)
    return int(found.group(1)) if found else -1


def tensor_order(names: Iterable[str]) -> list[str]:
    """Tensor names in the order llama.cpp writes them: by layer (none first), then name."""
    return sorted(names, key=lambda name: (layer_of(name), name.encode("utf-8", "surrogateescape")))


def n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one longer than 1 (`ne` fastest first)."""
    return max([1] + [i + 1 for i, n in enumerate(ne) if n > 1])


def allows_quantization(name: str, ne: tuple[int, ...], arch: str, overrides: Overrides) -> bool:
    """Whether a tensor may get another type at all (else it is copied as it is)."""
    if n_dims(ne) < 2 or not name.endswith("weight"):
        return False
    if overrides.leave_output_tensor and name == "output.weight":
        return False
    if name in _KEPT_NAMES or any(part in name for part in _KEPT_PARTS):
        return False
    return not (arch == "glm5-next" and any(part in name for part in _KEPT_GLM5_NEXT))


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, category in (
        ("attn_qkv.weight", "attn_v"),  # the attn_v-like ones get attn_v's rules
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return category
    return "other"


def _more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third."""
    return (
        i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2
    )


class _Counters:
    """The running counts of attn_v and ffn_* tensors that the layer rules read."""

    def __init__(self, names: list[str], n_layer: int) -> None:
        self.n_attention_wv = sum(_category(name) == "attn_v" for name in names)
        self.n_ffn = n_layer
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0


def _layer_info(model: Model, counter: int, n_layer: int, name: str) -> tuple[int, int]:
    """The layer and layer count a ffn rule reads: the running count, or with experts
    (which llama.cpp found are not in layer order in some files) the layer in the name."""
    if max(1, model.n_expert) == 1:
        return counter, n_layer
    found = _LAYER.match(name)
    if found is None:
        raise ModelFormatError(f"failed to determine the layer of tensor {name!r}")
    i_layer = int(found.group(1))
    if not 0 <= i_layer < n_layer:
        raise ModelFormatError(
            f"bad layer {i_layer} for tensor {name!r}: must be in [0, {n_layer})"
        )
    return i_layer, n_layer


# The mixes whose attn_output is Q5_K in a model of 8 experts.
_Q5_K_ATTN_OUTPUT_WITH_8_EXPERTS = (
    *(F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M),
    *(F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_IQ3_S, F.MOSTLY_IQ3_M),
    *(F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS),
)


def _mixed_type(
    model: Model,
    preset: Preset,
    overrides: Overrides,
    counters: _Counters,
    tied: bool,
    name: str,
    ne: tuple[int, ...],
    has_imatrix: bool,
) -> GGMLQuantizationType:
    """llama_tensor_get_type_impl: the preset's mix."""
    ft, new_type, cat, arch = preset.file_type, preset.default_type, _category(name), model.arch
    if arch == "glm5-next" and any(part in name for part in _GLM5_NEXT_Q8):
        return T.Q8_0
    if cat == "output" or (tied and cat == "token_embd"):
        if overrides.output_tensor_type is not None:
            return overrides.output_tensor_type
        if arch == "falcon" or ne[0] % block_size(new_type):
            return T.Q8_0
        if ft in (*_VERY_LOW_BIT, F.MOSTLY_IQ3_XXS):
            return T.Q5_K
        return T.Q6_K if new_type != T.Q8_0 else new_type
    if cat == "token_embd":
        if ft in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
            return T.Q2_K
        if ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ3_XXS):
            return T.IQ3_S
        return T.Q4_K if ft in (F.MOSTLY_TQ1_0, F.MOSTLY_TQ2_0) else new_type
    if ft in _VERY_LOW_BIT:
        return _very_low_bit_type(model, ft, new_type, counters, cat)
    gqa4 = model.n_gqa >= 4
    if cat == "attn_v":
        i, n = counters.i_attention_wv, counters.n_attention_wv
        if ft == F.MOSTLY_Q2_K:
            new_type = T.Q4_K if gqa4 else T.Q3_K
        elif ft == F.MOSTLY_Q2_K_S and gqa4:
            new_type = T.Q4_K
        elif ft == F.MOSTLY_IQ3_XXS:
            new_type = T.Q4_K if gqa4 else T.IQ3_XXS if has_imatrix else T.IQ3_S
        elif ft in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S) and gqa4:
            new_type = T.Q4_K
        elif ft == F.MOSTLY_IQ3_M:
            new_type = T.Q4_K
        elif ft == F.MOSTLY_Q3_K_M:
            new_type = T.Q5_K if i < 2 else T.Q4_K
        elif ft == F.MOSTLY_Q3_K_L:
            new_type = T.Q5_K
        elif ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and gqa4:
            new_type = T.Q5_K
        elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i, n):
            new_type = T.Q6_K
        elif ft == F.MOSTLY_Q4_K_S and i < 4:
            new_type = T.Q5_K
        if model.is_70b and new_type in (T.Q3_K, T.Q4_K):
            new_type = T.Q5_K
        if model.n_expert == 8:
            new_type = T.Q8_0
        counters.i_attention_wv += 1
    elif cat in ("attn_k", "attn_q"):
        if cat == "attn_k" and model.n_expert == 8:
            new_type = T.Q8_0
        elif ft == F.MOSTLY_IQ3_XS:
            new_type = T.IQ3_XXS
        elif ft == F.MOSTLY_IQ3_XXS:
            new_type = T.IQ2_S
    elif cat == "ffn_down":
        i, n = _layer_info(model, counters.i_ffn_down, counters.n_ffn, name)
        if ft == F.MOSTLY_Q2_K:
            new_type = T.Q3_K
        elif ft == F.MOSTLY_Q2_K_S:
            new_type = T.Q4_K if i < n // 8 else new_type
        elif ft == F.MOSTLY_IQ3_XXS and not has_imatrix:
            new_type = T.Q4_K if i < n // 8 else T.Q3_K
        elif ft == F.MOSTLY_Q3_K_M:
            new_type = (
                T.Q5_K
                if i < n // 16
                else T.Q4_K
                if arch != "falcon" or _more_bits(i, n)
                else T.Q3_K
            )
        elif ft == F.MOSTLY_IQ3_M and (i < n // 8 or (model.n_expert == 8 and _more_bits(i, n))):
            new_type = T.Q4_K
        elif ft == F.MOSTLY_Q3_K_L:
            new_type = T.Q4_K if arch == "falcon" else T.Q5_K
        elif ft == F.MOSTLY_Q4_K_M:
            if arch == "falcon":
                new_type = T.Q6_K if i < n // 16 else T.Q5_K if _more_bits(i, n) else T.Q4_K
            elif _more_bits(i, n):
                new_type = T.Q6_K
        elif i < n // 8 and ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and not has_imatrix:
            new_type = T.Q5_K
        elif ft == F.MOSTLY_Q5_K_M and _more_bits(i, n):
            new_type = T.Q6_K
        elif ft == F.MOSTLY_Q4_K_S and arch != "falcon" and i < n // 8:
            new_type = T.Q5_K
        elif ft in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and has_imatrix and i < n // 8:
            # llama.cpp's guard for the first ffn_down layers, with an imatrix only
            new_type = T.Q4_1 if ft == F.MOSTLY_Q4_0 else T.Q5_1
        counters.i_ffn_down += 1
    elif cat == "attn_output":
        if arch == "falcon":
            new_type = T.Q4_K if ft == F.MOSTLY_Q3_K_L else new_type
        elif model.n_expert == 8:
            new_type = T.Q5_K if ft in _Q5_K_ATTN_OUTPUT_WITH_8_EXPERTS else new_type
        else:
            new_type = {
                F.MOSTLY_Q2_K: T.Q3_K,
                F.MOSTLY_IQ3_XXS: T.IQ3_S,
                F.MOSTLY_Q3_K_M: T.Q4_K,
                F.MOSTLY_Q3_K_L: T.Q5_K,
                F.MOSTLY_IQ3_M: T.Q4_K,
            }.get(ft, new_type)
    elif cat in ("ffn_gate", "ffn_up"):
        counter = "i_ffn_gate" if cat == "ffn_gate" else "i_ffn_up"
        i, n = _layer_info(model, getattr(counters, counter), counters.n_ffn, name)
        if ft == F.MOSTLY_IQ3_XS and n // 8 <= i < 7 * n // 8:
            new_type = T.IQ3_XXS
        setattr(counters, counter, getattr(counters, counter) + 1)
    return new_type


def _very_low_bit_type(
    model: Model, ft: LlamaFileType, new_type: GGMLQuantizationType, counters: _Counters, cat: str
) -> GGMLQuantizationType:
    """The IQ1 and IQ2 mixes' rules for the layers' tensors (by running count only)."""
    two_bit_s = ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)
    if cat == "attn_v":
        if model.n_gqa >= 4 or model.n_expert >= 4:
            new_type = T.Q4_K
        else:
            new_type = T.IQ3_S if two_bit_s else T.Q2_K
        counters.i_attention_wv += 1
    elif model.n_expert == 8 and cat == "attn_k":
        new_type = T.Q4_K
    elif cat == "ffn_down":
        if counters.i_ffn_down < counters.n_ffn // 8:
            new_type = T.IQ3_S if two_bit_s else T.Q2_K
        counters.i_ffn_down += 1
    elif cat == "attn_output":
        if model.n_expert == 8:
            new_type = T.Q5_K
        elif ft in (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
            new_type = T.IQ2_XXS
        elif two_bit_s:
            new_type = T.IQ3_S
    return new_type


def _fallback(ggml_type: GGMLQuantizationType, n_cols: int) -> GGMLQuantizationType:
    """A type whose blocks fit a row of `n_cols` (tensor_type_fallback)."""
    if n_cols % block_size(ggml_type) == 0:
        return ggml_type
    smaller = FALLBACK.get(ggml_type, ggml_type)
    return smaller if n_cols % block_size(smaller) == 0 else T.F16


def requires_imatrix(name: str, ggml_type: GGMLQuantizationType, preset: Preset) -> bool:
    """Whether a tensor quantized to `ggml_type` under `preset` needs an importance matrix
    (tensor_requires_imatrix): llama-quantize refuses the mix without one."""
    if name in _NO_IMATRIX_NAMES:
        return False
    if ggml_type == T.Q2_K:
        return preset.file_type == F.MOSTLY_Q2_K_S
    return ggml_type in _NEED_IMATRIX


def choose_types(
    tensors: list[tuple[str, GGMLQuantizationType, tuple[int, ...]]],
    model: Model,
    preset: Preset,
    overrides: Overrides = Overrides(),
    has_imatrix: bool = False,
) -> list[GGMLQuantizationType]:
    """The type of each tensor (name, type, shape with the fastest dimension first, in
    tensor_order) under `preset`: its own where it stays as it is. Without an importance
    matrix (`has_imatrix`), a mix that would give a tensor a type that needs one is
    refused, naming the first such tensor."""
    names = [name for name, _, _ in tensors]
    counters = _Counters(names, model.n_layer)
    tied = "output.weight" not in names
    chosen = []
    for name, ggml_type, ne in tensors:
        if not allows_quantization(name, ne, model.arch, overrides):
            chosen.append(ggml_type)
            continue
        cat = _category(name)
        if overrides.token_embedding_type is not None and cat == "token_embd":
            new_type = overrides.token_embedding_type
        elif overrides.output_tensor_type is not None and cat == "output":
            new_type = overrides.output_tensor_type
        elif is_quantized(preset.default_type):
            new_type = preset.default_type
            if not overrides.pure:
                new_type = _mixed_type(
                    model, preset, overrides, counters, tied, name, ne, has_imatrix
                )
            new_type = _fallback(new_type, ne[0])
        else:
            new_type = preset.default_type
        if ne[0] % block_size(new_type):
            raise UsageError(
                f"tensor {name!r} has rows of {ne[0]} weights, not a whole number of "
                f"{new_type.name} blocks of {block_size(new_type)}"
            )
        if not has_imatrix and requires_imatrix(name, new_type, preset):
            raise UsageError(
                f"{preset.name} needs an importance matrix: tensor {name!r} would be "
                f"{new_type.name}; pass --imatrix FILE (made by llmrun imatrix or llama-imatrix)"
            )
        chosen.append(new_type)
    return chosen

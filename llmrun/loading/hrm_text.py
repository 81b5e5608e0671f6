"""HRM-Text checkpoints at the loader edge: the Hub's folders, and GGUFs (arch
"hrm_text") as llama.cpp's converter writes them (conversion/hrm_text.py HrmTextModel),
read as src/models/hrm-text.cpp reads them.

The Hub's safetensors (and what transformers saves) hold each layer's attention
projections as one attn.gqkv_proj (rows: gate, q, k, v), its MLP's as mlp.gate_up_proj
(gate, up) and its output as attn.o_proj; hf_weights splits and renames them as
transformers' conversion_mapping does, into views of the file's tensors.

The file holds 2 * layers_per_stack blocks: the L stack's layers first, then the H
stack's (blk.{layers_per_stack + i} is H_module.layers.i), each with its attention gate
as attn_gate and no norm (every norm is weightless), plus the low state's start as
hrm.z_l_init. block_count is the KV cache's entry count, layers_per_stack * h_cycles *
(l_cycles + 1), as transformers' num_hidden_layers is; llama.cpp refuses a file where
they differ, and so does llmrun. q/k rows are as transformers holds them (llama.cpp
rotates hrm_text with NEOX RoPE); no head_count_kv: every head has its own keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name, vocab_size

# gguf-py's MODEL_ARCH.HRM_TEXT and Keys.HRM (newer than the gguf package llmrun depends on).
ARCH = MODEL_TYPE = "hrm_text"
LAYERS_PER_STACK = "{arch}.hrm.layers_per_stack"
H_CYCLES = "{arch}.hrm.h_cycles"
L_CYCLES = "{arch}.hrm.l_cycles"
PREFIX_LM = "{arch}.hrm.prefix_lm"
Z_L_INIT = (
    "hrm.z_l_init"  # gguf-py's TENSOR_NAMES[MODEL_TENSOR.HRM_Z_L_INIT], written without a suffix
)
_GATE = layer_name(MODEL_TENSOR.ATTN_GATE)
_LAYER = "model.layers."
# The Hub's fused tensors -> the ones transformers (and llmrun's model) splits them into.
_FUSED = {
    ".attn.gqkv_proj.weight": (
        ".self_attn.gate_proj.weight",
        ".self_attn.q_proj.weight",
        ".self_attn.k_proj.weight",
        ".self_attn.v_proj.weight",
    ),
    ".mlp.gate_up_proj.weight": (".mlp.gate_proj.weight", ".mlp.up_proj.weight"),
}


def hf_weights(weights: dict[str, Any], path: Any, weight_type: type) -> dict[str, Any]:
    """A folder's (`path`'s) weights under transformers' names: the fused projections
    split into equal row blocks (views), attn.o_proj renamed self_attn.o_proj.
    `weight_type` is the loader's Weight."""
    out = {}
    for name, weight in weights.items():
        suffix = next((s for s in _FUSED if name.endswith(s)), None)
        if suffix is None:
            out[name.replace(".attn.o_proj.", ".self_attn.o_proj.")] = weight
            continue
        parts = _FUSED[suffix]
        rows = weight.tensor.shape[0]
        if weight.tensor.dim() != 2 or rows % len(parts):
            raise ModelFormatError(
                f"{path}: {name} has shape {list(weight.tensor.shape)}; HRM-Text stacks "
                f"{len(parts)} equal blocks of rows in it"
            )
        prefix = name.removesuffix(suffix)
        for part, block in zip(parts, weight.tensor.chunk(len(parts)), strict=True):
            out[prefix + part] = weight_type(block)
    return out


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (HrmTextConfig's fields) of an hrm_text GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    per_stack, h_cycles, l_cycles = (
        meta.require(key) for key in (LAYERS_PER_STACK, H_CYCLES, L_CYCLES)
    )
    blocks = meta.require(Keys.LLM.BLOCK_COUNT)
    sizes = (hidden, heads, per_stack, h_cycles, l_cycles, blocks)
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        raise ModelFormatError(
            f"{gg.path}: an embedding length of {hidden!r}, {heads!r} heads, {per_stack!r} "
            f"layers a stack, {h_cycles!r} H and {l_cycles!r} L cycles and {blocks!r} blocks "
            "are not all positive whole numbers"
        )
    if blocks != per_stack * h_cycles * (l_cycles + 1):
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.BLOCK_COUNT)} is {blocks}, not layers_per_stack "
            f"x h_cycles x (l_cycles + 1) = {per_stack} x {h_cycles} x {l_cycles + 1}"
        )
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    if kv_heads != heads:
        raise ModelFormatError(
            f"{gg.path}: {kv_heads} key/value heads for {heads} heads; HRM-Text's attention "
            "gives every head its own"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": blocks,
        "num_layers_per_stack": per_stack,
        "H_cycles": h_cycles,
        "L_cycles": l_cycles,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        # llama.cpp's default where the file has none: no scaling.
        "embedding_scale": meta.get(Keys.LLM.EMBEDDING_SCALE, 1.0),
        "prefix_lm": bool(meta.get(PREFIX_LM, False)),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": False,
        "rope_parameters": rope_from_gguf(gg, meta, head_dim, context),
    }


def hf_name(gguf_name: str) -> str | None:
    """The HF-style name of HRM-Text's own tensors (the low state's start, the attention
    gates: blocks still numbered as the file numbers them, see gguf_weights), else None."""
    if gguf_name == Z_L_INIT:
        return "model.z_L_init"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] == _GATE and parts[3] == "weight":
        return f"{_LAYER}{parts[1]}.self_attn.gate_proj.weight"
    return None


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], path: Any) -> dict[str, Any]:
    """The file's (`path`'s) blocks under the stacks' names: blk.i the L stack's layer i,
    blk.(n + i) the H stack's (n: layers_per_stack); a block past them is refused."""
    per_stack = config["num_layers_per_stack"]
    named = {}
    for name, weight in weights.items():
        if name.startswith(_LAYER):
            block, _, rest = name.removeprefix(_LAYER).partition(".")
            index = int(block)
            if index >= 2 * per_stack:
                raise ModelFormatError(
                    f"{path}: block {index} is past the {2 * per_stack} that HRM-Text's two stacks of "
                    f"{per_stack} layers hold ({TENSOR_NAMES[MODEL_TENSOR.ATTN_Q].format(bid=index)})"
                )
            stack = "L" if index < per_stack else "H"
            name = f"model.{stack}_module.layers.{index % per_stack}.{rest}"
        named[name] = weight
    return named

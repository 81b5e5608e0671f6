"""StarCoder2 GGUFs (arch "starcoder2") as llama.cpp's converter writes them
(conversion/starcoder.py StarCoder2Model: TextModel's keys, the LayerNorms' epsilon as
attention.layer_norm_epsilon, q/k rows as they are, since llama.cpp turns StarCoder2
with NEOX RoPE) and as src/models/starcoder2.cpp reads them: LayerNorms with a bias,
biased projections, a GELU feed-forward (ffn_up, ffn_down) without a gate, RoPE on whole
heads, the output matrix token_embd's where the file has none, and no sliding window
(llama.cpp reads none for StarCoder2, and the converter writes none).

Also the shape keys Phi-2's files share (shape_config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = MODEL_TYPE = "starcoder2"
# llama.cpp's LLM_FFN_GELU: GELU's tanh approximation.
GELU_TANH = "gelu_pytorch_tanh"
_LAYER = {
    MODEL_TENSOR.ATTN_NORM: "input_layernorm",
    MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
    MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
    MODEL_TENSOR.FFN_UP: "mlp.c_fc",
    MODEL_TENSOR.FFN_DOWN: "mlp.c_proj",
}
_GLOBAL = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
}
ROPE_FACTORS = tuple(
    TENSOR_NAMES[t] + ".weight"
    for t in (
        MODEL_TENSOR.ROPE_FREQS,
        MODEL_TENSOR.ROPE_FACTORS_LONG,
        MODEL_TENSOR.ROPE_FACTORS_SHORT,
    )
)


def name_table(layer: dict, names: dict) -> Callable[[str], str | None]:
    """hf_name for a family: `layer` maps blk.N.<MODEL_TENSOR> to model.layers.N.<module>,
    `names` the whole-model tensors to theirs; anything else is None."""
    modules = {TENSOR_NAMES[t].split(".")[-1]: module for t, module in layer.items()}
    whole = {TENSOR_NAMES[t]: module for t, module in names.items()}

    def hf_name(gguf_name: str) -> str | None:
        base, _, suffix = gguf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if base in whole:
            return f"{whole[base]}.{suffix}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in modules:
            return f"model.layers.{parts[1]}.{modules[parts[2]]}.{suffix}"
        return None

    return hf_name


hf_name = name_table(_LAYER, _GLOBAL)


def shape_config(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """The HF-style fields a starcoder2 or phi2 file gives alike, read as llama.cpp's
    load_hparams reads them (each family's load_arch_hparams requires the LayerNorm's
    epsilon): sizes, head counts, head width, epsilon, context, vocabulary, RoPE.
    Refuses RoPE factor tensors, which neither graph applies."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    for name in ROPE_FACTORS:
        if name in gg.tensors:
            raise UnsupportedError(
                f"{path}: tensor {name!r} is not part of llama.cpp's {arch} model, "
                "which llmrun follows"
            )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not (isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0):
        raise ModelFormatError(
            f"{path}: an embedding length of {hidden!r} and a head count of {n_heads!r} "
            "are not positive whole numbers"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{path}: keys and values of different lengths are not supported")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    return {
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "layer_norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "rope_parameters": rope_from_gguf(gg, meta, head_dim, context),
    }


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style starcoder2 config from a GGUF's metadata. `rope_from_gguf` is
    gguf_config's reader of the RoPE keys. Refuses partial RoPE, which llama.cpp's graph
    asserts away."""
    config = shape_config(gg, rope_from_gguf)
    rope = config["rope_parameters"]
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} rotates "
            f"{round(rope['partial_rotary_factor'] * config['head_dim'])} of "
            f"{config['head_dim']} features a head; StarCoder2 rotates them all"
        )
    out_bias = TENSOR_NAMES[MODEL_TENSOR.ATTN_OUT].format(bid=0) + ".bias"
    config.update(
        model_type=MODEL_TYPE,
        norm_epsilon=config.pop("layer_norm_eps"),
        hidden_act=GELU_TANH,
        use_bias=out_bias in gg.tensors,
        tie_word_embeddings=TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
    )
    return config

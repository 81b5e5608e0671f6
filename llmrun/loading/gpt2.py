"""GPT-2 at the loader edge: "gpt2" GGUFs as llama.cpp's converter writes them
(conversion/gpt2.py GPT2Model) and llama.cpp reads them (src/models/gpt2.cpp), and the
Hub's checkpoints (transformer.wte, h.N.attn.c_attn, ... with Conv1D matrices stored
[in, out]; the oldest files without the transformer. prefix) under llmrun's names
(llmrun/models/gpt2.py); GPT-J's checkpoints (transformer.wte, h.N, ln_f) likewise.

The converter writes context, embedding and feed-forward (4 * n_embd) lengths, the block
and head counts and attention.layer_norm_epsilon (which llama.cpp requires); it
transposes the Conv1D matrices into the usual [out, in] and leaves c_attn's rows (all
queries, all keys, all values) as they are. llama.cpp adds position_embd's rows at the
tokens' positions, scales scores by 1/sqrt(head width), and its GELU is the tanh one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES

from llmrun.errors import UnsupportedError
from llmrun.loading import starcoder2

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "gpt2"
# GPT-J's checkpoints share GPT-2's module names (no Conv1D, the same mask buffers).
HF_MODEL_TYPES = (MODEL_TYPE, "gptj")
hf_name = starcoder2.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: "ln_1",
        MODEL_TENSOR.ATTN_QKV: "attn.c_attn",
        MODEL_TENSOR.ATTN_OUT: "attn.c_proj",
        MODEL_TENSOR.FFN_NORM: "ln_2",
        MODEL_TENSOR.FFN_UP: "mlp.c_fc",
        MODEL_TENSOR.FFN_DOWN: "mlp.c_proj",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
        MODEL_TENSOR.POS_EMBD: "model.position_embeddings",
        MODEL_TENSOR.OUTPUT_NORM: "model.norm",
        MODEL_TENSOR.OUTPUT: "lm_head",
    },
)
# The Hub's module names (after transformer.) -> llmrun's.
_HUB_NAMES = {
    "wte.": "model.embed_tokens.",
    "wpe.": "model.position_embeddings.",
    "h.": "model.layers.",
    "ln_f.": "model.norm.",
}
# Conv1D matrices, stored [in, out].
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# The attention's mask buffers older checkpoints carry: not weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style gpt2 config from a gpt2 GGUF's metadata, as llama_model_gpt2 reads it
    (the LayerNorms' epsilon required). Refuses heads other than GPT-2's: as many KV heads
    as heads, hidden size / heads wide."""
    config = starcoder2.shape_config(gg, rope_from_gguf)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["num_key_value_heads"] != heads or config["head_dim"] * heads != hidden:
        raise UnsupportedError(
            f"{gg.path}: a gpt2 model of {heads} heads with {config['num_key_value_heads']} "
            f"KV heads of {config['head_dim']} features in {hidden} is not supported "
            "(GPT-2 has as many KV heads as heads, of hidden size / heads features)"
        )
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "n_inner": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "layer_norm_epsilon": config["layer_norm_eps"],
        "activation_function": "gelu_new",  # llama.cpp's LLM_FFN_GELU: the tanh form
        "tie_word_embeddings": TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
    }


def hf_weights(weights: dict[str, Any], weight_type: type) -> dict:
    """A Hub checkpoint's tensors under llmrun's names, the Conv1D matrices transposed to
    [out, in], without the attention's mask buffers."""
    out = {}
    for name, w in weights.items():
        if name.endswith(_BUFFERS):
            continue
        name = name.removeprefix("transformer.")
        for old, new in _HUB_NAMES.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name.endswith(_CONV1D):
            w = weight_type(w.tensor.t().contiguous())
        out[name] = w
    return out

"""Ling 1 (the Hub's BailingMoeForCausalLM, model_type bailing_moe; GGUF arch bailingmoe)
against transformers' Qwen2MoeForCausalLM of the same weights: transformers has no Ling,
and its published code (modeling_bailing_moe.py) computes what Qwen2-MoE computes under
other names, but for Qwen2-MoE's sigmoid gate on the shared expert: Llama's attention
(q/k/v biases where use_qkv_bias) with RoPE on whole heads, halves turned; dense layers
first (Qwen2-MoE's mlp_only_layers), then the top-k softmax scores' experts,
renormalized where norm_topk_prob, plus shared experts. The reference's shared-expert
gate is zeroed (sigmoid 0.5) and Ling's shared down projection is half of Qwen2-MoE's:
the same products, exactly. Ling weighs one expert a token by its score even where
norm_topk_prob: the reference's top_k stays above one.

Folders as the Hub's checkpoints hold them: config.json with model_type bailing_moe,
Ling's names (model.word_embeddings, attention.query_key_value with all queries' rows
then keys' then values', attention.dense, mlp.shared_experts), one key per expert, and
with norm_head the output matrix as trained (the published code scales its columns to
unit length). GGUFs as llama.cpp's converter writes them (conversion/bailingmoe.py
BailingMoeModel): attn_q, attn_k, attn_v with q and k rows permuted as a Llama's, the
output matrix normalized where norm_head, experts stacked, the rope and expert keys.

Tolerances: f32 logits (within about ±5) 1e-4 max abs, whole and through the KV cache
(chunked prefill, then one token at a time), contiguous or paged; a Q8_0 GGUF against
the reference run on the weights gguf dequantizes: 1e-4.
"""

import json

import numpy as np
import pytest
import test_paged
import torch
from family_checks import check_run_prints_greedy_tokens, check_show, write_keyed_gguf
from gguf import GGMLQuantizationType, Keys
from helpers import _permute, cached_logits, randomize
from moe_helpers import hub_state_dict, round_matrices_but_the_routers

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
SHARED = 2  # Ling's num_shared_experts: Qwen2-MoE's one shared expert is this many wide
# Ling-lite's shape, tiny: no q/k/v biases, 3 of 8 experts renormalized, 2 shared.
QWEN = dict(
    model_type="qwen2_moe",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32 * SHARED,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=3,
    norm_topk_prob=True,
    qkv_bias=False,
    mlp_only_layers=[],
    rope_theta=10000.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
VARIANTS = {
    "lite": {},
    "qkv-bias": dict(qkv_bias=True),
    "dense-first": dict(mlp_only_layers=[0]),  # first_k_dense_replace 1
    "unnormalized": dict(norm_topk_prob=False),
    "norm-head": {},  # the folder's output matrix unnormalized, norm_head true
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str):
    return qwen2_moe(**VARIANTS[name])


def qwen2_moe(**overrides):
    """transformers' Qwen2-MoE of QWEN and `overrides`, randomize()'s weights (attention
    outputs smaller, so that tokens do not look alike to the routers), the shared-expert
    gate 0."""
    config = transformers.AutoConfig.for_model(**{**QWEN, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.03})
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "shared_expert_gate", None)
            if gate is not None:
                gate.weight.zero_()
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def normalize_head(hf) -> None:
    """The published norm_head: each column of the output matrix over its 2-norm + 1e-7."""
    with torch.no_grad():
        w = hf.lm_head.weight
        w.div_(w.norm(p=2, dim=0, keepdim=True) + 1e-7)


def ling_config(hf, name: str) -> dict:
    """The config.json of the Hub's Ling 1 checkpoints for the model's shape."""
    c = hf.config
    return dict(
        architectures=["BailingMoeForCausalLM"],
        model_type="bailing_moe",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        num_experts=c.num_experts,
        num_shared_experts=SHARED,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        first_k_dense_replace=len(c.mlp_only_layers),
        use_qkv_bias=c.qkv_bias,
        use_bias=False,
        norm_head=name == "norm-head",
        rope_theta=c.rope_parameters["rope_theta"],
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def shared_experts_state_dict(hf) -> dict[str, torch.Tensor]:
    """The model's weights under DeepSeek V1's keys (Llama's, one key per expert, the
    shared experts as mlp.shared_experts with half of Qwen2-MoE's down projection: the
    reference's sigmoid(0))."""
    out = {}
    for key, value in hub_state_dict(hf, "qwen2_moe").items():
        if key.endswith("shared_expert_gate.weight"):
            continue
        if key.endswith("shared_expert.down_proj.weight"):
            value = value * 0.5
        out[key.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = value.contiguous()
    return out


def ling_state_dict(hf) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's Ling keys (see the module docstring)."""
    state = shared_experts_state_dict(hf)
    out = {}
    for key, value in state.items():
        if ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        if ".self_attn.q_proj." in key:
            parts = [state[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[key.replace("self_attn.q_proj", "attention.query_key_value")] = torch.cat(parts)
            continue
        key = key.replace("model.embed_tokens.", "model.word_embeddings.")
        key = key.replace(".self_attn.o_proj.", ".attention.dense.")
        out[key] = value
    return out


def save_ling_folder(path, hf, name: str, **config_changes):
    path.mkdir()
    safetensors_torch.save_file(ling_state_dict(hf), str(path / "model.safetensors"))
    config = {**ling_config(hf, name), **config_changes}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_hub_folder_matches_the_reference_whole_and_through_the_cache(tmp_path, name):
    hf = hf_model(name)
    folder = save_ling_folder(tmp_path / "ling", hf, name)
    if name == "norm-head":
        normalize_head(hf)
    expected = reference(hf)
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "bailing_moe"
    with torch.no_grad():
        whole = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (cached_logits(loaded.model, IDS) - expected).abs().max() < 1e-4


def test_paged_cache_gives_the_contiguous_logits(tmp_path):
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py)."""
    hf = hf_model("dense-first")
    model = load_model(save_ling_folder(tmp_path / "ling", hf, "dense-first"), CPU, "f32").model
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(model, "f32")
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(model)


FOLDERS_REFUSED = {
    "output biases": dict(use_bias=True),
    "no use_bias (true by default)": dict(use_bias=None),
    "RoPE scaling": dict(rope_scaling={"type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("case", list(FOLDERS_REFUSED))
def test_a_folder_llmrun_cannot_run_as_published_is_refused(tmp_path, case):
    changes = FOLDERS_REFUSED[case]
    config = {k: v for k, v in changes.items() if v is not None}
    folder = save_ling_folder(tmp_path / "ling", hf_model("lite"), "lite", **config)
    if None in changes.values():
        data = json.loads((folder / "config.json").read_text())
        data = {k: v for k, v in data.items() if k not in changes}
        (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedError):
        load_model(folder, CPU, "f32")


# ---- GGUF, as llama.cpp's converter writes "bailingmoe" ---------------------------------

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
EXPERT_STACKS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def bailingmoe_tensors(hf) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: q and k rows permuted as a Llama's, the
    experts stacked [E, rows, cols], the shared experts as Ling holds them."""
    c = hf.config
    state = hub_state_dict(hf, "qwen2_moe")
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": state["model.norm.weight"].numpy(),
        "output.weight": state["lm_head.weight"].numpy(),
    }
    for layer in range(c.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for key, value in state.items():
            if not key.startswith(prefix) or ".experts." in key or "shared_expert_gate" in key:
                continue
            module, _, suffix = key[len(prefix) :].rpartition(".")
            data = value.numpy()
            if module == "self_attn.q_proj":
                data = _permute(data, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                data = _permute(data, c.num_key_value_heads)
            elif module == "mlp.shared_expert.down_proj":
                data = data * 0.5
            out[f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"] = data
        if layer in c.mlp_only_layers:
            continue
        for projection, name in EXPERT_STACKS.items():
            stack = [
                state[f"{prefix}mlp.experts.{e}.{projection}.weight"].numpy()
                for e in range(c.num_experts)
            ]
            out[f"blk.{layer}.{name}.weight"] = np.stack(stack)
    return out


def write_bailingmoe(path, hf, qtype=None, metadata=None, arch="bailingmoe"):
    """A bailingmoe GGUF of the model: the converter's keys (with `metadata` changed; None
    leaves a key out), its tensors, 2-D and 3-D ones but the router in `qtype` (default
    F32), stories260K's tokenizer; of `arch` (test_deepseek_v1 writes DeepSeek V1's so)."""
    keys = {**converter_keys(hf), **(metadata or {})}
    return write_keyed_gguf(path, arch, keys, bailingmoe_tensors(hf), qtype)


def converter_keys(hf) -> dict:
    """The "{arch}" keys conversion/bailingmoe.py BailingMoeModel writes for the model."""
    c, L, A, R = hf.config, Keys.LLM, Keys.Attention, Keys.Rope
    head_dim = c.hidden_size // c.num_attention_heads
    return {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        R.DIMENSION_COUNT: head_dim,
        L.LEADING_DENSE_BLOCK_COUNT: len(c.mlp_only_layers),
        L.VOCAB_SIZE: c.vocab_size,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_WEIGHTS_SCALE: 1.0,
        L.EXPERT_SHARED_COUNT: SHARED,
        L.EXPERT_WEIGHTS_NORM: bool(c.norm_topk_prob),
    }


@pytest.mark.parametrize("name", ["lite", "qkv-bias", "dense-first", "unnormalized"])
def test_a_bailingmoe_gguf_matches_the_reference(tmp_path, name):
    hf = hf_model(name)
    loaded = load_model(write_bailingmoe(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "bailing_moe"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_the_reference_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32),
    q and k rows unpermuted along whole rows of blocks; the reference holds the rounded
    values."""
    hf = hf_model("lite")
    path = write_bailingmoe(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


GGUFS_REFUSED = {
    "scaled weights": ({Keys.LLM.EXPERT_WEIGHTS_SCALE: 2.0}, UnsupportedError),
    "one renormalized expert": ({Keys.LLM.EXPERT_USED_COUNT: 1}, UnsupportedError),
    "partial RoPE": ({Keys.Rope.DIMENSION_COUNT: 8}, UnsupportedError),
    "no shared expert count": ({Keys.LLM.EXPERT_SHARED_COUNT: None}, ModelFormatError),
    "no expert width": ({Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: None}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(GGUFS_REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = GGUFS_REFUSED[case]
    path = write_bailingmoe(tmp_path / "m.gguf", hf_model("lite"), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_and_run(tmp_path):
    """`llmrun show` names the arch and counts 2 layers of keys and values (2 heads of
    16, f32, 8192 positions); `llmrun run` prints the reference's greedy text."""
    hf = hf_model("lite")
    path = write_bailingmoe(tmp_path / "m.gguf", hf)
    check_show(path, "bailingmoe", 2 * 2 * 2 * 16 * 4 * 8192, moe=True)
    check_run_prints_greedy_tokens(hf, path)

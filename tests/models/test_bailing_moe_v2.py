"""Ling 2.0 (the Hub's BailingMoeV2ForCausalLM; GGUF arch bailingmoe2) against transformers'
Glm4MoeForCausalLM of the same weights: transformers has no Ling 2.0, and its published
code (modeling_bailing_moe_v2.py) computes what GLM-4.5 MoE computes under other names:
q/k RMSNorms per head, RoPE on the first partial_rotary_factor of each head with halves
turned, first_k_dense_replace dense layers, then sigmoid scores chosen by score + bias
among the topk_group best of n_group groups (each scored by its best two), the unbiased
scores renormalized (+1e-20) times routed_scaling_factor, plus shared experts. (GLM fills
the groups left out with 0, Ling with -inf: the same choice while the biased scores of
the groups kept are positive, as they are here.) Ling renormalizes whenever a token takes
more than one expert, whatever norm_topk_prob says: the one-expert case is held to GLM
without renormalization.

Folders as the Hub's checkpoints hold them: config.json with model_type "bailing_moe" and
BailingMoeV2ForCausalLM in architectures, Ling's names (model.word_embeddings, attention.
query_key_value with all queries' rows then keys' then values', attention.dense,
query_layernorm, key_layernorm, mlp.gate.expert_bias), one key per expert. GGUFs as
llama.cpp's converter writes them (conversion/bailingmoe.py BailingMoeV2Model): attn_qkv
fused and unpermuted, ffn_norm, exp_probs_b.bias, experts stacked, the rotated width as
rope.dimension_count, the gating function, expert_weights_scale and _norm, an MTP layer
counted in block_count where nextn_predict_layers says so.

Tolerances: f32 logits (within about ±7) 1e-4 max abs, whole and through the KV cache
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
from helpers import cached_logits, our_model
from moe_helpers import round_matrices_but_the_routers
from test_deepseek import hub_state_dict, routed_model
from test_glm4_moe import glm4moe_keys, glm4moe_tensors, with_mtp_layer

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
# Ling-mini-2.0's shape, tiny: q/k norms, half of each head rotated, one dense layer,
# 4 groups of 2 experts (2 groups kept), a scale, one shared expert.
GLM = dict(
    model_type="glm4_moe",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # heads x head_dim = hidden_size, as llama.cpp's attn_qkv shape requires
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=False,
    rope_parameters=dict(rope_type="default", rope_theta=600000.0, partial_rotary_factor=0.5),
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
VARIANTS = {
    "mini": {},
    # q/k/v biases (use_qkv_bias), the rotated width as Ling-1T names it (rotary_dim).
    "qkv-bias": dict(attention_bias=True),
    "rotary-dim": dict(
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)
    ),
    # One expert a token: the published code leaves its weight unrenormalized.
    "one-expert": dict(num_experts_per_tok=1, norm_topk_prob=False),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str):
    """transformers' GLM-4.5 MoE of VARIANTS[name] (test_deepseek.routed_model's weights:
    selection biases drawn large enough to change the choice)."""
    return routed_model({**GLM, **VARIANTS[name]})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ling_config(hf, name: str) -> dict:
    """The config.json of the Hub's Ling 2.0 checkpoints for the model's shape."""
    c = hf.config
    rope = c.rope_parameters
    config = dict(
        architectures=["BailingMoeV2ForCausalLM"],
        model_type="bailing_moe",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        num_experts=c.n_routed_experts,
        num_shared_experts=c.n_shared_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        n_group=c.n_group,
        topk_group=c.topk_group,
        first_k_dense_replace=c.first_k_dense_replace,
        routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=True,
        use_qk_norm=True,
        use_qkv_bias=c.attention_bias,
        use_bias=False,
        score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        num_nextn_predict_layers=0,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if name == "rotary-dim":
        del config["partial_rotary_factor"]
        config["rotary_dim"] = int(c.head_dim * rope["partial_rotary_factor"])
    return config


def ling_state_dict(hf) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's Ling 2.0 keys (see the module docstring)."""
    renames = {
        "self_attn.o_proj": "attention.dense",
        "self_attn.q_norm": "attention.query_layernorm",
        "self_attn.k_norm": "attention.key_layernorm",
        "mlp.gate.e_score_correction_bias": "mlp.gate.expert_bias",
    }
    state = hub_state_dict(hf)
    out = {}
    for key, value in state.items():
        if ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        if ".self_attn.q_proj." in key:
            parts = [state[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[key.replace("self_attn.q_proj", "attention.query_key_value")] = torch.cat(parts)
            continue
        key = key.replace("model.embed_tokens.", "model.word_embeddings.")
        for old, new in renames.items():
            key = key.replace(f".{old}", f".{new}")
        out[key] = value.contiguous()
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
    expected = reference(hf)
    loaded = load_model(save_ling_folder(tmp_path / "ling", hf, name), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "bailing_moe_v2"
    with torch.no_grad():
        whole = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (cached_logits(loaded.model, IDS) - expected).abs().max() < 1e-4


def test_paged_cache_gives_the_contiguous_logits():
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py)."""
    hf = hf_model("mini")
    config = {**ling_config(hf, "mini"), "model_type": "bailing_moe_v2"}
    ours = our_model(config, hub_state_dict(hf))
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(ours, "f32")
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(ours)


FOLDERS_REFUSED = {
    "output biases": (dict(use_bias=True), UnsupportedError),
    "softmax scores": (dict(score_function="softmax"), UnsupportedError),
    "another shared width": (dict(moe_shared_expert_intermediate_size=48), UnsupportedError),
    "MTP layers": (dict(num_nextn_predict_layers=1), UnsupportedError),
    "fused rows of other heads": (dict(num_key_value_heads=4), ModelFormatError),
}


@pytest.mark.parametrize("case", list(FOLDERS_REFUSED))
def test_a_folder_llmrun_cannot_run_as_published_is_refused(tmp_path, case):
    changes, error = FOLDERS_REFUSED[case]
    folder = save_ling_folder(tmp_path / "ling", hf_model("mini"), "mini", **changes)
    with pytest.raises(error):
        load_model(folder, CPU, "f32")


# ---- GGUF, as llama.cpp's converter writes "bailingmoe2" --------------------------------


def bailingmoe2_tensors(hf) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: GLM-4.5's (rows as they are, experts
    stacked, exp_probs_b.bias), but q, k and v in one attn_qkv and the norm before the
    feed-forward named ffn_norm."""
    glm = glm4moe_tensors(hf)
    out = {}
    for name, data in glm.items():
        if ".attn_k." in name or ".attn_v." in name:
            continue
        if ".attn_q." in name:
            parts = [glm[name.replace("attn_q", part)] for part in ("attn_q", "attn_k", "attn_v")]
            out[name.replace("attn_q", "attn_qkv")] = np.concatenate(parts)
            continue
        out[name.replace("post_attention_norm", "ffn_norm")] = data
    return out


def write_bailingmoe2(path, hf, qtype=None, mtp=False, metadata=None):
    """A bailingmoe2 GGUF of the model: the converter's keys (with `metadata` changed;
    None leaves a key out), its tensors (an MTP layer after the last with `mtp`), 2-D
    and 3-D ones but the router in `qtype` (default F32), stories260K's tokenizer."""
    c = hf.config
    keys = {
        **glm4moe_keys(c, mtp),
        Keys.LLM.VOCAB_SIZE: c.vocab_size,
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: c.moe_intermediate_size * c.n_shared_experts,
        **(metadata or {}),
    }
    tensors = bailingmoe2_tensors(hf)
    if mtp:
        tensors = with_mtp_layer(tensors, c.num_hidden_layers)
    return write_keyed_gguf(path, "bailingmoe2", keys, tensors, qtype)


@pytest.mark.parametrize("name,mtp", [("mini", True), ("qkv-bias", False), ("one-expert", False)])
def test_a_bailingmoe2_gguf_matches_the_reference(tmp_path, name, mtp):
    hf = hf_model(name)
    path = write_bailingmoe2(tmp_path / "m.gguf", hf, mtp=mtp)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "bailing_moe_v2"
    assert loaded.checkpoint.config["num_hidden_layers"] == 2
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_the_reference_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32),
    attn_qkv split along whole rows of blocks; the reference holds the rounded values."""
    hf = hf_model("mini")
    path = write_bailingmoe2(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


GGUFS_REFUSED = {
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "no gating key": ({Keys.LLM.EXPERT_GATING_FUNC: None}, ModelFormatError),
    "no shared expert count": ({Keys.LLM.EXPERT_SHARED_COUNT: None}, ModelFormatError),
    "shared experts llama.cpp widens": (
        {Keys.LLM.EXPERT_SHARED_COUNT: 2, Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: 64},
        UnsupportedError,
    ),
    "an odd rotated width": ({Keys.Rope.DIMENSION_COUNT: 7}, ModelFormatError),
    # Ling renormalizes 3 experts' weights, llama.cpp and Sarvam MoE would not.
    "weights not renormalized": ({Keys.LLM.EXPERT_WEIGHTS_NORM: False}, UnsupportedError),
}


@pytest.mark.parametrize("case", list(GGUFS_REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = GGUFS_REFUSED[case]
    path = write_bailingmoe2(tmp_path / "m.gguf", hf_model("mini"), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_and_run(tmp_path):
    """`llmrun show` names the arch and counts 2 layers of keys and values (2 heads of
    16, f32, 8192 positions), not the MTP layer's; `llmrun run` prints the reference's
    greedy text."""
    hf = hf_model("mini")
    path = write_bailingmoe2(tmp_path / "m.gguf", hf, mtp=True)
    check_show(path, "bailingmoe2", 2 * 2 * 2 * 16 * 4 * 8192, moe=True)
    check_run_prints_greedy_tokens(hf, path)

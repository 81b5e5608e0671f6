"""DeepSeek V1 MoE (the Hub's DeepseekForCausalLM, model_type deepseek: deepseek-moe-16b;
GGUF arch deepseek) against transformers' Qwen2MoeForCausalLM of the same weights, as
test_bailing_moe holds Ling 1: transformers has no DeepSeek V1, and its published code
(modeling_deepseek.py) computes what Ling 1 does under Llama's names (separate q/k/v,
mlp.shared_experts): dense layers first, the top-k softmax scores' experts (renormalized
where norm_topk_prob), shared experts; the reference's shared-expert gate zeroed
(sigmoid 0.5) and the shared down projection here half of Qwen2-MoE's.

GGUFs as llama.cpp's converter writes them (conversion/deepseek.py DeepseekModel): Ling
1's tensors (q and k rows permuted as a Llama's, experts stacked) and keys, but no
expert_weights_norm (llama.cpp never renormalizes: its files are held to the reference
without renormalization) and rope.scaling.type none.

Tolerances: f32 logits 1e-4 max abs, whole and through the KV cache (chunked prefill,
then one token at a time); a Q8_0 GGUF against the reference run on the weights gguf
dequantizes: 1e-4.
"""

import json

import pytest
import torch
from family_checks import check_run_token_ids, check_show
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits
from moe_helpers import round_matrices_but_the_routers
from test_bailing_moe import IDS, SHARED, qwen2_moe, reference, shared_experts_state_dict
from test_bailing_moe import write_bailingmoe as write_ling_gguf

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model

safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
VARIANTS = {
    # deepseek-moe-16b's shape: one dense layer first, no renormalization.
    "16b": dict(mlp_only_layers=[0], norm_topk_prob=False),
    "renormalized": dict(norm_topk_prob=True),
}


def hf_model(name: str):
    return qwen2_moe(**VARIANTS[name])


def deepseek_config(hf) -> dict:
    """The config.json of deepseek-moe-16b for the model's shape."""
    c = hf.config
    return dict(
        architectures=["DeepseekForCausalLM"],
        model_type="deepseek",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        n_routed_experts=c.num_experts,
        n_shared_experts=SHARED,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        first_k_dense_replace=len(c.mlp_only_layers),
        moe_layer_freq=1,
        scoring_func="softmax",
        topk_method="greedy",
        attention_bias=False,
        hidden_act="silu",
        rope_theta=c.rope_parameters["rope_theta"],
        rope_scaling=None,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def save_folder(path, hf, **config_changes):
    path.mkdir()
    safetensors_torch.save_file(shared_experts_state_dict(hf), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**deepseek_config(hf), **config_changes}))
    return path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_hub_folder_matches_the_reference_whole_and_through_the_cache(tmp_path, name):
    hf = hf_model(name)
    expected = reference(hf)
    loaded = load_model(save_folder(tmp_path / "ds", hf), CPU, "f32")
    with torch.no_grad():
        whole = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (cached_logits(loaded.model, IDS) - expected).abs().max() < 1e-4


FOLDERS_REFUSED = {
    "experts every other layer": dict(moe_layer_freq=2),
    "attention biases": dict(attention_bias=True),
    "RoPE scaling": dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
    "sigmoid scores": dict(scoring_func="sigmoid"),
    "no experts": dict(n_routed_experts=None),
}


@pytest.mark.parametrize("case", list(FOLDERS_REFUSED))
def test_a_folder_llmrun_cannot_run_as_published_is_refused(tmp_path, case):
    folder = save_folder(tmp_path / "ds", hf_model("16b"), **FOLDERS_REFUSED[case])
    with pytest.raises(UnsupportedError):
        load_model(folder, CPU, "f32")


def write_deepseek(path, hf, qtype=None, metadata=None):
    """A deepseek GGUF of the model as the converter writes it (see the module docstring)."""
    deepseek_keys = {Keys.LLM.EXPERT_WEIGHTS_NORM: None, Keys.Rope.SCALING_TYPE: "none"}
    metadata = {**deepseek_keys, **(metadata or {})}
    return write_ling_gguf(path, hf, qtype, metadata, arch="deepseek")


def test_a_deepseek_gguf_matches_the_reference(tmp_path):
    hf = hf_model("16b")
    loaded = load_model(write_deepseek(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "deepseek"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_deepseek_gguf_never_renormalizes_as_llama_cpp_does(tmp_path):
    """A model trained with norm_topk_prob: llama.cpp's file (no key for it) runs the
    reference without renormalization, whatever expert_weights_norm says."""
    hf = hf_model("renormalized")
    path = write_deepseek(tmp_path / "m.gguf", hf, metadata={Keys.LLM.EXPERT_WEIGHTS_NORM: True})
    loaded = load_model(path, CPU, "f32")
    for layer in hf.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_the_reference_on_the_dequantized_weights(tmp_path):
    hf = hf_model("16b")
    path = write_deepseek(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "metadata", [{Keys.LLM.EXPERT_WEIGHTS_SCALE: 2.0}, {Keys.Rope.DIMENSION_COUNT: 8}]
)
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, metadata):
    path = write_deepseek(tmp_path / "m.gguf", hf_model("16b"), metadata=metadata)
    with pytest.raises(UnsupportedError, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_and_run(tmp_path):
    """`llmrun show` names the arch and counts 2 layers of keys and values (2 heads of
    16, f32, 8192 positions); `llmrun run` picks the reference's greedy tokens."""
    hf = hf_model("16b")
    path = write_deepseek(tmp_path / "m.gguf", hf)
    check_show(path, "deepseek", 2 * 2 * 2 * 16 * 4 * 8192, moe=True)
    # Its first token starts a word: the decoding of the ids alone drops the space `run` prints.
    check_run_token_ids(hf, path, tokens=16, text=False)

"""A.X K2 (llmrun/models/axk2.py) against transformers' AXK2ForCausalLM: its Hub folder
(the fused query-and-gate q_b_proj, the gated norms' W_down and W_up, one key per expert,
as transformers saves them) on one tiny random model (3 layers, hidden 64: a dense layer,
then 8 experts in 2 groups, 3 a token from the best group, one shared; latent attention
over the 8 keys an 8-head indexer chooses among 40 tokens), its config.json giving the
dense layers in the legacy first_k_dense_replace. llama.cpp has no converter for
AXK2ForCausalLM: folders only. A.X K2 itself is not run.

Each feature, dropped from llmrun's model (test_each_feature_dropped_moves_the_logits),
moves the logits by far more than the tolerance: the gates of the norms, the output
gate's dependence on the queries' latent, the indexer's choice, the group limit, and
AXK2's choice score of 0 (DeepSeek-V3's: minus infinity) for the experts outside the kept
groups. The indexer has 8 heads: with fewer, many keys score a relu's exact 0, and
torch.topk breaks those ties by position differently over a prompt's keys and a cache's.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache.
`llmrun run` picks transformers' 8 greedy token ids.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    max_diff,
)
from helpers import BASE, save_hf_dir
from test_deepseek import routed_model

from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.axk2")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="axk2",
    num_hidden_layers=3,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    index_topk=8,
    index_head_dim=32,
    index_n_heads=8,
    gated_norm_rank=8,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    """The tiny model, its selection biases lowered by 0.5: some chosen experts' biased
    scores fall below 0, where AXK2's choice differs from DeepSeek-V3's."""
    model = routed_model(CONFIG)
    assert model.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.sub_(0.5)
    return model


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    """The Hub folder (stories260K's tokenizer), its dense layers in
    first_k_dense_replace."""
    path = save_hf_dir(hf, tmp_path_factory.mktemp("axk2") / "A.X-K2", tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    del config["mlp_layer_types"]
    config.update(first_k_dense_replace=1)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(hf, expected, folder):
    # transformers reads the folder's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "axk2"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_run_token_ids(hf, folder, tokens=8)
    # Each layer's one head of the latent (32), its rope part (16) and the indexer's key
    # (32), key and value alike, f32, 8192 positions.
    check_show(folder, "axk2", 3 * 80 * 4 * 8192, moe=True)


def plain_norms(model):
    for layer in model.model.layers:
        layer.input_layernorm = layer.input_layernorm.norm
        if hasattr(layer.post_attention_layernorm, "norm"):
            layer.post_attention_layernorm = layer.post_attention_layernorm.norm


def constant_output_gate(model):
    """Each head's gate rows zeroed: every output times sigmoid(0)."""
    for layer in model.model.layers:
        attention = layer.self_attn
        rows = attention.q_b_proj.weight.data.view(attention.n_heads, -1, 64)
        rows[:, attention.nope + attention.rope :].zero_()


def every_key(model):
    for layer in model.model.layers:
        layer.self_attn.topk = 10**6


def every_group(model):
    model.args.n_group = 1


def other_groups_never_chosen(model):
    """DeepSeek-V3's choice: the experts outside the kept groups at minus infinity."""
    for layer in model.model.layers[1:]:
        layer.mlp.gate.masked = float("-inf")


DROPPED = [plain_norms, constant_output_gate, every_key, every_group, other_groups_never_chosen]


@pytest.mark.parametrize("drop", DROPPED, ids=lambda f: f.__name__)
def test_each_feature_dropped_moves_the_logits(expected, folder, drop):
    model = load_model(folder, CPU, "f32").model
    drop(model)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 0.1


def test_a_bare_config_takes_axk2configs_defaults():
    """A config.json giving only the sizes reads as transformers' AXK2Config()
    (A.X-K2-Light's shape: no expert groups), and `llmrun show` counts the KV cache the
    model allocates."""
    from llmrun.loading import inspect
    from llmrun.models import axk2, kv_cache_bytes

    hf = transformers.AXK2Config()
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    bare = {"model_type": "axk2", **{k: getattr(hf, k) for k in sizes}}
    args = axk2.ModelArgs.from_config(bare)
    assert args.mlp_layer_types == hf.mlp_layer_types and not args.grouped
    names = ("intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts")
    names += ("num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group")
    names += ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
    names += ("v_head_dim", "rms_norm_eps", "norm_topk_prob", "index_topk", "index_head_dim")
    names += ("index_n_heads", "gated_norm_rank")
    for name in names:
        assert getattr(args, name) == getattr(hf, name), name
    assert args.rope_parameters == hf.rope_parameters
    # `show` reads no family's default latent width: the Hub's config.json states it.
    widths = ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
    counted = inspect.kv_cache_bytes({**bare, **{k: getattr(hf, k) for k in widths}}, 8192)
    assert counted == kv_cache_bytes(hf.to_dict(), 8192)

"""Flint (llmrun/models/flint.py) against transformers' FlintForCausalLM: its Hub folder
(self_attn.softmax_offset for the sinks, one key per expert, as transformers saves them)
on one tiny random model (4 layers, hidden 64, window 5 under 40 tokens, 8 experts, 3 a
token, a shared one), its config.json leaving the layer types and the dense layers to
FlintConfig's defaults (full, full, sliding, full; layers 0 and 1 dense). llama.cpp has
no converter for FlintForCausalLM: folders only.

Each feature, dropped from llmrun's model (test_each_feature_dropped_moves_the_logits),
moves the logits by far more than the tolerance: the sinks, RoPE on the sliding layers
alone, the window, the renormalized sigmoid scores, the shared expert.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache
(the sliding layers also in a pool of their own). `llmrun run` picks transformers' 8
greedy token ids.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import BASE, save_hf_dir

from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.flint")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="flint",
    num_hidden_layers=4,
    head_dim=16,
    sliding_window=5,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    model = hf_model_of(CONFIG)
    assert model.config.layer_types[1:3] == ["full_attention", "sliding_attention"]
    assert model.config.mlp_only_layers == [0, 1]
    return model


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    """The Hub folder (stories260K's tokenizer), its config.json without layer_types or
    mlp_only_layers."""
    path = save_hf_dir(hf, tmp_path_factory.mktemp("flint") / "flint", tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    del config["layer_types"], config["mlp_only_layers"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(
    hf, expected, folder, monkeypatch
):
    # transformers reads the folder's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "flint"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected, windowed="flint", monkeypatch=monkeypatch)
    check_run_token_ids(hf, folder, tokens=8)
    # Three full layers' keys and values of 2 heads of 16 over 8192 positions, one
    # sliding layer's over its window of 5; f32.
    check_show(folder, "flint", 2 * 2 * 16 * 4 * (3 * 8192 + 5), moe=True)


def without_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.softmax_offset.data.fill_(-1e9)


def rope_everywhere(model):
    for layer in model.model.layers:
        layer.self_attn.rotary = True


def no_window(model):
    for layer in model.model.layers:
        layer.self_attn.layer_type = "full_attention"


def scores_as_they_are(model):
    for layer in model.model.layers[2:]:
        layer.mlp.norm_topk_prob = False


def without_shared_expert(model):
    for layer in model.model.layers[2:]:
        layer.mlp.shared_expert.down_proj.weight.data.zero_()


DROPPED = [without_sinks, rope_everywhere, no_window, scores_as_they_are, without_shared_expert]


@pytest.mark.parametrize("drop", DROPPED, ids=lambda f: f.__name__)
def test_each_feature_dropped_moves_the_logits(expected, folder, drop):
    """Whole prompts (a cache that keeps only the window has no room for a layer
    made full)."""
    model = load_model(folder, CPU, "f32").model
    drop(model)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 1


def test_a_bare_config_takes_flintconfigs_defaults():
    """A config.json giving only the sizes reads as transformers' FlintConfig()
    (RecursiveSI/flint's shape: 49 layers), and `llmrun show` counts the KV cache the
    model allocates."""
    from llmrun.loading import inspect
    from llmrun.models import flint, kv_cache_bytes

    hf = transformers.FlintConfig()
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    bare = {
        "model_type": "flint",
        "vocab_size": hf.vocab_size,
        **{k: getattr(hf, k) for k in sizes},
    }
    args = flint.ModelArgs.from_config(bare)
    assert args.layer_types == hf.layer_types and args.mlp_only_layers == hf.mlp_only_layers
    widths = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    others = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "head_dim", "sliding_window")
    for name in widths + others + ("rms_norm_eps",):
        assert getattr(args, name) == getattr(hf, name), name
    assert args.rope_parameters == hf.rope_parameters
    # `show` reads no family's default head width: the Hub's config.json states it.
    counted = inspect.kv_cache_bytes({**bare, "head_dim": hf.head_dim}, 8192)
    assert counted == kv_cache_bytes(hf.to_dict(), 8192)

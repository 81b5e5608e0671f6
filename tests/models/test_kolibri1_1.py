"""Kolibri-1.1 (Aleph Alpha, llmrun/models/kolibri1_1.py) against transformers'
Kolibri1_1ForCausalLM, on one tiny random model whose indexer chooses within 40 tokens:
6 layers, a dense first one then experts (test_kolibri1's), sliding-window layers
(window 5) and indexed-attention ones (an indexer choosing pools of 16 keys in blocks of
4, a layer reading its keys and values and its pool, a second indexer with its own), each
query's 4 best keys besides 2 sinks and 4 local ones, scored by 2 heads. From
config.json-style dicts with the Hub's per-expert weights, from a folder transformers
saves and from a Hub-style folder (test_kolibri1.save_hub_folder's names).

Each of the indexer's settings and the key sharing moves transformers' logits by far
more than the tolerance, and llmrun follows each.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and serve's paged
blocks. `llmrun run` picks transformers' 8 greedy token ids from each folder.
"""

import pytest
import torch
from family_checks import check_paged, check_run_token_ids, check_show, max_diff
from helpers import BASE, cached_logits, our_model, save_hf_dir
from test_deepseek import hub_state_dict, routed_model
from test_kolibri1 import save_hub_folder

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import kolibri1_1_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kolibri1_1")

CPU = torch.device("cpu")
SLIDING, INDEXED = "sliding_attention", "indexed_attention"
CONFIG = dict(
    BASE,
    model_type="kolibri1_1",
    num_hidden_layers=6,
    head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=3,
    sliding_window=5,
    layer_types=[SLIDING, SLIDING, INDEXED, SLIDING, INDEXED, INDEXED],
    index_layers=[2, 5],
    kv_source_layers=[0, 1, 2, 3, 2, 5],
    mlp_only_layers=[0],
    mlp_only_intermediate_size=80,
    index_topk=4,
    index_num_local_tokens=4,
    index_num_sink_tokens=2,
    index_pool_size=16,
    index_compression=4,
    index_num_heads=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


@pytest.fixture(scope="module")
def hf():
    return routed_model(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


def test_matches_transformers_whole_cached_and_paged(hf, expected):
    assert 3 < expected.abs().max() < 10
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    check_paged(model, IDS, expected)


VARIANTS = {
    "every key within the budget": dict(index_topk=64),
    "one pool of every key": dict(index_pool_size=64),
    "blocks of 2": dict(index_compression=2),
    "one scoring head": dict(index_num_heads=1),
    "more sinks": dict(index_num_sink_tokens=4),
    "more local keys": dict(index_num_local_tokens=6),
    "no shared keys": dict(kv_source_layers=list(range(6))),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_setting_moves_the_logits_and_is_followed(hf, expected, name):
    other = routed_model({**CONFIG, **VARIANTS[name]})
    own = other.state_dict()
    other.load_state_dict(
        {k: v for k, v in hf.state_dict().items() if own[k].shape == v.shape}, strict=False
    )
    moved = reference(other)
    assert max_diff(moved, expected) > 0.1
    assert max_diff(cached_logits(ours(other), IDS), moved) < 1e-4


def test_the_folders_run_and_show(hf, expected, tmp_path):
    saved = save_hf_dir(hf, tmp_path / "saved", tokenizer=True)
    hub = save_hub_folder(hf, tmp_path / "hub")
    from_hub = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    assert max_diff(reference(from_hub.eval()), expected) == 0
    # KV entries for the 5 layers with keys of their own (layer 4 reads layer 2's): 2
    # heads of 16, keys and values, f32; the indexed ones 8192 positions, the sliding ones
    # their window of 5.
    kv_8k = 2 * 2 * 16 * 4 * (2 * 8192 + 3 * 5)
    for path in (saved, hub):
        loaded = load_model(path, CPU, "f32")
        assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
        # Ids alone: the first token's leading space shows in the CLI's text, not alone.
        check_run_token_ids(hf, path, tokens=8, text=False)
        check_show(path, "kolibri1_1", kv_8k, moe=True)


def test_refuses_a_layer_that_reads_keys_of_another_type():
    with pytest.raises(ModelFormatError, match="cannot read the keys"):
        kolibri1_1_config.layout({**CONFIG, "kv_source_layers": [0, 1, 2, 2, 2, 5]})

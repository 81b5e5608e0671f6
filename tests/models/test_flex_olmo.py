"""FlexOlmo (llmrun/models/flex_olmo.py) against transformers' FlexOlmoForCausalLM: its
Hugging Face folder as save_pretrained writes it (one key per expert, the Hub's layout),
on one tiny random model: 2 layers, hidden 64, 4 heads over 2 KV heads, 4 experts, 2 a
token. llama.cpp has no converter for the family.

Its RoPE base of 500000 where a config gives none (OLMoE's is 10000) and the experts a
token takes each move the logits by far more than the tolerance
(test_each_feature_changes_the_logits); a folder whose config.json names no RoPE base
runs as transformers runs it. norm_topk_prob does not: the norm after the feed-forward
takes each token's mixture to unit scale, so renormalizing its weights moves the logits
by ~1e-5 alone (eps).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache.
`llmrun run` picks transformers' 8 greedy token ids from the folder.
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
from helpers import BASE, cached_logits, save_hf_dir

from llmrun.loading.loader import load_model

pytest.importorskip("transformers.models.flex_olmo")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="flex_olmo",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=32,  # each expert's
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
# 2 layers' keys and values of 2 heads of 16, f32, 8192 positions.
KV_8K = 2 * 2 * 2 * 16 * 4 * 8192


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("flex_olmo") / "FlexOlmo", tokenizer=True)


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(hf, expected, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "flex_olmo"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_run_token_ids(hf, folder, tokens=8)
    check_show(folder, "flex_olmo", KV_8K, moe=True)


def test_a_config_without_a_rope_base_takes_flex_olmos(expected, folder):
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("rope_parameters")["rope_theta"] == 500000.0
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


FEATURES = {
    "the RoPE base of 500000": dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    "two experts a token": dict(num_experts_per_tok=1),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(expected, feature):
    assert max_diff(reference(hf_model_of({**CONFIG, **FEATURES[feature]})), expected) > 0.1

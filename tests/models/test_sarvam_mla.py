"""Sarvam MLA (llmrun/models/sarvam_mla.py) against transformers, which builds
DeepseekV3ForCausalLM from a SarvamMLAConfig: its Hub folder (config.json as the Hub's
sarvam-105b has it: SarvamMLAForCausalLM, num_experts, num_shared_experts, the derived
head_dim and q_head_dim, rope_scaling of type "deepseek_yarn"; no q_lora_rank, n_group,
topk_group or first_k_dense_replace, so SarvamMLAConfig's defaults apply: q_proj, one
group, one dense layer), on one tiny random model (2 layers, hidden 64, a dense layer
then 8 experts, 3 a token, one shared; YaRN of factor 40 as sarvam-105b's).

What Sarvam reads otherwise than DeepSeek-V3 (one group of experts where the config names
none, "deepseek_yarn" as YaRN) each moves the logits by far more than the tolerance
(test_each_feature_changes_the_logits). llama.cpp has no converter for Sarvam MLA: no GGUF.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole, through
the KV cache (prefills in chunks, then one token at a time) and the paged cache. `llmrun
run` picks transformers' 8 greedy token ids.
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
pytest.importorskip("transformers.models.sarvam_mla")

CPU = torch.device("cpu")
YARN = dict(
    type="deepseek_yarn",
    factor=40.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)
# sarvam-105b's config.json, tiny.
CONFIG = dict(
    architectures=["SarvamMLAForCausalLM"],
    model_type="sarvam_mla",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    q_head_dim=32,
    head_dim=48,  # kv_lora_rank + qk_rope_head_dim, as the Hub's file has it for vLLM
    num_experts=8,
    num_shared_experts=1,
    num_experts_per_tok=3,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_theta=10000.0,
    rope_scaling=YARN,
    max_position_embeddings=64 * 40,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    return routed_model(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(hf, expected, tmp_path):
    folder = save_hf_dir(hf, tmp_path / "sarvam-105b", tokenizer=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    # transformers reads the Hub's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(again).__name__ == "DeepseekV3ForCausalLM"
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "sarvam_mla"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    # ids only: the first greedy token starts a word, whose space `run` keeps after the prompt
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 2 layers' latents (32 + 16 features, the keys' and values' one copy), f32, 8192 positions.
    check_show(folder, "sarvam_mla", 2 * (32 + 16) * 4 * 8192, moe=True)


# Each way Sarvam reads a config otherwise than DeepSeek-V3, undone in the reference (same
# weights otherwise): the logits move by far more than the tolerance, so the parity test
# checks every one of them.
FEATURES = {
    "one group of experts": dict(n_group=4, topk_group=2),
    "deepseek_yarn read as YaRN": dict(rope_scaling=None),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(expected, feature):
    assert max_diff(reference(routed_model({**CONFIG, **FEATURES[feature]})), expected) > 0.1


def test_the_released_shape_is_read_as_transformers_reads_it():
    """sarvam-105b's shape (64 heads of 128 + 64 query features, YaRN of factor 40 from
    4096 positions): llmrun's softmax scale is transformers' (qk_head_dim^-0.5 times
    YaRN's mscale squared), and its cache holds 512 + 64 features a token and layer."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from llmrun.models import kv_cache_bytes, sarvam_mla

    released = dict(
        model_type="sarvam_mla",
        num_experts=128,
        num_shared_experts=1,
        q_head_dim=192,
        head_dim=576,
        rope_theta=10000.0,
        rope_scaling={**YARN, "original_max_position_embeddings": 4096},
        max_position_embeddings=131072,
    )
    args = sarvam_mla.ModelArgs.from_config(released)
    config = transformers.AutoConfig.for_model(**released)
    with torch.device("meta"):
        attention = DeepseekV3Attention(config, layer_idx=0)
    assert args.softmax_scale == pytest.approx(attention.scaling, rel=1e-12)
    assert (args.q_lora_rank, args.n_group, args.first_k_dense_replace) == (None, 1, 1)
    assert (args.n_routed_experts, args.num_hidden_layers) == (128, 32)
    assert kv_cache_bytes(released, 10) == 32 * (512 + 64) * 4 * 10

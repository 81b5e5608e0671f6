"""LongCat-Flash (llmrun/models/longcat_flash.py) against transformers'
LongcatFlashForCausalLM, on one tiny random model (2 layers, so 4 attention blocks;
hidden 64; 4 routed experts and 3 zero-computation ones, 3 a token; random
e_score_correction_bias) and its Hub-style folder (config.json with rope_theta at the top
and no num_hidden_layers, one key per expert, a model.mtp. tensor that is not read).
llama.cpp has no converter for LongCat-Flash: folders only.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache.
`llmrun run` picks
transformers' 8 greedy token ids. Each LongCat feature (the latent scales, the
zero-computation experts, the shortcut MoE) left out moves the logits by far more.
"""

import copy
import json

import pytest
import torch
import transformers
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir
from moe_helpers import hub_state_dict
from safetensors.torch import save_file
from test_deepseek import routed_model
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes, longcat_flash

pytest.importorskip("transformers.models.longcat_flash")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="longcat_flash",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    ffn_hidden_size=96,
    num_layers=2,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    head_dim=16,  # the RoPE width transformers reads: qk_rope_head_dim
    v_head_dim=16,
    n_routed_experts=4,
    zero_expert_num=3,
    moe_topk=3,
    expert_ffn_hidden_size=32,
    routed_scaling_factor=2.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    model = routed_model(CONFIG)
    with torch.no_grad():  # a buffer, which randomize() leaves at zero
        for layer in model.model.layers:
            layer.mlp.router.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf, "qwen2_moe"))


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    """The model's Hub-style folder with stories260K's tokenizer."""
    path = save_hf_dir(hf, tmp_path_factory.mktemp("longcat") / "LongCat-Flash", tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (path / "config.json").write_text(json.dumps(config))
    mtp = {"model.mtp.layers.0.eh_proj.weight": torch.zeros(64, 128)}
    save_file(mtp, str(path / "mtp.safetensors"))
    return path


def test_matches_transformers_whole_cached_and_paged(hf, ours, expected):
    chosen = set()
    hooks = [
        layer.mlp.router.register_forward_hook(
            lambda _, __, out: chosen.update(out[2].flatten().tolist())
        )
        for layer in hf.model.layers
    ]
    with torch.no_grad():
        hf(IDS)
    for hook in hooks:
        hook.remove()
    assert chosen == set(range(7))  # every routed and zero expert is chosen
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)


def test_the_hub_folder_runs_and_shows(hf, expected, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "longcat_flash"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # Four attention blocks, each one latent head of 16 + 16, f32, 8192 positions.
    check_show(folder, "longcat_flash", 4 * 32 * 4 * 8192, moe=True)
    assert kv_cache_bytes(hf.config.to_dict(), 8192) == 4 * 32 * 4 * 8192


def test_a_bf16_folder_matches_transformers_reading_it(hf, tmp_path):
    """Half-precision weights stay in blocks for the native kernels, but for the ones the
    model reads: the latents' kv_b_proj and the router's classifier."""
    folder = save_hf_dir(copy.deepcopy(hf), tmp_path / "bf16", dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.eval()(IDS).logits
    assert max_diff(cached_logits(load_model(folder, CPU, "f32").model, IDS), expected) < 1e-4


def without_latent_scales(model):
    for layer in model.model.layers:
        for attention in layer.self_attn:
            attention.q_a_layernorm.scale = attention.kv_a_layernorm.scale = 1.0


def without_zero_experts(model):
    for layer in model.model.layers:  # the router choosing among the routed experts alone
        router = layer.mlp.router
        router.classifier.weight = nn.Parameter(router.classifier.weight[:4])
        router.e_score_correction_bias = nn.Parameter(router.e_score_correction_bias[:4])


def without_shortcut(model):
    for layer in model.model.layers:
        layer.mlp.forward = torch.zeros_like


@pytest.mark.parametrize(
    "leave_out", [without_latent_scales, without_zero_experts, without_shortcut]
)
def test_each_feature_left_out_moves_the_logits(hf, expected, leave_out):
    model = our_model(hf.config.to_dict(), hub_state_dict(hf, "qwen2_moe"))
    leave_out(model)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 0.1


def test_a_router_bias_is_refused():
    with pytest.raises(UnsupportedError, match="router_bias"):
        longcat_flash.ModelArgs.from_config({**CONFIG, "router_bias": True})

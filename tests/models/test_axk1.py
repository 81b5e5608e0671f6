"""A.X K1 (llmrun/models/axk1.py) against transformers' AXK1ForCausalLM: its Hub folder
on one tiny random model (3 layers, hidden 64: a dense layer, then 8 experts in 2 groups,
3 a token from the best group, one shared; latent attention with query and key-value
bottlenecks of 32), its config.json giving the dense layers in the legacy
first_k_dense_replace (AXK1Config's reading), not mlp_layer_types. The Hub's layers keep
the expert layers' post_mlp_layernorm; one in a dense layer, and the layers past
num_hidden_layers (multi-token prediction), are left unread, as transformers leaves them;
an FP8 folder is refused. llama.cpp has no converter for AXK1ForCausalLM:
folders only. A.X K1 itself (hundreds of billions of parameters) is not run.

Each feature, dropped from llmrun's model (test_each_feature_dropped_moves_the_logits),
moves the logits by far more than the tolerance: the norm after the experts, the group
limit, the selection bias.

Tolerances: f32 logits (within about ±8) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache.
`llmrun run` picks transformers' 8 greedy token ids.
"""

import json
import shutil

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
from in_process import llmrun
from test_deepseek import routed_model

from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.axk1")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="axk1",
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
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    model = routed_model(CONFIG)
    assert model.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    return model


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    """The Hub folder (stories260K's tokenizer), its dense layers in
    first_k_dense_replace, with what transformers leaves unread: a post_mlp_layernorm in
    its dense layer, a multi-token-prediction layer's tensor past num_hidden_layers."""
    from safetensors.torch import load_file, save_file

    path = save_hf_dir(hf, tmp_path_factory.mktemp("axk1") / "A.X-K1", tokenizer=True)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.full([64], 3.0)
    tensors["model.layers.3.input_layernorm.weight"] = torch.full([64], 3.0)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    del config["mlp_layer_types"]
    config.update(first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(hf, expected, folder):
    # transformers reads the folder's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "axk1"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_run_token_ids(hf, folder, tokens=8)
    # Each layer's one latent head of 32 + 16, key and value alike, f32, 8192 positions.
    check_show(folder, "axk1", 3 * 48 * 4 * 8192, moe=True)


def test_an_fp8_folder_is_refused(folder, tmp_path):
    shutil.copytree(folder, tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    result = llmrun("run", str(tmp_path / "fp8"), "Hi", "-n", "1")
    assert result.returncode != 0
    assert (
        result.stderr.startswith("error: ") and "fp8 checkpoints are not supported" in result.stderr
    )


def without_post_mlp_norm(model):
    for layer in model.model.layers:
        layer.post_mlp_layernorm = None


def every_group(model):
    model.args.n_group = 1


def without_selection_bias(model):
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data.zero_()


DROPPED = [without_post_mlp_norm, every_group, without_selection_bias]


@pytest.mark.parametrize("drop", DROPPED, ids=lambda f: f.__name__)
def test_each_feature_dropped_moves_the_logits(expected, folder, drop):
    model = load_model(folder, CPU, "f32").model
    drop(model)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 1


def test_a_bare_config_takes_axk1configs_defaults():
    """A config.json giving only the sizes reads as transformers' AXK1Config() (A.X K1's
    shape), and `llmrun show` counts the KV cache the model allocates."""
    from llmrun.loading import inspect
    from llmrun.models import axk1, kv_cache_bytes

    hf = transformers.AXK1Config()
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    bare = {"model_type": "axk1", **{k: getattr(hf, k) for k in sizes}}
    args = axk1.ModelArgs.from_config(bare)
    assert args.mlp_layer_types == hf.mlp_layer_types
    names = ("intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts")
    names += ("num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group")
    names += ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
    names += ("v_head_dim", "rms_norm_eps", "norm_topk_prob", "rope_interleave")
    for name in names:
        assert getattr(args, name) == getattr(hf, name), name
    assert args.rope_parameters == hf.rope_parameters
    # `show` reads no family's default latent width: the Hub's config.json states it.
    latent = {k: getattr(hf, k) for k in ("kv_lora_rank", "qk_rope_head_dim")}
    counted = inspect.kv_cache_bytes({**bare, **latent}, 8192)
    assert counted == kv_cache_bytes(hf.to_dict(), 8192)

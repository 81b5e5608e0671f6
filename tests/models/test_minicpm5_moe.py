"""MiniCPM5-MoE against transformers' MiniCPM5MoeForCausalLM, from config.json-style dicts
with the Hub's keys (the query and gate projection as self_attn.q_proj, one key per
expert) and from folders transformers saves (q_gate_proj, experts stacked). Hugging
Face folders only: llama.cpp's converter writes no GGUF of this family (conversion/ knows
MiniCPM5's pre-tokenizer alone), so there is no GGUF test.

Features: the sigmoid output gate taken from the queries' projection, DeepSeek-V3's
routing (selection bias, groups scored by their best two, renormalized weights times
routed_scaling_factor), the shared experts, dense layers by mlp_layer_types (or
first_k_dense_replace), RoPE base 5e6 by default. The ones a config switches move the
logits by far more than the tolerance (test_each_feature_changes_the_logits); the gate
and the query/gate split were checked by breaking llmrun's code: the parity tests fail.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole and
through the KV cache (chunked prefill, then one token at a time), contiguous or paged.
Cache types: test_cache_types' checks.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_and_show,
    check_show,
    load_matching_weights,
    max_diff,
)
from helpers import cached_logits, our_model, randomize, save_hf_dir
from test_cache_types import TOLERANCE

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="minicpm5_moe",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers MiniCPM5-MoE (vocab 512, f32, eval): randomize()'s weights,
    attention outputs smaller (so that tokens do not look alike to the routers), and
    selection biases drawn large enough to change the choice."""
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.03})
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: self_attn.q_proj, one key per expert."""
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition(".mlp.experts.")
        if sep and tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}.mlp.experts.{e}.up_proj.weight"] = value[e, width:]
        elif sep and tail == "down_proj":
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[key.replace(".self_attn.q_gate_proj.", ".self_attn.q_proj.")] = value
    return out


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


VARIANTS = {
    "grouped": {},
    "ungrouped, two dense layers": {"n_group": 1, "mlp_layer_types": ["dense", "dense", "sparse"]},
    "not renormalized, two shared": {"norm_topk_prob": False, "n_shared_experts": 2},
    "attention biases": {"attention_bias": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_whole_and_through_the_cache(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_a_config_without_rope_or_layer_types_takes_minicpm5s_defaults():
    """No RoPE settings: base 5e6; no mlp_layer_types: the first first_k_dense_replace
    layers dense (one where that is absent too)."""
    config = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}
    for extra, dense in (({}, 1), ({"first_k_dense_replace": 2}, 2)):
        hf = hf_model(rope_parameters=None, **extra)
        assert hf.config.rope_parameters["rope_theta"] == 5000000.0
        model = our_model({**config, **extra}, hub_state_dict(hf))
        assert model.args.mlp_layer_types == ["dense"] * dense + ["sparse"] * (3 - dense)
        assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests above
# check every one of them.
FEATURES = {
    "selection bias": {},  # the biases zeroed below
    "shared experts": {},  # their output zeroed below
    "routed scaling factor": {"routed_scaling_factor": 1.0},
    "groups": {"n_group": 1},
    "mlp_layer_types": {"mlp_layer_types": ["dense", "dense", "sparse"]},
    "RoPE base": {"rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0}},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    with_feature, without = hf_model(), hf_model(**FEATURES[feature])
    load_matching_weights(with_feature, without)
    with torch.no_grad():
        for layer in without.model.layers:
            if feature == "selection bias" and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
            if feature == "shared experts" and hasattr(layer.mlp, "shared_experts"):
                layer.mlp.shared_experts.down_proj.weight.zero_()
    assert max_diff(reference(without), reference(with_feature)) > 0.1


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"mlp_layer_types": ["dense", "sparse"]}, ModelFormatError, "mlp_layer_types"),
        ({"n_group": 3}, ModelFormatError, "n_group"),
        ({"n_group": 8, "topk_group": 1}, UnsupportedError, "groups of one expert"),
        ({"num_experts_per_tok": 5}, ModelFormatError, "num_experts_per_tok"),
        ({"use_gated_attention": False}, UnsupportedError, "use_gated_attention"),
    ],
)
def test_configs_llmrun_cannot_run_are_refused(change, error, match):
    from llmrun.models import minicpm5_moe

    with pytest.raises(error, match=match):
        minicpm5_moe.ModelArgs.from_config({**CONFIG, **change})


def test_paged_cache_gives_the_contiguous_logits():
    hf = hf_model()
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """Only f16's drift from f32 is bounded: in bf16 or q8_0 a rounding can send a token
    to other experts."""
    f16 = cache_type == "f16"
    check_rounded_cache(ours(hf_model()), cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_static_decode_step_is_not_offered():
    from llmrun import static_decode

    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_saved_folder_loads(tmp_path):
    """What transformers saves (the Hub's names), and a folder of transformers' own
    names (q_gate_proj, the experts stacked); the native decode step stays off (a family
    it does not know)."""
    from safetensors.torch import save_file

    hf = hf_model()
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4
    hf.config.save_pretrained(tmp_path / "stacked")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(".q_gate_proj." in k for k in state) and any("gate_up_proj" in k for k in state)
    save_file(state, tmp_path / "stacked" / "model.safetensors")
    loaded = load_model(tmp_path / "stacked", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model()
    path = save_hf_dir(hf, tmp_path / "minicpm5", tokenizer=True)
    check_run_and_show(hf, path, "minicpm5_moe")
    # Keys and values of 2 KV heads of 32 floats, three layers.
    check_show(path, "minicpm5_moe", 2 * 2 * 32 * 4 * 3 * 8192, moe=True)

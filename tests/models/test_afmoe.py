"""AFMoE (Arcee Trinity) against transformers' AfmoeForCausalLM: from config.json-style
dicts with the Hub's per-expert weights (mlp.experts.N.gate_proj, ...), from a Hub
folder, and from "afmoe" GGUFs written as llama.cpp's converter writes them
(conversion/afmoe.py AfmoeModel: LlamaModel's keys with expert_shared_count,
expert_feed_forward_length, leading_dense_block_count, expert_weights_norm and
expert_weights_scale, expert_gating_func from score_func and the window; q/k rows as
they are; post_attention_layernorm as post_attention_norm, pre_mlp_layernorm as
ffn_norm, post_mlp_layernorm as post_ffw_norm, the attention gate as attn_gate, the
router as ffn_gate_inp, the experts stacked, expert_bias as exp_probs_b.bias).

Its features each move the logits by far more than the tolerance
(test_each_feature_moves_the_logits): the attention gate, the sliding window, the
global layers without RoPE, the muP embedding scale, the expert bias that only chooses,
route_scale, the renormalized weights, the dual norms. The model has a dense layer
first, then three MoE layers (each with a shared expert), the last of them global.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time) or serve's paged
blocks. A Q8_0 GGUF is held to transformers running the dequantized weights at 1e-4.
Cache types are held to an f32 cache holding the rounded values at 1e-5.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_and_show,
    check_show,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, our_model
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from test_deepseek import routed_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
# Four layers: one dense, then experts; three local layers (window 5) and a global one.
CONFIG = dict(
    BASE,
    model_type="afmoe",
    num_hidden_layers=4,
    num_dense_layers=1,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=3,
    num_shared_experts=1,
    sliding_window=5,
    mup_enabled=True,
    route_scale=2.5,
    rope_theta=10000.0,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers AFMoE (test_deepseek.routed_model's weights), its selection
    biases drawn large enough to change the choice."""
    model = routed_model({**CONFIG, **overrides})
    draw = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "expert_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=draw) * 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: transformers 5 fuses each layer's experts
    (mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]); the
    checkpoints have one key per expert and projection."""
    out = {}
    for key, value in model.state_dict().items():
        prefix, _, tail = key.rpartition(".experts.")
        if tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = value[e, :width]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = value[e, width:]
        elif tail == "down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def ours(hf, **config):
    return our_model({**hf.config.to_dict(), **config}, hub_state_dict(hf))


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_matches_transformers_whole_and_through_the_cache(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_every_expert_is_chosen(family):
    """The tests route tokens to every expert of every MoE layer (so each expert's
    weights are checked)."""
    hf, _ = family
    chosen = {}
    hooks = [
        layer.mlp.router.register_forward_hook(
            lambda _m, _i, out, i=i: chosen.setdefault(i, set()).update(out[2].flatten().tolist())
        )
        for i, layer in enumerate(hf.model.layers)
        if hasattr(layer.mlp, "router")
    ]
    reference(hf)
    for hook in hooks:
        hook.remove()
    assert len(chosen) == 3 and all(c == set(range(8)) for c in chosen.values())


def _variants(hf):
    """Pairs of copies of `hf` (its weights) that differ in one feature alone: the one
    with it, the one without it."""

    def copy(**overrides):
        other = hf_model(**overrides)
        other.load_state_dict(hf.state_dict())
        return other

    ungated, unbiased, single_norms = copy(), copy(), copy()
    with torch.no_grad():
        for layer in ungated.model.layers:
            layer.self_attn.gate_proj.weight.zero_()  # sigmoid 0.5 for every output
        for layer in unbiased.model.layers[1:]:
            layer.mlp.expert_bias.zero_()
        for layer in single_norms.model.layers:
            layer.post_attention_layernorm.weight.fill_(1.0)
            layer.post_mlp_layernorm.weight.fill_(1.0)
    unwindowed = copy(sliding_window=64)  # wider than the sequence
    return {
        "gate": (hf, ungated),
        "selection bias": (hf, unbiased),
        "post norms": (hf, single_norms),
        "window": (hf, unwindowed),
        "global layer without RoPE": (
            unwindowed,
            copy(sliding_window=64, layer_types=["sliding_attention"] * 4),
        ),
        "muP": (hf, copy(mup_enabled=False)),
        "route_scale": (hf, copy(route_scale=1.0)),
    }


def test_each_feature_moves_the_logits(family):
    """Each feature moves transformers' logits by far more than the tolerance, and
    llmrun follows the model without it."""
    hf, _ = family
    for name, (with_it, without_it) in _variants(hf).items():
        expected = reference(without_it)
        assert max_diff(reference(with_it), expected) > 0.1, name
        assert max_diff(cached_logits(ours(without_it), IDS), expected) < 1e-4, name


def softmax_router(self, hidden_states, expert_bias):
    """Arcee's router with score_func "softmax" (transformers' takes sigmoid alone)."""
    logits = self.gate(hidden_states.view(-1, hidden_states.shape[-1])).float()
    scores = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.route_scale, chosen


def unnormalized_router(self, hidden_states, expert_bias):
    """Arcee's router with route_norm false: the top-k sigmoid scores as they are."""
    logits = self.gate(hidden_states.view(-1, hidden_states.shape[-1])).float()
    scores = torch.sigmoid(logits)
    _, chosen = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
    return logits, scores.gather(1, chosen) * self.route_scale, chosen


ROUTERS = {
    "softmax": (softmax_router, {"score_func": "softmax"}),
    "no renormalization": (unnormalized_router, {"route_norm": False}),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_arcee_s_routing_switches_match_its_router(family, monkeypatch, name):
    """score_func and route_norm, which transformers does not read, against its router
    patched to compute them as Arcee's code does; each moves the logits."""
    hf, expected = family
    router, config = ROUTERS[name]
    monkeypatch.setattr(
        transformers.models.afmoe.modeling_afmoe.AfmoeTokenChoiceRouter, "forward", router
    )
    patched = reference(hf)
    assert max_diff(patched, expected) > 0.1
    assert max_diff(cached_logits(ours(hf, **config), IDS), patched) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks, the windowed layers also in a pool of their own."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected, windowed="afmoe", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    check_rounded_cache(ours(family[0]), cache_type)


def test_the_static_decode_step_is_not_offered(family):
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: AFMoE decodes through its forward."""
    from llmrun import static_decode

    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


# ---- GGUF, as llama.cpp's converter writes "afmoe" -------------------------------------

LAYER_NAMES = {
    **MOE_LAYER_GGUF_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_mlp_layernorm": "ffn_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "self_attn.gate_proj": "attn_gate",
    "mlp.router.gate": "ffn_gate_inp",
}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: rows as they are, experts stacked
    [E, rows, cols], the selection bias as exp_probs_b.bias."""
    return fused_experts_gguf_tensors(model, LAYER_NAMES, {"mlp.expert_bias": "exp_probs_b.bias"})


def afmoe_keys(config, route_norm=True) -> dict:
    """The "{arch}" keys the converter writes: TextModel's (expert_gating_func from a
    released config's score_func "sigmoid", key/value length from head_dim), LlamaModel's
    (vocab size, rope dimension count) and AfmoeModel's (route_norm as a released
    config.json has it)."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    return {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GATING_FUNC: 2,  # ExpertGatingFuncType.SIGMOID
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.VOCAB_SIZE: c.vocab_size,
        R.DIMENSION_COUNT: c.head_dim,
        L.EXPERT_SHARED_COUNT: c.num_shared_experts,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.LEADING_DENSE_BLOCK_COUNT: c.num_dense_layers,
        L.EXPERT_WEIGHTS_NORM: route_norm,
        L.EXPERT_WEIGHTS_SCALE: float(c.route_scale),
        A.SLIDING_WINDOW: c.sliding_window,
    }


def write_afmoe(path, model, qtype=None, metadata=None):
    """An afmoe GGUF of the model: the converter's metadata (with `metadata` changed;
    None leaves a key out), its tensors, 2-D and 3-D ones but the router in `qtype`
    (default F32), stories260K's tokenizer."""
    keys = {**afmoe_keys(model.config), **(metadata or {})}
    return write_keyed_gguf(path, "afmoe", keys, gguf_tensors(model), qtype)


def test_an_afmoe_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_afmoe(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "afmoe" and config["mup_enabled"]
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds blocks of each row, the
    rows of transformers' tensors)."""
    hf = hf_model()
    path = write_afmoe(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf, "router.gate.weight")
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(family, tmp_path):
    """llama.cpp's defaults: no expert_weights_norm, no renormalization (Arcee's
    route_norm false); no scale, route_scale 1; no gating function, sigmoid."""
    hf, _ = family
    absent = {
        Keys.LLM.EXPERT_WEIGHTS_NORM: None,
        Keys.LLM.EXPERT_GATING_FUNC: None,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: None,
    }
    loaded = load_model(write_afmoe(tmp_path / "m.gguf", hf, metadata=absent), CPU, "f32")
    config = loaded.checkpoint.config
    assert (config["route_norm"], config["route_scale"], config["score_func"]) == (
        False,
        1.0,
        "sigmoid",
    )
    expected = cached_logits(ours(hf, route_norm=False, route_scale=1.0), IDS)
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-5


def test_a_softmax_gated_gguf_matches_arcee_s_router(family, monkeypatch, tmp_path):
    hf, _ = family
    path = write_afmoe(tmp_path / "m.gguf", hf, metadata={Keys.LLM.EXPERT_GATING_FUNC: 1})
    monkeypatch.setattr(
        transformers.models.afmoe.modeling_afmoe.AfmoeTokenChoiceRouter, "forward", softmax_router
    )
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_a_window_attends_everywhere_and_skips_rope_every_fourth(tmp_path):
    """No window: every layer sees all earlier positions, and llama.cpp still rotates all
    but every fourth layer (as transformers runs a config without a window)."""
    hf = hf_model(sliding_window=None)
    path = write_afmoe(tmp_path / "m.gguf", hf, metadata={Keys.Attention.SLIDING_WINDOW: None})
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["sliding_window"] is None
    unwindowed = hf_model(sliding_window=64)
    unwindowed.load_state_dict(hf.state_dict())
    assert max_diff(cached_logits(loaded.model, IDS), reference(unwindowed)) < 1e-4


def test_a_gguf_s_local_rope_base_turns_its_rotating_layers(family, tmp_path):
    """rope.freq_base_swa, where a file has it, is the base of the local layers, the
    only ones that rotate."""
    hf, expected = family
    bases = {Keys.Rope.FREQ_BASE: 1e6, Keys.Rope.FREQ_BASE_SWA: CONFIG["rope_theta"]}
    loaded = load_model(write_afmoe(tmp_path / "m.gguf", hf, metadata=bases), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


REFUSED = {
    "expert groups": ({Keys.LLM.EXPERT_GROUP_COUNT: 4}, UnsupportedError, "grouped"),
    "no experts used": ({Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError, "experts"),
    "sqrt-softplus gating": ({Keys.LLM.EXPERT_GATING_FUNC: 4}, UnsupportedError, "gating"),
    "no shared expert count": ({Keys.LLM.EXPERT_SHARED_COUNT: None}, ModelFormatError, "missing"),
    "expert widths differing by layer": (
        {Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: [32, 32, 16, 32]},
        UnsupportedError,
        "differs between layers",
    ),
    "local layers llama.cpp does not rotate": (
        {Keys.Attention.SLIDING_WINDOW_PATTERN: [True, True, False, False]},
        UnsupportedError,
        "does not guess",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(family, tmp_path, case):
    metadata, error, message = REFUSED[case]
    path = write_afmoe(tmp_path / "m.gguf", family[0], metadata=metadata)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_show_describes_an_afmoe_gguf(family, tmp_path):
    path = write_afmoe(tmp_path / "m.gguf", family[0])
    # Keys and values of 2 heads of 16, f32: three local layers of 5 positions, one global.
    per_position = 2 * 2 * 16 * 4
    check_show(path, "afmoe", per_position * (3 * 5 + 8192), moe=True)


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, write_afmoe(tmp_path / "afmoe.gguf", hf), "afmoe")

"""Laguna against transformers' LagunaForCausalLM: from config.json-style dicts with the
Hub's keys (mlp.experts.e_score_correction_bias, mlp.shared_expert, one key per
expert), from a folder transformers saves, and from "laguna" GGUFs written as
llama.cpp's converter writes them (conversion/laguna.py LagunaModel: a head count per
layer, the global layers' RoPE as the plain keys and the sliding layers' as the *_swa
ones, the window, leading_dense_block_count, the gate as attn_gate, the selection bias
as exp_probs_b.bias, the experts stacked, q/k rows as they are).

Two shapes: XS.2's (a global layer then three sliding ones, which is llama.cpp's
pattern, per-layer heads 4/8/8/8, a gate per head) and M.1's (every layer global,
YaRN, a gate per feature, two dense layers, q/k/v/o biases). Their features each move
the logits by far more than the tolerance (test_each_feature_changes_the_logits), and
the ones a config cannot switch off alone (the per-layer heads, the gate, the q/k
norms' place before RoPE) were checked by breaking llmrun's code: the parity tests
fail.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole and
through the KV cache (chunked prefill, then one token at a time), contiguous or paged.
A Q8_0 GGUF: 1e-4 against transformers running the weights gguf dequantizes (the
router kept in F32, as the converter keeps it). Cache types: test_cache_types' checks.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_and_show,
    check_show,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model, randomize
from moe_helpers import (
    MOE_LAYER_GGUF_NAMES,
    fused_experts_gguf_tensors,
    round_matrices_but_the_routers,
)
from test_cache_types import TOLERANCE

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ARCH = "laguna"
SLIDING = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
COMMON = dict(
    model_type="laguna",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=3,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # Laguna-XS.2's shape.
    "xs": dict(
        num_attention_heads_per_layer=[4, 8, 8, 8],
        layer_types=SLIDING,
        sliding_window=5,
        gating=True,
        moe_routed_scaling_factor=2.0,
        rope_parameters={
            "full_attention": dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
            ),
            "sliding_attention": dict(rope_type="default", rope_theta=100.0),
        },
    ),
    # Laguna-M.1's shape, YaRN on the global layers.
    "m": dict(
        layer_types=["full_attention"] * 4,
        sliding_window=0,  # none (the converter writes no window)
        gating="per-element",
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
        attention_bias=True,
        moe_routed_scaling_factor=1.5,
        rope_parameters={
            "full_attention": dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                partial_rotary_factor=0.5,
            ),
            "sliding_attention": dict(rope_type="default", rope_theta=1000.0),
        },
    ),
}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str, **overrides):
    """A tiny transformers model of CONFIGS[name]: randomize()'s weights, attention
    outputs smaller (so that tokens do not look alike to the routers), and selection
    biases drawn large enough to change the choice."""
    config = transformers.AutoConfig.for_model(**{**COMMON, **CONFIGS[name], **overrides})
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


# transformers' names -> the Hub's (the reverse of conversion_mapping.py's laguna renames).
HUB_NAMES = {
    ".mlp.gate.e_score_correction_bias": ".mlp.experts.e_score_correction_bias",
    ".mlp.shared_experts.": ".mlp.shared_expert.",
}


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: its names for the selection bias and the shared
    expert, one key per expert and projection."""
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition(".mlp.experts.")
        if sep and tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}.mlp.experts.{e}.up_proj.weight"] = value[e, width:]
            continue
        if sep and tail == "down_proj":
            for e in range(value.shape[0]):
                out[f"{head}.mlp.experts.{e}.down_proj.weight"] = value[e]
            continue
        for new, old in HUB_NAMES.items():
            key = key.replace(new, old)
        out[key] = value
    return out


def ours(hf):
    """llmrun's model of `hf`, loaded as a Hub folder is: its keys renamed at the loader
    edge (llmrun/loading/laguna.hf_weights)."""
    from llmrun.loading import laguna

    config = hf.config.to_dict()
    state = laguna.hf_weights(dict(hub_state_dict(hf)), config, lambda t: t)
    return our_model(config, state)


@pytest.mark.parametrize(
    "name,overrides",
    [("xs", {}), ("m", {}), ("m", {"moe_router_logit_softcapping": 0.5})],
    ids=["xs", "m", "m-softcapped"],
)
def test_matches_transformers_whole_and_through_the_cache(name, overrides):
    hf = hf_model(name, **overrides)
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6 (longer and shorter than the window of 5), then one
    # token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def with_full_rope(name: str) -> dict:
    rope = {k: dict(v) for k, v in CONFIGS[name]["rope_parameters"].items()}
    rope["full_attention"]["partial_rotary_factor"] = 1.0
    return {"rope_parameters": rope}


def with_sliding_base(name: str) -> dict:
    rope = {k: dict(v) for k, v in CONFIGS[name]["rope_parameters"].items()}
    rope["sliding_attention"]["rope_theta"] = 10000.0
    return {"rope_parameters": rope}


def without_yarn(name: str) -> dict:
    rope = {k: dict(v) for k, v in CONFIGS[name]["rope_parameters"].items()}
    rope["full_attention"] = dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
    )
    return {"rope_parameters": rope}


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests above
# check every one of them.
FEATURES = {
    "selection bias": ("xs", {}),  # the biases zeroed below
    "routed scaling factor": ("xs", {"moe_routed_scaling_factor": 1.0}),
    "shared expert": ("xs", {}),  # its output zeroed below
    "sliding window": ("xs", {"layer_types": ["full_attention"] * 4}),
    "partial RoPE of the global layers": ("xs", with_full_rope("xs")),
    "the sliding layers' RoPE base": ("xs", with_sliding_base("xs")),
    "YaRN": ("m", without_yarn("m")),
    "router soft-capping": ("m", {"moe_router_logit_softcapping": 0.5}),
    "mlp_layer_types": ("m", {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}),
    "attention_bias": ("m", {"attention_bias": False}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    name, change = FEATURES[feature]
    with_feature, without = hf_model(name), hf_model(name, **change)
    load_matching_weights(with_feature, without)
    with torch.no_grad():
        for layer in without.model.layers:
            if feature == "selection bias" and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
            if feature == "shared expert" and hasattr(layer.mlp, "shared_experts"):
                layer.mlp.shared_experts.down_proj.weight.zero_()
    assert max_diff(reference(without), reference(with_feature)) > 0.1


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"gating": False}, UnsupportedError, "gating"),
        ({"moe_apply_router_weight_on_input": True}, UnsupportedError, "router_weight_on_input"),
        ({"num_attention_heads_per_layer": [4, 8, 8]}, ModelFormatError, "heads_per_layer"),
        ({"rope_parameters": {"rope_type": "default"}}, ModelFormatError, "keyed by layer type"),
    ],
)
def test_configs_llmrun_cannot_run_are_refused(change, error, match):
    from llmrun.models import laguna

    with pytest.raises(error, match=match):
        laguna.ModelArgs.from_config({**COMMON, **CONFIGS["xs"], **change})


def test_paged_cache_gives_the_contiguous_logits(monkeypatch):
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py),
    the sliding layers in a pool of their own too."""
    hf = hf_model("xs")
    check_paged(ours(hf), IDS, reference(hf), windowed="laguna", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values (what
    test_cache_types holds every family to). Only f16's drift from f32 is bounded: in
    bf16 or q8_0 a rounding can send a token to other experts."""
    f16 = cache_type == "f16"
    check_rounded_cache(
        ours(hf_model("xs")), cache_type, TOLERANCE["f16"] if f16 else None, moves=f16
    )


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: Laguna decodes through its forward."""
    from llmrun import static_decode

    model = ours(hf_model("xs"))
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_saved_folder_loads(tmp_path):
    """What transformers saves of a model (its names, experts stacked or not)."""
    hf = hf_model("xs")
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None  # not a family the native step knows
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


# ---- GGUF, as llama.cpp's converter writes "laguna" ---------------------------------------

LAYER_NAMES = {**MOE_LAYER_GGUF_NAMES, "self_attn.g_proj": "attn_gate"}


def laguna_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array, in llama.cpp's layout: rows as they are, experts stacked
    [E, out, in], the selection bias as blk.N.exp_probs_b.bias."""
    return fused_experts_gguf_tensors(
        model, LAYER_NAMES, {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
    )


def laguna_keys(config) -> dict:
    """The "{arch}" keys llama.cpp's converter writes for the config."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    full, sliding = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    leading = 0
    for kind in c.mlp_layer_types:
        if kind != "dense":
            break
        leading += 1
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: list(c.num_attention_heads_per_layer),
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(full["rope_theta"]),
        R.FREQ_BASE_SWA: float(sliding["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.VOCAB_SIZE: c.vocab_size,
        A.SLIDING_WINDOW: c.sliding_window or None,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_SHARED_FEED_FORWARD_LENGTH: c.shared_expert_intermediate_size,
        L.EXPERT_WEIGHTS_NORM: True,
        L.EXPERT_WEIGHTS_SCALE: float(c.moe_routed_scaling_factor),
        L.EXPERT_GATING_FUNC: 2,  # ExpertGatingFuncType.SIGMOID
        L.LEADING_DENSE_BLOCK_COUNT: leading,
        R.DIMENSION_COUNT: int(c.head_dim * full.get("partial_rotary_factor", 1.0)),
        R.DIMENSION_COUNT_SWA: int(c.head_dim * sliding.get("partial_rotary_factor", 1.0)),
    }
    if full["rope_type"] == "yarn":
        keys.update(
            {
                R.SCALING_TYPE: "yarn",
                R.SCALING_FACTOR: float(full["factor"]),
                R.SCALING_ORIG_CTX_LEN: full["original_max_position_embeddings"],
            }
        )
    return keys


def write_laguna(path, model, qtype=None, metadata=None):
    """A laguna GGUF of the model: its metadata as the converter writes it (with
    `metadata` changed; None leaves a key out), its tensors, 2-D and 3-D ones but the
    router in `qtype` (default F32), stories260K's tokenizer."""
    keys = {**laguna_keys(model.config), **(metadata or {})}
    return write_keyed_gguf(path, ARCH, keys, laguna_tensors(model), qtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_laguna_gguf_matches_transformers(tmp_path, name):
    hf = hf_model(name)
    loaded = load_model(write_laguna(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "laguna"
    assert config["layer_types"] == hf.config.layer_types
    assert config["num_attention_heads_per_layer"] == hf.config.num_attention_heads_per_layer
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(tmp_path):
    """No gating key: sigmoid; no weights scale: none; no *_swa RoPE keys: the sliding
    layers turn as the global ones (llama.cpp's defaults)."""
    rope = {
        "full_attention": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        "sliding_attention": dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
        ),
    }
    hf = hf_model("xs", moe_routed_scaling_factor=1.0, rope_parameters=rope)
    absent = {
        Keys.LLM.EXPERT_GATING_FUNC: None,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: None,
        Keys.Rope.FREQ_BASE_SWA: None,
        Keys.Rope.DIMENSION_COUNT_SWA: None,
    }
    loaded = load_model(write_laguna(tmp_path / "m.gguf", hf, metadata=absent), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds each row's blocks, which
    are the rows of transformers' tensors)."""
    hf = hf_model("xs")
    path = write_laguna(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


REFUSED = {
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "no weights norm": ({Keys.LLM.EXPERT_WEIGHTS_NORM: None}, UnsupportedError),
    "no leading dense count": ({Keys.LLM.LEADING_DENSE_BLOCK_COUNT: None}, ModelFormatError),
    "heads for 3 of 4 layers": ({Keys.Attention.HEAD_COUNT: [4, 8, 8]}, ModelFormatError),
    "a gate of neither width": ({Keys.Attention.HEAD_COUNT: [4, 4, 8, 8]}, ModelFormatError),
    "a YaRN magnitude llama.cpp ignores": (
        {
            Keys.Rope.SCALING_TYPE: "yarn",
            Keys.Rope.SCALING_FACTOR: 4.0,
            Keys.Rope.SCALING_YARN_ATTN_FACTOR: 1.0,
        },
        UnsupportedError,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_laguna(tmp_path / "m.gguf", hf_model("xs"), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_describes_a_laguna_gguf(tmp_path):
    path = write_laguna(tmp_path / "m.gguf", hf_model("xs"))
    # Keys and values of 2 heads of 32 in f32: the global layer's 8192 positions, the
    # three sliding layers' window of 5.
    per_position = 2 * 2 * 32 * 4
    check_show(path, ARCH, per_position * (8192 + 3 * 5), moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model("xs")
    check_run_and_show(hf, write_laguna(tmp_path / "m.gguf", hf), ARCH)

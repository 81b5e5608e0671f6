"""Mellum against transformers' MellumForCausalLM: from config.json-style dicts with the
Hub's keys (one key per expert), from a folder transformers saves, and from "mellum"
GGUFs written as llama.cpp's converter writes them (conversion/mellum.py MellumModel:
TextModel's keys, the global layers' RoPE base as rope.freq_base and the sliding ones'
as rope.freq_base_swa, the window and a flag per layer, the experts' width, the experts
stacked, q/k rows as they are).

The model: sliding and global layers with RoPE bases of their own, q/k norms, softmax
experts renormalized (norm_topk_prob), and in the Hub-folder tests a dense first layer
(mlp_layer_types; llama.cpp's mellum has none, so the GGUF tests have experts in every
layer). Each feature a config switches moves the logits by far more than the tolerance
(test_each_feature_changes_the_logits); the q/k norms and the per-type RoPE were checked
by breaking llmrun's code: the parity tests fail.

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
ARCH = "mellum"
# llama.cpp's layer pattern where a file lists none (every fourth layer global).
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
CONFIG = dict(
    model_type="mellum",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=3,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    sliding_window=5,
    layer_types=LAYER_TYPES,
    mlp_layer_types=["sparse"] * 4,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    bos_token_id=1,
    eos_token_id=2,
)
DENSE_FIRST = {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers Mellum (vocab 512, f32, eval): randomize()'s weights, attention
    outputs smaller (so that tokens do not look alike to the routers)."""
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.03})
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub's keys: one key per expert and projection."""
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
            out[key] = value
    return out


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


@pytest.mark.parametrize("overrides", [{}, DENSE_FIRST], ids=["experts", "dense-first"])
def test_matches_transformers_whole_and_through_the_cache(overrides):
    hf = hf_model(**overrides)
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6 (longer and shorter than the window of 5), then one
    # token at a time.
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_the_default_config_rotates_by_mellums_bases():
    """No rope_parameters: MellumConfig's (5e5 global, 1e4 sliding, whole heads)."""
    config = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}
    hf = hf_model(rope_parameters=None)
    assert (
        max_diff(our_model(config, hub_state_dict(hf))(IDS, torch.arange(40)[None]), reference(hf))
        < 1e-4
    )


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests above
# check every one of them.
FEATURES = {
    "sliding window": {"layer_types": ["full_attention"] * 4},
    "the sliding layers' RoPE base": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    },
    "norm_topk_prob": {"norm_topk_prob": False},
    "mlp_layer_types": DENSE_FIRST,
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    with_feature, without = hf_model(), hf_model(**FEATURES[feature])
    load_matching_weights(with_feature, without)
    assert max_diff(reference(without), reference(with_feature)) > 0.1


def test_norm_topk_prob_false_matches_transformers():
    hf = hf_model(norm_topk_prob=False)
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize(
    "change,match",
    [
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
        ({"rope_parameters": {"rope_type": "default"}}, "keyed by layer type"),
        ({"sliding_window": None}, "sliding_window"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_configs_llmrun_cannot_run_are_refused(change, match):
    from llmrun.models import mellum

    with pytest.raises(ModelFormatError, match=match):
        mellum.ModelArgs.from_config({**CONFIG, **change})


def test_paged_cache_gives_the_contiguous_logits(monkeypatch):
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py),
    the sliding layers in a pool of their own too."""
    hf = hf_model()
    check_paged(ours(hf), IDS, reference(hf), windowed="mellum", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values (what
    test_cache_types holds every family to). Only f16's drift from f32 is bounded: in
    bf16 or q8_0 a rounding can send a token to other experts."""
    f16 = cache_type == "f16"
    check_rounded_cache(ours(hf_model()), cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_static_decode_step_is_not_offered():
    """The static step CUDA graphs capture cannot hold a router that reads its choices
    back to the host: Mellum decodes through its forward."""
    from llmrun import static_decode

    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_saved_folder_loads(tmp_path):
    """What transformers saves of a model (its names, experts stacked or not), with a
    dense layer; the native decode step stays off (a family it does not know)."""
    from safetensors.torch import save_file

    hf = hf_model(**DENSE_FIRST)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4
    # transformers' own names: the experts stacked, and a multi-token-prediction layer
    # (mtp.*) that transformers ignores.
    hf.config.save_pretrained(tmp_path / "stacked")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any("gate_up_proj" in k for k in state)
    state["mtp.0.input_layernorm.weight"] = torch.ones(CONFIG["hidden_size"])
    save_file(state, tmp_path / "stacked" / "model.safetensors")
    loaded = load_model(tmp_path / "stacked", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


# ---- GGUF, as llama.cpp's converter writes "mellum" ---------------------------------------


def mellum_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array, in llama.cpp's layout: rows as they are, experts stacked
    [E, out, in]."""
    return fused_experts_gguf_tensors(model, MOE_LAYER_GGUF_NAMES, {})


def mellum_keys(config) -> dict:
    """The "{arch}" keys llama.cpp's converter writes for the config (TextModel's, then
    MellumModel's)."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    full, sliding = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    return {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(full["rope_theta"]),
        R.FREQ_BASE_SWA: float(sliding["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        A.SLIDING_WINDOW: c.sliding_window,
        A.SLIDING_WINDOW_PATTERN: [kind == "sliding_attention" for kind in c.layer_types],
    }


def write_mellum_gguf(path, hf_model, qtype=None, metadata=None):
    """A mellum GGUF of `hf_model` as llama.cpp's converter writes it: its metadata (with
    `metadata` changed; None leaves a key out), its tensors, 2-D and 3-D ones but the
    router in `qtype` (default F32), stories260K's tokenizer."""
    keys = {**mellum_keys(hf_model.config), **(metadata or {})}
    return write_keyed_gguf(path, ARCH, keys, mellum_tensors(hf_model), qtype)


def test_a_mellum_gguf_matches_transformers(tmp_path):
    hf = hf_model(layer_types=["full_attention", "sliding_attention"] * 2)
    loaded = load_model(write_mellum_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "mellum"
    assert config["layer_types"] == hf.config.layer_types
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_the_optional_keys_reads_as_llama_cpp_does(tmp_path):
    """No layer pattern: every fourth layer global; no *_swa base: the global one; no
    window: every layer global (llama.cpp's defaults)."""
    same_base = {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    hf = hf_model(rope_parameters=same_base)
    absent = {Keys.Attention.SLIDING_WINDOW_PATTERN: None, Keys.Rope.FREQ_BASE_SWA: None}
    loaded = load_model(write_mellum_gguf(tmp_path / "m.gguf", hf, metadata=absent), CPU, "f32")
    assert loaded.checkpoint.config["layer_types"] == LAYER_TYPES
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4
    hf = hf_model(layer_types=["full_attention"] * 4)
    no_window = {Keys.Attention.SLIDING_WINDOW: None, Keys.Attention.SLIDING_WINDOW_PATTERN: None}
    loaded = load_model(write_mellum_gguf(tmp_path / "n.gguf", hf, metadata=no_window), CPU, "f32")
    assert loaded.checkpoint.config["layer_types"] == ["full_attention"] * 4
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0 (the converter keeps ffn_gate_inp in f32);
    the reference holds the same rounded values (Q8_0 rounds each row's blocks, which
    are the rows of transformers' tensors)."""
    hf = hf_model()
    path = write_mellum_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


REFUSED = {
    "no expert width": ({Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: None}, ModelFormatError),
    "no experts": ({Keys.LLM.EXPERT_COUNT: None}, ModelFormatError),
    "a partly rotated head": ({Keys.Rope.DIMENSION_COUNT: 16}, UnsupportedError),
    "YaRN": ({Keys.Rope.SCALING_TYPE: "yarn", Keys.Rope.SCALING_FACTOR: 4.0}, UnsupportedError),
    "flags for 3 of 4 layers": (
        {Keys.Attention.SLIDING_WINDOW_PATTERN: [True, True, False]},
        ModelFormatError,
    ),
    "values wider than keys": ({Keys.Attention.VALUE_LENGTH: 64}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_mellum_gguf(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_a_gguf_with_a_dense_layer_is_refused(tmp_path):
    """llama.cpp's mellum gives every layer experts; a dense layer's tensors are refused."""
    tensors = mellum_tensors(hf_model(**DENSE_FIRST))
    keys = mellum_keys(hf_model().config)
    path = write_keyed_gguf(tmp_path / "m.gguf", ARCH, keys, tensors)
    with pytest.raises(UnsupportedError, match="no experts"):
        load_model(path, CPU, "f32")


def test_show_describes_a_mellum_gguf(tmp_path):
    path = write_mellum_gguf(tmp_path / "m.gguf", hf_model())
    # Keys and values of 2 heads of 32 in f32: the global layer's 8192 positions, the
    # three sliding layers' window of 5.
    per_position = 2 * 2 * 32 * 4
    check_show(path, ARCH, per_position * (8192 + 3 * 5), moe=True)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    check_run_and_show(hf, write_mellum_gguf(tmp_path / "m.gguf", hf), ARCH)

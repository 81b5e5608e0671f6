"""Apertus against transformers' ApertusForCausalLM, from a config.json and from an
"apertus" GGUF written as llama.cpp's converter writes it (conversion/llama.py
ApertusModel: LlamaModel's keys, vocab_size and rope.dimension_count, q/k rows as they
are, Llama 3 scaling as a rope_freqs tensor of per-frequency divisors, the norms as
attn_norm and ffn_norm, and each layer's xIELU parameters, as HF stores them, in the
global xielu.* arrays instead of tensors).

Its features each move the logits by far more than the tolerance
(test_each_feature_moves_the_logits): the xIELU parameters of each layer (a model whose
layers all take the first layer's differs), the q/k norms, Llama 3's RoPE scaling.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
"""

import math

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from helpers import BASE, cached_logits, gguf_name, our_model, randomize

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
# Llama 3 scaling whose original context (64) leaves some wavelengths of 8-wide heads
# as they are, smooths some and scales the rest.
ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
CONFIG = dict(BASE, model_type="apertus", num_hidden_layers=3, rope_parameters=ROPE)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 3.4e-3, bf16 2.8e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}
XIELU_FIELDS = ("alpha_p", "alpha_n", "beta", "eps")


def hf_model(**overrides):
    """A tiny transformers Apertus with randomize()'s weights, and xIELU parameters of
    its own in each layer (beta drawn in 0.3..0.7 where transformers starts all at 0.5)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    draw = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            act = getattr(layer.mlp.act_fn, "beta", None)
            if act is not None:
                act.copy_(0.3 + 0.4 * torch.rand((), generator=draw))
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


# Apertus's norms, as the converter names them (tensor_mapping's "apertus" entries).
NORM_NAMES = {"attention_layernorm": "attn_norm", "feedforward_layernorm": "ffn_norm"}


def apertus_gguf_name(name: str) -> str:
    if name == "rope_freqs.weight":
        return name
    parts = name.split(".")
    if parts[-2] in NORM_NAMES:
        return f"blk.{parts[2]}.{NORM_NAMES[parts[-2]]}.weight"
    return gguf_name(name)


def rope_freqs(config) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' divisors for Llama 3 scaling."""
    params = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * params["rope_theta"] ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def xielu_arrays(hf) -> dict[str, list[float]]:
    """Each xIELU field's per-layer values, as ApertusModel.modify_tensors collects them."""
    return {
        field: [float(getattr(layer.mlp.act_fn, field).detach()) for layer in hf.model.layers]
        for field in XIELU_FIELDS
    }


def write_apertus_gguf(path, hf, qtype=None, xielu=None, rope_dims=None):
    """The model as llama.cpp's converter writes Apertus: LlamaModel's keys, tensors
    unpermuted, xIELU's values as the xielu.* arrays (`xielu` changes them: a field ->
    values, a number, or None to leave the key out), 2-D weights in `qtype`."""
    config = hf.config
    writer = gguf_writer(path, "apertus", config, key_length=False)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(rope_dims or config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    values = {**xielu_arrays(hf), **(xielu or {})}
    for field, value in values.items():
        key = getattr(gguf.Keys.xIELU, field.upper())
        if isinstance(value, list):
            writer.add_array(key, value)
        elif value is not None:
            writer.add_float32(key, value)
    state = {k: v for k, v in hf.state_dict().items() if ".act_fn." not in k}
    if config.rope_parameters["rope_type"] == "llama3":
        state["rope_freqs.weight"] = torch.from_numpy(rope_freqs(config))
    return finish_stories_gguf(writer, path, state, apertus_gguf_name, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits(family):
    """Every layer taking the first layer's xIELU parameters, q/k norms of ones, or RoPE
    without Llama 3's scaling: each changes the logits by far more than the tolerance,
    and llmrun follows each variant."""
    hf, expected = family
    shared = hf_model()
    with torch.no_grad():
        first = shared.model.layers[0].mlp.act_fn
        for layer in shared.model.layers[1:]:
            for field in XIELU_FIELDS:
                getattr(layer.mlp.act_fn, field).copy_(getattr(first, field))
    unnormed = hf_model()
    with torch.no_grad():
        for layer in unnormed.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    unscaled = hf_model(rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    for variant in (shared, unnormed, unscaled):
        assert max_diff(reference(variant), expected) > 0.1
        assert max_diff(cached_logits(ours(variant), IDS), reference(variant)) < 1e-4


def test_a_config_without_rope_settings_takes_apertus_llama3_default():
    from llmrun.models.apertus import ModelArgs

    config = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}
    params = ModelArgs.from_config(config).rope_parameters
    expected = transformers.AutoConfig.for_model(**config).rope_parameters
    assert params["rope_type"] == expected["rope_type"] == "llama3"
    for name in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
        assert params[name] == expected[name]
    assert params["original_max_position_embeddings"] == 8192


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_apertus_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "apertus" and config["hidden_act"] == "xielu"
    assert "freq_factors" in config["rope_parameters"]
    # The native decode step does not know this family: it stays off.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_read_with_one_layer_s_xielu_values_would_differ(family, tmp_path):
    """The per-layer arrays are read per layer: a file whose arrays repeat the first
    layer's value gives other logits (by far more than the tolerance)."""
    hf, expected = family
    first = {field: values[0] for field, values in xielu_arrays(hf).items()}
    path = write_apertus_gguf(tmp_path / "m.gguf", hf, xielu=first)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) > 0.1


def test_a_gguf_with_one_value_for_all_layers_applies_it_to_each(tmp_path):
    """A number instead of an array: llama.cpp's get_key_or_arr gives every layer it."""
    hf = hf_model()
    with torch.no_grad():
        first = hf.model.layers[0].mlp.act_fn
        for layer in hf.model.layers[1:]:
            for field in XIELU_FIELDS:
                getattr(layer.mlp.act_fn, field).copy_(getattr(first, field))
    scalars = {field: values[0] for field, values in xielu_arrays(hf).items()}
    loaded = load_model(write_apertus_gguf(tmp_path / "m.gguf", hf, xielu=scalars), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_apertus_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize(
    "xielu, message",
    [
        ({"beta": None}, "'xielu.beta' is missing"),
        ({"eps": [-1e-6, -1e-6]}, "one number for each of the 3 layers"),
    ],
)
def test_a_gguf_without_its_xielu_values_is_refused(tmp_path, xielu, message):
    path = write_apertus_gguf(tmp_path / "m.gguf", hf_model(), xielu=xielu)
    with pytest.raises(ModelFormatError, match=message):
        load_model(path, CPU, "f32")


def test_partial_rope_is_refused(tmp_path):
    path = write_apertus_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=8)
    with pytest.raises(ModelFormatError, match="Apertus rotates whole heads"):
        load_model(path, CPU, "f32")


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, write_apertus_gguf(tmp_path / "apertus.gguf", hf), "apertus")

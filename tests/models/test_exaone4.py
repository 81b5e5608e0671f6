"""EXAONE 4.0 against transformers' Exaone4ForCausalLM, from a config.json and from an
"exaone4" GGUF written as llama.cpp's converter writes it (conversion/exaone.py
Exaone4Model: TextModel's keys, q/k rows as they are, the post-sublayer norms as
post_attention_norm and post_ffw_norm, a window with its per-layer flags, Llama 3 RoPE
scaling as a rope_freqs tensor of per-frequency divisors).

Two forms: the 1.2B's (no window: every layer global and rotated; Llama 3 RoPE scaling
past 1024 positions), and the 32B's hybrid (64 layers, as llama.cpp wants it: a window
of 5 in three layers of four, which rotate, and global layers without RoPE). Its
features each move the logits by far more than the tolerance: the norms after the
sublayers (not before), the q/k norms per head, the window, the global layers' NoPE,
the RoPE scaling.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous, paged
or in a ring. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values
rounded to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the
weights gguf dequantizes: 1e-4.
"""

import math

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from family_checks import hf_model_of as hf_model
from helpers import BASE, cached_logits, gguf_name, our_model

from llmrun import static_decode
from llmrun.errors import UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=1000000.0,
    factor=16.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=1024,
)
# The 1.2B's form: no window, every layer global and rotated.
SMALL = dict(
    BASE,
    model_type="exaone4",
    head_dim=32,
    sliding_window=None,
    sliding_window_pattern=None,
    layer_types=["full_attention"] * 2,
    max_position_embeddings=4096,
    rope_parameters=LLAMA3,
)
# The 32B's form: 64 layers (llama.cpp's hybrid needs them), every fourth global.
HYBRID = dict(
    BASE,
    model_type="exaone4",
    num_hidden_layers=64,
    head_dim=32,
    sliding_window=5,
    sliding_window_pattern=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
FORMS = {"small": SMALL, "hybrid": HYBRID}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 5.0e-3 (1.2B form) and 9.8e-3
# (hybrid, 64 layers), bf16 3.0e-2 and 0.16.
DRIFT = {"f16": 2e-2, "bf16": 0.3}
POST_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def exaone_gguf_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    layer, _, norm = module.rpartition(".")
    if norm in POST_NORMS:
        return f"blk.{layer.split('.')[-1]}.{POST_NORMS[norm]}.{suffix}"
    return gguf_name(name)


def llama3_divisors(rope: dict, dim: int) -> np.ndarray:
    """Llama 3 scaling as llama.cpp's converter stores it: a divisor per frequency."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_exaone_gguf(path, hf, qtype=None, pattern=True, window=True, swa_base=None):
    """The model as llama.cpp's converter writes EXAONE 4: TextModel's keys (key and
    value length from head_dim), tensors unpermuted, the window and its flags where the
    config has a window, Llama 3 scaling as rope_freqs. 2-D weights in `qtype` (default
    F32). For the defaults and refusals: no pattern, no window, another sliding base."""
    config = hf.config
    writer = gguf_writer(path, "exaone4", config)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if swa_base is not None:
        writer.add_rope_freq_base_swa(swa_base)
    writer.add_vocab_size(config.vocab_size)
    if config.sliding_window is not None and window:
        writer.add_sliding_window(config.sliding_window)
        if pattern:
            writer.add_sliding_window_pattern(
                [t == "sliding_attention" for t in config.layer_types]
            )
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_divisors(rope, config.head_dim))
    return finish_stories_gguf(writer, path, hf.state_dict(), exaone_gguf_name, qtype)


@pytest.fixture(scope="module", params=list(FORMS))
def family(request):
    hf = hf_model(FORMS[request.param])
    return request.param, hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    _, hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_a_gguf_matches_transformers(family, tmp_path):
    name, hf, expected = family
    loaded = load_model(write_exaone_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "exaone4"
    assert config["layer_types"] == hf.config.layer_types
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(family, tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(FORMS[family[0]])
    loaded = load_model(write_exaone_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    _, hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_each_feature_moves_the_logits():
    """The window (none: all layers global, still without RoPE), the global layers'
    NoPE (a 1.2B-style model with the hybrid's layer types rotates every layer, and
    transformers follows its sliding_window, not layer_types), and the RoPE scaling."""
    expected = reference(hf_model(HYBRID))
    no_window = dict(HYBRID, layer_types=["full_attention"] * 64)
    assert max_diff(reference(hf_model(no_window)), expected) > 0.1
    unscaled = dict(SMALL, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    assert max_diff(reference(hf_model(unscaled)), reference(hf_model(SMALL))) > 0.1
    # 64 layers without a window: all rotate (the hybrid's NoPE layers would not).
    rotated = dict(SMALL, num_hidden_layers=64, layer_types=["full_attention"] * 64)
    hf_rotated, hf_nope = hf_model(rotated), hf_model(no_window)
    assert max_diff(reference(hf_rotated), reference(hf_nope)) > 0.1
    for hf in (hf_rotated, hf_nope):
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_a_string_pattern_reads_as_the_converter_reads_it():
    """sliding_window_pattern "LLLG" without layer_types: three local layers to a global."""
    config = {k: v for k, v in HYBRID.items() if k != "layer_types"}
    hf = hf_model(HYBRID)
    model = our_model(dict(config, sliding_window_pattern="LLLG"), hf.state_dict())
    assert model.args.layer_types == hf.config.layer_types
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16), rows of a batch sharing prefix blocks, and for the hybrid the windowed
    layers in a pool of their own whose blocks are let go and reused."""
    name, hf, expected = family
    windowed = name if name == "hybrid" else None
    check_paged(ours(hf), IDS, expected, windowed, monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    _, hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_native_and_static_decode_steps_are_not_attached(family, tmp_path):
    """The native step computes pre-norm layers: not EXAONE 4's post-norms. The static
    step (CUDA graphs) takes CausalLM's one frame, not EXAONE 4's frame per layer type."""
    loaded = load_model(write_exaone_gguf(tmp_path / "m.gguf", family[1]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(loaded.model)
    cache = loaded.model.new_cache(1, 32, torch.float32, "cpu")
    assert not static_decode.supported(loaded.model, cache)


def test_gguf_defaults_and_refusals(tmp_path):
    """A 64-layer file without a pattern takes llama.cpp's (every fourth layer global),
    without a window llama.cpp's 4096. A window in a model of another size (which
    llama.cpp would run without it, its global layers rotated), even one with no
    sliding layers, and a sliding RoPE base of its own are refused."""
    hf = hf_model(HYBRID)
    no_pattern = write_exaone_gguf(tmp_path / "p.gguf", hf, pattern=False)
    config = config_from_gguf(read_gguf(no_pattern, with_tensors=False))
    assert config["layer_types"] == hf.config.layer_types
    no_window = write_exaone_gguf(tmp_path / "w.gguf", hf, window=False)
    config = config_from_gguf(read_gguf(no_window, with_tensors=False))
    assert config["sliding_window"] == 4096 and config["layer_types"] == hf.config.layer_types
    other_base = write_exaone_gguf(tmp_path / "b.gguf", hf, swa_base=1000.0)
    with pytest.raises(UnsupportedError, match="one RoPE base"):
        load_model(other_base, CPU, "f32")
    small_hybrid = hf_model(dict(HYBRID, num_hidden_layers=4))
    with pytest.raises(UnsupportedError, match="only in a 64-layer model"):
        load_model(write_exaone_gguf(tmp_path / "s.gguf", small_hybrid), CPU, "f32")
    all_global = hf_model(dict(HYBRID, num_hidden_layers=2, layer_types=["full_attention"] * 2))
    with pytest.raises(UnsupportedError, match="only in a 64-layer model"):
        load_model(write_exaone_gguf(tmp_path / "g.gguf", all_global), CPU, "f32")


def test_kv_bytes_count_windowed_layers_as_the_cache_holds_them(tmp_path):
    """`llmrun show`'s torch-free count, the registry's and the allocated cache agree:
    48 layers of five positions, 16 of the whole context."""
    hf = hf_model(HYBRID)
    gguf_config = config_from_gguf(read_gguf(write_exaone_gguf(tmp_path / "m.gguf", hf)))
    for config in (hf.config.to_dict(), gguf_config):
        cache = ours(hf).new_cache(1, 64, torch.float32, "cpu")
        assert inspect.kv_cache_bytes(config, 64) == kv_cache_bytes(config, 64) == cache.nbytes
    assert cache.nbytes == 2 * 2 * 32 * 4 * (48 * 5 + 16 * 64)


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    name, hf, _ = family
    check_run_and_show(hf, write_exaone_gguf(tmp_path / f"{name}.gguf", hf), "exaone4")

"""OLMo 2 and OLMo 3 against transformers' Olmo2ForCausalLM and Olmo3ForCausalLM, from
a config.json and from an "olmo2" GGUF written as llama.cpp's converter writes both
(conversion/olmo.py: TextModel's keys, q/k unpermuted, OLMo 3's sliding window and its
per-layer pattern as a list of flags).

OLMo 2's features each move the logits by far more than the tolerance: its norms after
the sublayers (not before them), its q/k norms over all heads together (not per head);
OLMo 3's sliding window of 5 under 40 tokens, and its sliding layers' plain RoPE (their
own base from a config.json; no YaRN from either source).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous, paged
or in a ring. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values
rounded to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the
weights gguf dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from family_checks import (
    hf_model_of as hf_model,
)
from helpers import (
    BASE,
    cached_logits,
    gguf_name,
    our_model,
    save_hf_dir,
)

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
OLMO2 = dict(BASE, model_type="olmo2", rope_theta=10000.0)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    beta_fast=32.0,
    beta_slow=1.0,
)
# Four layers: llama.cpp's default pattern (every fourth global) and transformers' agree.
# YaRN past the original 16 positions on the global layer, a window of 5 on the others.
OLMO3 = dict(
    BASE,
    model_type="olmo3",
    num_hidden_layers=4,
    max_position_embeddings=64,
    sliding_window=5,
    rope_parameters={
        "full_attention": YARN,
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
POSITIONS = torch.arange(SEQ)[None]
# A typed cache's drift from f32 logits, measured: f16 4.1e-3 (OLMo 2) and 5.6e-3 (OLMo 3),
# bf16 4.4e-2 and 3.8e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}
# GGUF names of the post-sublayer norms; the rest as helpers.gguf_name has them.
POST_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def whole(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, POSITIONS)


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def olmo_gguf_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    layer, _, norm = module.rpartition(".")
    if norm in POST_NORMS:
        return f"blk.{layer.split('.')[-1]}.{POST_NORMS[norm]}.{suffix}"
    return gguf_name(name)


def write_olmo_gguf(path, hf, qtype=None, pattern=True, swa_base=None, rope_dims=None):
    """The model as llama.cpp's converter writes OLMo 2 and 3 (arch olmo2): q/k as they
    are, no key_length or rope dimension count (the config has no head_dim), the
    global layers' RoPE under the usual keys, the sliding layers' base as freq_base_swa,
    and OLMo 3's window with its per-layer flags. 2-D weights in `qtype` (default F32).
    For refusals: no pattern, another sliding base, a rope dimension count."""
    config = hf.config
    writer = gguf_writer(path, "olmo2", config, key_length=False)
    rope = config.rope_parameters
    full = rope.get("full_attention", rope)
    if full["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(swa_base or rope["sliding_attention"]["rope_theta"])
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
        if pattern:
            flags = [t == "sliding_attention" for t in config.layer_types]
            writer.add_sliding_window_pattern(flags)
    return finish_stories_gguf(writer, path, hf.state_dict(), olmo_gguf_name, qtype)


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def family(request):
    hf = hf_model(OLMO2 if request.param == "olmo2" else OLMO3)
    return request.param, hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    _, hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    assert max_diff(whole(model), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    name, hf, expected = family
    loaded = load_model(write_olmo_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == name
    assert max_diff(whole(loaded.model), expected) < 1e-4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(family, tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(family[1].config.to_dict())
    loaded = load_model(write_olmo_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    _, hf, expected = family
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16), rows of a batch sharing prefix blocks, and for OLMo 3 the windowed
    layers in a pool of their own whose blocks are let go and reused."""
    name, hf, expected = family
    windowed = name if name == "olmo3" else None
    check_paged(ours(hf), IDS, expected, windowed, monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    _, hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_olmo3_layers_each_take_their_own_rope_and_window():
    """Each feature moves the logits: a window of 5 (none: all layers global), and the
    sliding layers' own base (that of the global layers instead)."""
    expected = reference(hf_model(OLMO3))
    no_window = dict(OLMO3, layer_types=["full_attention"] * 4)
    assert max_diff(reference(hf_model(no_window)), expected) > 0.1
    own_base = {**OLMO3["rope_parameters"]}
    own_base["sliding_attention"] = {"rope_type": "default", "rope_theta": 100.0}
    hf = hf_model(dict(OLMO3, rope_parameters=own_base))
    assert max_diff(reference(hf), expected) > 0.1
    assert max_diff(whole(ours(hf)), reference(hf)) < 1e-4


def test_an_older_olmo3_config_rotates_its_sliding_layers_as_transformers_does():
    """rope_theta and rope_scaling at the top level are the global layers'; Olmo3Config
    gives the sliding layers its default base, 500000."""
    older = {k: v for k, v in OLMO3.items() if k != "rope_parameters"}
    config = dict(older, rope_theta=10000.0, rope_scaling=YARN)
    hf = hf_model(config)
    assert hf.config.rope_parameters["sliding_attention"]["rope_theta"] == 500000.0
    model = our_model(config, hf.state_dict())
    assert max_diff(whole(model), reference(hf)) < 1e-4


def test_the_native_decode_step_is_attached(family, tmp_path):
    """The native step takes the decoded tokens (tests/quant/test_decode_step.py): the
    GGUF tests above decode through it."""
    model = load_model(write_olmo_gguf(tmp_path / "m.gguf", family[1]), CPU, "f32").model
    assert model.decode_step is not None


def test_olmo3_gguf_defaults_and_refusals(tmp_path):
    """Without a pattern, llama.cpp's default: every fourth layer global. A sliding base
    other than the global one (which llama.cpp would not use) and partial RoPE are
    refused."""
    hf = hf_model(OLMO3)
    no_pattern = write_olmo_gguf(tmp_path / "m.gguf", hf, pattern=False)
    config = config_from_gguf(read_gguf(no_pattern, with_tensors=False))
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    other_base = write_olmo_gguf(tmp_path / "base.gguf", hf, swa_base=1000.0)
    with pytest.raises(UnsupportedError, match="freq_base_swa"):
        load_model(other_base, CPU, "f32")
    partial = write_olmo_gguf(tmp_path / "partial.gguf", hf, rope_dims=8)
    with pytest.raises(ModelFormatError, match="OLMo rotates whole heads"):
        load_model(partial, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    name, hf, _ = family
    check_run_and_show(hf, write_olmo_gguf(tmp_path / f"{name}.gguf", hf), "olmo2")


def test_olmo3_kv_bytes_count_windowed_layers_as_the_cache_holds_them(tmp_path):
    """`llmrun show`'s torch-free count, the registry's and the allocated cache agree:
    three layers of five positions, one of the whole context."""
    hf = hf_model(OLMO3)
    gguf_config = config_from_gguf(read_gguf(write_olmo_gguf(tmp_path / "m.gguf", hf)))
    for config in (hf.config.to_dict(), gguf_config):
        cache = ours(hf).new_cache(1, 64, torch.float32, "cpu")
        assert inspect.kv_cache_bytes(config, 64) == kv_cache_bytes(config, 64) == cache.nbytes
    assert cache.nbytes == 2 * 2 * 16 * 4 * (3 * 5 + 64)


def test_the_static_decode_step_takes_olmo2_and_leaves_olmo3(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does) gives
    OLMo 2 the ordinary logits; OLMo 3's windowed frames are its own, so it keeps the
    ordinary forward."""
    name, hf, _ = family
    model = ours(hf)
    if name == "olmo3":
        monkeypatch.setattr(static_decode, "FIRST_BUCKET", 8)
        assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))
        return
    check_static_decode(model, monkeypatch)

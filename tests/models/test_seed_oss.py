"""Seed-OSS against transformers' SeedOssForCausalLM, from a config.json and from a
"seed_oss" GGUF written as llama.cpp's converter writes it (conversion/olmo.py
SeedOssModel: TextModel's keys with key_length, q/k rows as they are, the norm before
the feed-forward as post_attention_norm, the q/k/v biases).

Its features each move the logits by far more than the tolerance: the q/k/v biases,
the output projection's bias (attention_out_bias, tried on), and heads of 32 features
in a hidden size of 64 with 4 heads (not 16).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time, the native decode
step included where the loader attaches it), contiguous or paged. An f16 or bf16 cache:
1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT from
f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

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
SEED_OSS = dict(BASE, model_type="seed_oss", head_dim=32, rope_theta=10000.0)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.4e-3, bf16 1.3e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**SEED_OSS, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def seed_gguf_name(name: str) -> str:
    if name.endswith("post_attention_layernorm.weight"):
        return f"blk.{name.split('.')[2]}.post_attention_norm.weight"
    return gguf_name(name)


def write_seed_gguf(path, hf, qtype=None, rope_dims=None):
    """The model as llama.cpp's converter writes Seed-OSS: TextModel's keys (key and
    value length from the config's head_dim), tensors unpermuted, 2-D weights in
    `qtype` (default F32). rope_dims: a rope dimension count, for the refusal."""
    config = hf.config
    writer = gguf_writer(path, "seed_oss", config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    return finish_stories_gguf(writer, path, hf.state_dict(), seed_gguf_name, qtype)


@pytest.fixture(scope="module", params=[False, True], ids=["default", "out-bias"])
def family(request):
    hf = hf_model(attention_out_bias=request.param)
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """No q/k/v biases, no output bias, or heads of hidden / heads: each changes the
    logits by far more than the tolerance, and llmrun follows each variant."""
    expected = reference(hf_model(attention_out_bias=True))
    for variant in (
        dict(attention_bias=False, attention_out_bias=True),
        dict(attention_out_bias=False),
        dict(head_dim=None, attention_out_bias=True),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_seed_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "seed_oss" and config["head_dim"] == 32
    assert config["attention_out_bias"] == hf.config.attention_out_bias
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(attention_out_bias=True)
    loaded = load_model(write_seed_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_gives_the_torch_logits(family, tmp_path, monkeypatch):
    """The loader attaches the native step (Llama's layers with biases); its decoded
    logits are those of the torch layers."""
    hf, expected = family
    path = write_seed_gguf(tmp_path / "m.gguf", hf)
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_partial_rope_is_refused(tmp_path):
    path = write_seed_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=16)
    with pytest.raises(ModelFormatError, match="Seed-OSS rotates whole heads"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(attention_out_bias=True)
    check_run_and_show(hf, write_seed_gguf(tmp_path / "seed.gguf", hf), "seed_oss")


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(family[0]), monkeypatch)

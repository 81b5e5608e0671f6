"""Hunyuan dense against transformers' HunYuanDenseV1ForCausalLM, from a config.json and
from a "hunyuan-dense" GGUF written as llama.cpp's converter writes it
(conversion/hunyuan.py HunYuanModel: TextModel's keys with key_length, q/k rows as they
are, query_layernorm and key_layernorm as attn_q_norm and attn_k_norm, NTK-alpha RoPE
as the stretched base with a 256K context, no output matrix when tied).

Its features each move the logits by far more than the tolerance: the per-head q/k
norms after RoPE (checked by moving them before it), NTK-alpha RoPE (alpha 50 against
none), the attention biases where a config has them.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
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
from family_checks import (
    hf_model_of as hf_model,
)
from helpers import BASE, cached_logits, gguf_name, our_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
NTK_ALPHA = dict(rope_type="dynamic", rope_theta=10000.0, alpha=50.0, factor=1.0)
HUNYUAN = dict(
    BASE,
    model_type="hunyuan_v1_dense",
    head_dim=32,
    tie_word_embeddings=True,
    rope_parameters=NTK_ALPHA,
)
FORMS = {"ntk-alpha": HUNYUAN, "biased": dict(HUNYUAN, attention_bias=True)}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 below 5e-3, bf16 below 5e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}
LONG_CONTEXT = 256 * 1024  # what the converter writes for NTK-alpha RoPE


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def hunyuan_gguf_name(name: str) -> str:
    for hf, ours_ in (("query_layernorm", "q_norm"), ("key_layernorm", "k_norm")):
        name = name.replace(f"self_attn.{hf}", f"self_attn.{ours_}")
    return gguf_name(name)


def write_hunyuan_gguf(path, hf, qtype=None, alpha_key=False, rope_dims=None, sections=None):
    """The model as llama.cpp's converter writes Hunyuan dense: TextModel's keys, the
    NTK-alpha base stretched (or, alpha_key, the plain base and rope.scaling.alpha, which
    llama.cpp also reads), no output matrix when tied, 2-D weights in `qtype` (default
    F32). rope_dims, sections: for the refusals."""
    config = hf.config
    rope = config.rope_parameters
    writer = gguf_writer(path, "hunyuan-dense", config, context=False)
    dim = config.head_dim
    if rope["rope_type"] == "dynamic" and not alpha_key:
        writer.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1)
        writer.add_rope_scaling_orig_ctx_len(LONG_CONTEXT)
        writer.add_context_length(LONG_CONTEXT)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_context_length(config.max_position_embeddings)
    if alpha_key:
        writer.add_float32("hunyuan-dense.rope.scaling.alpha", rope["alpha"])
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    if sections is not None:
        writer.add_rope_dimension_sections(sections)
    state = hf.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return finish_stories_gguf(writer, path, state, hunyuan_gguf_name, qtype)


@pytest.fixture(scope="module", params=list(FORMS))
def family(request):
    hf = hf_model(FORMS[request.param])
    return request.param, hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    _, hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_ntk_alpha_rope_moves_the_logits():
    """alpha 50 against plain RoPE of the same base; an older config's rope_scaling
    {type: dynamic, alpha} reads the same."""
    expected = reference(hf_model(HUNYUAN))
    plain = hf_model(dict(HUNYUAN, rope_parameters=dict(rope_type="default", rope_theta=1e4)))
    assert max_diff(reference(plain), expected) > 0.1
    assert max_diff(cached_logits(ours(plain), IDS), reference(plain)) < 1e-4
    older = {k: v for k, v in HUNYUAN.items() if k != "rope_parameters"}
    older.update(rope_theta=10000.0, rope_scaling=dict(type="dynamic", alpha=50.0, factor=1.0))
    model = our_model(older, hf_model(HUNYUAN).state_dict())
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    _, hf, expected = family
    loaded = load_model(write_hunyuan_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "hunyuan_v1_dense" and config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_with_the_alpha_key_stretches_the_base(tmp_path):
    hf = hf_model(HUNYUAN)
    path = write_hunyuan_gguf(tmp_path / "a.gguf", hf, alpha_key=True)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(FORMS["biased"])
    loaded = load_model(write_hunyuan_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    _, hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    _, hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    _, hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """The native step normalizes queries and keys before RoPE: not Hunyuan's order."""
    loaded = load_model(write_hunyuan_gguf(tmp_path / "m.gguf", family[1]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(loaded.model)


def test_refusals(tmp_path):
    hf = hf_model(HUNYUAN)
    partial = write_hunyuan_gguf(tmp_path / "p.gguf", hf, rope_dims=16)
    with pytest.raises(ModelFormatError, match="Hunyuan rotates whole heads"):
        load_model(partial, CPU, "f32")
    sections = write_hunyuan_gguf(tmp_path / "s.gguf", hf, sections=[8, 4, 4, 0])
    with pytest.raises(UnsupportedError, match="M-RoPE sections"):
        config_from_gguf(read_gguf(sections, with_tensors=False))
    dynamic = dict(HUNYUAN, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0))
    with pytest.raises(UnsupportedError, match="'dynamic' is not supported"):
        our_model(dynamic, hf.state_dict())


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    name, hf, _ = family
    check_run_and_show(hf, write_hunyuan_gguf(tmp_path / f"{name}.gguf", hf), "hunyuan-dense")


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(family[1]), monkeypatch)

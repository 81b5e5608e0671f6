"""Nemotron against transformers' NemotronForCausalLM, from a config.json and from a
"nemotron" GGUF written as llama.cpp's converter writes it (conversion/nemotron.py
NemotronModel: TextModel's keys with key_length, vocab_size, the LayerNorm's epsilon
as attention.layer_norm_epsilon and, by TextModel's reading of norm_eps, as
layer_norm_rms_epsilon too, the rope dimension count int(partial * hidden) / heads,
linear scaling where the config has a factor, each norm weight stored as 1 + w, q/k rows
as they are).

Its features each move the logits by far more than the tolerance: LayerNorm1P's 1 + w
and its bias, the ReLU² feed-forward, partial RoPE (NemotronConfig's 0.5 where a config
gives none, against whole heads), the attention and MLP biases, linear RoPE scaling.

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
    max_diff,
)
from helpers import BASE, cached_logits, gguf_name, our_model, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
NEMOTRON = dict(
    {k: v for k, v in BASE.items() if k != "rms_norm_eps"},
    model_type="nemotron",
    norm_eps=1e-5,
    rope_theta=10000.0,
)
VARIANTS = {
    "default": {},  # NemotronConfig's partial_rotary_factor of 0.5
    "biases": dict(attention_bias=True, mlp_bias=True, partial_rotary_factor=0.25),
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0,
                                        partial_rotary_factor=1.0)),
}  # fmt: skip
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 up to 7.2e-3, bf16 up to 6.3e-2.
DRIFT = {"f16": 2e-2, "bf16": 2e-1}


def hf_model(**overrides):
    """A tiny transformers Nemotron with randomize()'s weights, LayerNorm1P's stored w
    near 0 (N(0, 0.1)) as trained ones are, so its scales 1 + w near 1."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**NEMOTRON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_nemotron_gguf(path, hf, qtype=None, rms_eps=True, output=True, keys=None, rope_dims=True):
    """The model as llama.cpp's converter writes Nemotron: TextModel's keys, vocab_size,
    layer_norm_epsilon (and layer_norm_rms_epsilon, as today's converter writes it from
    norm_eps; `rms_eps` False: as older ones, without), the rope dimension count, linear
    scaling where the config has a factor, norm weights + 1, 2-D weights in `qtype`
    (default F32). `output` False leaves the output matrix out; `keys` adds metadata
    (a gguf.Keys template -> (writer method, value)); `rope_dims` False leaves the rope
    dimension count out."""
    config = hf.config
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(str(path), "nemotron")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rms_eps:
        writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_layer_norm_eps(config.norm_eps)
    partial = rope.get("partial_rotary_factor", 1.0)
    if rope_dims:
        rotary = int(partial * config.hidden_size) // config.num_attention_heads
        writer.add_rope_dimension_count(rotary)
    if rope.get("factor") is None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    for method, value in (keys or {}).values():
        getattr(writer, method)(value)
    state = {
        name: tensor + 1 if name.endswith("norm.weight") else tensor
        for name, tensor in hf.state_dict().items()
        if output or name != "lm_head.weight"
    }
    return finish_stories_gguf(writer, path, state, gguf_name, qtype)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """Whole-head RoPE, the biases, linear scaling: each changes the logits, and llmrun
    follows each variant. (LayerNorm1P's 1 + w and its bias, and ReLU's square, each
    move them by units: the tests against transformers fail without them.)"""
    hf = hf_model()
    plain = reference(hf)
    for variant in (
        dict(partial_rotary_factor=1.0),
        dict(attention_bias=True),
        dict(mlp_bias=True),
        VARIANTS["linear"],
    ):
        other = hf_model(**variant)
        assert max_diff(reference(other), plain) > 0.1
        assert max_diff(cached_logits(ours(other), IDS), reference(other)) < 1e-4


def test_a_config_without_partial_rotary_factor_turns_half_of_each_head():
    hf = hf_model()
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.5
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    config["rope_theta"] = 10000.0
    model = our_model(config, hf.state_dict())
    assert model.model.rotary_emb.rotary_dim == hf.config.head_dim // 2
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_nemotron_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "nemotron"
    assert config["attention_bias"] == hf.config.attention_bias
    # The native decode step knows neither LayerNorm1P nor ReLU²: not attached.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_the_rms_epsilon_older_converters_left_out_loads(tmp_path):
    hf = hf_model()
    loaded = load_model(write_nemotron_gguf(tmp_path / "m.gguf", hf, rms_eps=False), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_a_rope_dimension_count_turns_whole_heads(tmp_path):
    """llama.cpp's n_rot defaults to the head size, not NemotronConfig's half of it."""
    hf = hf_model(partial_rotary_factor=1.0)
    path = write_nemotron_gguf(tmp_path / "m.gguf", hf, rope_dims=False)
    assert max_diff(cached_logits(load_model(path, CPU, "f32").model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(**VARIANTS["biases"])
    loaded = load_model(write_nemotron_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_its_output_matrix_is_refused(tmp_path):
    path = write_nemotron_gguf(tmp_path / "m.gguf", hf_model(), output=False)
    with pytest.raises(ModelFormatError, match="no output.weight"):
        load_model(path, CPU, "f32")


def test_a_gguf_without_the_layernorm_epsilon_is_refused(tmp_path):
    hf = hf_model()
    path = tmp_path / "m.gguf"
    write_nemotron_gguf(path, hf)
    data = path.read_bytes().replace(b"nemotron.attention.layer_norm_epsilon",
                                     b"nemotron.attention.layer_norm_epsilox")  # fmt: skip
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match="layer_norm_epsilon' is missing"):
        load_model(path, CPU, "f32")


def test_yarn_scaling_is_refused(tmp_path):
    keys = {"type": ("add_rope_scaling_type", gguf.RopeScalingType.YARN)}
    path = write_nemotron_gguf(tmp_path / "m.gguf", hf_model(), keys=keys)
    with pytest.raises(UnsupportedError, match="Nemotron with yarn RoPE scaling"):
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


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(**VARIANTS["biases"])
    check_run_and_show(hf, write_nemotron_gguf(tmp_path / "nemotron.gguf", hf), "nemotron")

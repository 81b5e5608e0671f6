"""Jais 2 against transformers' Jais2ForCausalLM, from a config.json and from a "jais2"
GGUF written as llama.cpp's converter writes it (conversion/jais.py Jais2Model:
TextModel's keys with key_length from the config's head_dim, the LayerNorm's epsilon as
attention.layer_norm_epsilon, the rope dimension count of whole heads, q/k rows as they
are, every bias).

Its features each move the logits by far more than the tolerance: LayerNorm (mean
removed, with a bias) rather than RMSNorm, the ReLU² feed-forward without a gate, the
attention and MLP biases (Jais2Config's default; the "plain" variant has none) and
heads of 32 features in a hidden size of 64 with 4 heads.

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
JAIS2 = dict(
    {k: v for k, v in BASE.items() if k != "rms_norm_eps"},
    model_type="jais2",
    layer_norm_eps=1e-5,
    rope_theta=10000.0,
)
VARIANTS = {
    "default": {},  # Jais2Config's biases on the attention and the MLP
    "plain": dict(attention_bias=False, mlp_bias=False, head_dim=32),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 up to 3e-3, bf16 up to 3e-2.
DRIFT = {"f16": 2e-2, "bf16": 2e-1}


def hf_model(**overrides):
    """A tiny transformers Jais 2 (f32, eval) with randomize()'s weights."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**JAIS2, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_jais2_gguf(path, hf, qtype=None, rope_dims=None, output=True, eps=True):
    """The model as llama.cpp's converter writes Jais 2: TextModel's keys (key and value
    length from the config's head_dim), the LayerNorm epsilon, the rope dimension count
    of whole heads (`rope_dims` another, for the refusal), tensors under llama.cpp's
    names as they are, 2-D weights in `qtype` (default F32). `output` False leaves the
    output matrix out (a tied model's file); `eps` False leaves the epsilon out."""
    config = hf.config
    writer = gguf.GGUFWriter(str(path), "jais2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if eps:
        writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(rope_dims or config.head_dim)
    state = {
        name: tensor
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
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits():
    """Without the biases, with heads of hidden / heads, with RMSNorm's arithmetic (a
    LayerNorm of the mean-free input, no bias) or with silu for ReLU²: each changes the
    logits by far more than the tolerance, and llmrun follows each config variant."""
    hf = hf_model()
    expected = reference(hf)
    for variant in (dict(attention_bias=False), dict(mlp_bias=False), dict(head_dim=32)):
        other = hf_model(**variant)
        assert max_diff(reference(other), expected) > 0.1
        assert max_diff(cached_logits(ours(other), IDS), reference(other)) < 1e-4
    assert max_diff(reference(hf_model(hidden_act="silu")), expected) > 0.1
    rms = hf_model()
    with torch.no_grad():
        for name, p in rms.named_parameters():
            if name.endswith("norm.bias"):
                p.zero_()
    assert max_diff(reference(rms), expected) > 0.1


def test_a_config_without_the_jais2_fields_takes_jais2config_defaults(family):
    """A config.json that leaves out hidden_act, the biases and the epsilon means
    Jais2Config's relu2, biases on and 1e-5, not Llama's silu, no biases and 1e-6."""
    hf, expected = family
    defaults = ("hidden_act", "attention_bias", "mlp_bias", "layer_norm_eps")
    config = {k: v for k, v in hf.config.to_dict().items() if k not in defaults}
    if not hf.config.attention_bias:
        config.update(attention_bias=False, mlp_bias=False)
    model = our_model(config, hf.state_dict())
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_jais2_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "jais2" and config["layer_norm_eps"] == pytest.approx(1e-5)
    # The native decode step knows neither LayerNorm nor ReLU²: not attached.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_tied_gguf_matches_transformers(tmp_path):
    hf = hf_model(tie_word_embeddings=True)
    loaded = load_model(write_jais2_gguf(tmp_path / "m.gguf", hf, output=False), CPU, "f32")
    assert loaded.checkpoint.config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_jais2_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_the_layernorm_epsilon_is_refused(tmp_path):
    path = write_jais2_gguf(tmp_path / "m.gguf", hf_model(), eps=False)
    with pytest.raises(ModelFormatError, match="layer_norm_epsilon' is missing"):
        load_model(path, CPU, "f32")


def test_a_gguf_without_its_biases_is_refused(tmp_path):
    path = write_jais2_gguf(tmp_path / "m.gguf", hf_model(attention_bias=False))
    with pytest.raises(ModelFormatError, match="blk.0.attn_q.bias"):
        load_model(path, CPU, "f32")


def test_partial_rope_is_refused(tmp_path):
    path = write_jais2_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=8)
    with pytest.raises(UnsupportedError, match="Jais 2 rotates whole heads"):
        load_model(path, CPU, "f32")


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    check_run_and_show(hf, write_jais2_gguf(tmp_path / "jais2.gguf", hf), "jais2")

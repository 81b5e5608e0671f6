"""OLMo (the first) against transformers' OlmoForCausalLM, from a config.json and from an
"olmo" GGUF written as llama.cpp's converter writes it (conversion/olmo.py OlmoModel:
TextModel's keys, the LayerNorm epsilon 1e-5, clip_qkv as attention.clamp_kqv; q/k
rows permuted as for arch llama, since llama.cpp turns OLMo's adjacent pairs; no norm
tensors).

Two shapes of the family: OLMo-1B's (tied embeddings, no clamp) and OLMo-7B-0424's
(clip_qkv, its own output matrix). Its features each move the logits by far more than
the tolerance (test_each_feature_moves_the_logits); the LayerNorms, which have no
weights, are checked by the whole model matching.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded to
the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights gguf
dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    max_diff,
)
from helpers import BASE, _permute, cached_logits, gguf_name, our_model, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
OLMO = {
    **{k: v for k, v in BASE.items() if k != "rms_norm_eps"},
    "model_type": "olmo",
    "rope_theta": 10000.0,
}
# The clamp bites: the projections of unit-variance inputs have a spread of 1.6 (±8 at most).
CLIP = 1.0
SHAPES = {"1b": dict(tie_word_embeddings=True), "7b-0424": dict(clip_qkv=CLIP)}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 3.1e-3 to 7.3e-3, bf16 2.2e-2 to
# 8.3e-2.
DRIFT = {"f16": 2e-2, "bf16": 2e-1}


def hf_model(**overrides):
    """The tiny random OlmoForCausalLM (f32, eval)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**OLMO, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_olmo_gguf(path, hf_model, qtype=None, eps=1e-5, rope_dims=None):
    """`hf_model` as llama.cpp's converter writes OLMo: TextModel's keys (RoPE base, no
    key length), the LayerNorm epsilon `eps` (the converter's 1e-5; another for the
    refusal), clamp_kqv where clip_qkv is set, q/k rows permuted as for arch llama,
    2-D weights in `qtype` (default F32). rope_dims: a rope dimension count, for the
    refusal."""
    config = hf_model.config
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "olmo")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    writer.add_layer_norm_eps(eps)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)
    state = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("q_proj.weight"):
            tensor = torch.from_numpy(_permute(tensor.numpy(), n_head))
        elif name.endswith("k_proj.weight"):
            tensor = torch.from_numpy(_permute(tensor.numpy(), n_kv))
        state[name] = tensor
    return finish_stories_gguf(writer, path, state, gguf_name, qtype)


@pytest.fixture(scope="module", params=list(SHAPES))
def family(request):
    hf = hf_model(**SHAPES[request.param])
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """The clamp, and (config.json only: llama.cpp's converter writes no biases) the
    attention biases: each changes the logits by far more than the tolerance, and
    llmrun follows each variant."""
    expected = reference(hf_model(clip_qkv=CLIP, attention_bias=True))
    for variant in (dict(attention_bias=True), dict(clip_qkv=CLIP)):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4
    hf = hf_model(clip_qkv=CLIP, attention_bias=True)
    assert max_diff(cached_logits(ours(hf), IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_olmo_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "olmo"
    assert config["clip_qkv"] == hf.config.clip_qkv
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(clip_qkv=CLIP)
    loaded = load_model(write_olmo_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    assert loaded.model.model.layers[0].self_attn.q_proj.weight.dtype != torch.float32
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """llmrun's native decode step has no LayerNorms or clamp: OLMo decodes in torch."""
    loaded = load_model(write_olmo_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None


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
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(family[0]), monkeypatch)


def test_another_layer_norm_epsilon_is_refused(tmp_path):
    path = write_olmo_gguf(tmp_path / "m.gguf", hf_model(), eps=1e-6)
    with pytest.raises(UnsupportedError, match="epsilon of 1e-05"):
        load_model(path, CPU, "f32")


def test_partial_rope_is_refused(tmp_path):
    path = write_olmo_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=8)
    with pytest.raises(ModelFormatError, match="OLMo rotates whole heads"):
        load_model(path, CPU, "f32")


def test_attention_biases_in_a_gguf_are_refused(tmp_path):
    """The converter permutes q/k weights but not their biases, and llama.cpp's olmo has
    no output bias: such a file has no one meaning."""
    path = write_olmo_gguf(tmp_path / "m.gguf", hf_model(attention_bias=True))
    with pytest.raises(UnsupportedError, match="attention biases"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model(clip_qkv=CLIP)
    path = write_olmo_gguf(tmp_path / "olmo.gguf", hf)
    check_run_and_show(hf, path, "olmo")
    # Two KV heads of 16 features a layer, keys and values, f32: 2 * 2 * 2 * 16 * 4 bytes.
    check_show(path, "olmo", 2 * 2 * 2 * 16 * 4 * 8192)

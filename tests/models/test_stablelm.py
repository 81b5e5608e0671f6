"""StableLM against transformers' StableLmForCausalLM, from a config.json and from a
"stablelm" GGUF written as llama.cpp's converter writes it (conversion/stablelm.py
StableLMModel: its own keys, with rope.dimension_count for the partial RoPE,
use_parallel_residual and the LayerNorm epsilon, no RoPE base; q/k rows as they are;
each layer's per-head q/k norms stacked into one [heads, head_dim] F32 tensor).

Three shapes of the family: StableLM-3B-4E1T's (a quarter of each head rotated, no
biases), StableLM 2 1.6B's (q/k/v biases) and StableLM 2 12B's (per-head q/k LayerNorms
and the parallel block). Each feature moves the logits by far more than the tolerance
(test_each_feature_moves_the_logits).

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
from helpers import BASE, cached_logits, gguf_name, our_model, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
STABLELM = {
    **{k: v for k, v in BASE.items() if k != "rms_norm_eps"},
    "model_type": "stablelm",
    "layer_norm_eps": 1e-5,
}
# The Hub's three shapes (StableLmConfig's defaults: a quarter of each head rotated).
SHAPES = {
    "3b-4e1t": {},
    "2-1.6b": dict(use_qkv_bias=True),
    "2-12b": dict(qk_layernorm=True, use_parallel_residual=True),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured over the shapes: f16 1.1e-3 to 1.1e-2,
# bf16 9.4e-3 to 7.3e-2 (the keys without q/k norms are the larger).
DRIFT = {"f16": 3e-2, "bf16": 2e-1}


def hf_model(**overrides):
    """The tiny random StableLmForCausalLM (f32, eval), its per-head q/k norms' scales
    near 1 as trained ones are (randomize() leaves them at N(0, 0.2))."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**STABLELM, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm.norms." in name:
                p.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_stablelm_gguf(path, hf_model, qtype=None, rope_dims="config", eps=True, extra=None):
    """`hf_model` as llama.cpp's converter writes StableLM: its keys (no RoPE base, no
    key length), the per-head q/k norms stacked per layer in F32, the other tensors
    under their usual names, 2-D ones in `qtype` (default F32). rope_dims: the rope
    dimension count, "config" for the converter's, None for none; eps: whether to write
    the LayerNorm epsilon (for the refusal); extra(writer): keys of a test's own."""
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "stablelm")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    if rope_dims == "config":
        rope_dims = int(config.rope_parameters["partial_rotary_factor"] * head_dim)
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_parallel_residual(config.use_parallel_residual)
    if eps:
        writer.add_layer_norm_eps(config.layer_norm_eps)
    if extra is not None:
        extra(writer)
    state = dict(hf_model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    # The converter's _stack_qk_norm: each layer's heads in order, [heads, head_dim].
    norms = [("q", "attn_q_norm", config.num_attention_heads)]
    norms.append(("k", "attn_k_norm", config.num_key_value_heads))
    for i in range(config.num_hidden_layers):
        for which, gguf_norm, heads in norms if config.qk_layernorm else ():
            module = f"model.layers.{i}.self_attn.{which}_layernorm.norms"
            rows = [state.pop(f"{module}.{h}.weight") for h in range(heads)]
            writer.add_tensor(f"blk.{i}.{gguf_norm}.weight", torch.stack(rows).float().numpy())
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
    """The rotated share of a head, the q/k/v biases, the per-head q/k norms (and each
    head's own scale in them), the parallel block and the LayerNorms' biases: each
    changes the logits by far more than the tolerance, and llmrun follows each variant."""
    base = dict(qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True)
    expected = reference(hf_model(**base))
    same_scales = hf_model(**base)
    no_norm_bias = hf_model(**base)
    with torch.no_grad():
        for name, p in same_scales.named_parameters():
            if "layernorm.norms." in name:
                p.copy_(same_scales.get_parameter(name.rsplit(".", 2)[0] + ".0.weight"))
        for name, p in no_norm_bias.named_parameters():
            if name.endswith("norm.bias"):
                p.zero_()
    variants = [hf_model(**base, partial_rotary_factor=r) for r in (0.5, 1.0)]
    variants += [hf_model(**{**base, name: False}) for name in base]
    for hf in (*variants, same_scales, no_norm_bias):
        assert max_diff(reference(hf), expected) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_an_older_config_json_reads_as_transformers_reads_it():
    """Without a partial_rotary_factor a quarter of each head turns (StableLmConfig's
    default); one at the top level, as configs before transformers 5 have it, is read."""
    hf = hf_model()
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    config["rope_theta"] = 10000.0
    assert max_diff(cached_logits(our_model(config, hf.state_dict()), IDS), reference(hf)) < 1e-4
    half = hf_model(partial_rotary_factor=0.5)
    config["partial_rotary_factor"] = 0.5
    model = our_model(config, half.state_dict())
    assert max_diff(cached_logits(model, IDS), reference(half)) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_stablelm_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config, hf_config = loaded.checkpoint.config, hf.config
    assert config["model_type"] == "stablelm"
    for name in ("use_qkv_bias", "qk_layernorm", "use_parallel_residual"):
        assert config[name] == getattr(hf_config, name)
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(**SHAPES["2-12b"], use_qkv_bias=True)
    loaded = load_model(write_stablelm_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    assert loaded.model.model.layers[0].mlp.up_proj.weight.dtype != torch.float32
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_a_rope_dimension_count_turns_whole_heads(tmp_path):
    """llama.cpp's n_rot defaults to the head size, not StableLmConfig's quarter."""
    hf = hf_model(partial_rotary_factor=1.0)
    loaded = load_model(write_stablelm_gguf(tmp_path / "m.gguf", hf, rope_dims=None), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_tied_gguf_takes_the_embedding_as_its_output(tmp_path):
    hf = hf_model(tie_word_embeddings=True)
    loaded = load_model(write_stablelm_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """llmrun's native decode step has no LayerNorms: a stablelm model decodes in torch."""
    loaded = load_model(write_stablelm_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
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


def test_a_head_size_other_than_hidden_over_heads_is_refused(tmp_path):
    path = write_stablelm_gguf(
        tmp_path / "m.gguf", hf_model(), extra=lambda w: w.add_key_length(32)
    )
    with pytest.raises(UnsupportedError, match="the only head size StableLM has"):
        load_model(path, CPU, "f32")


def test_a_file_without_the_layer_norm_epsilon_is_refused(tmp_path):
    """llama.cpp requires the key; no default would be the model's."""
    path = write_stablelm_gguf(tmp_path / "m.gguf", hf_model(), eps=False)
    with pytest.raises(ModelFormatError, match="stablelm.attention.layer_norm_epsilon"):
        load_model(path, CPU, "f32")


def test_layers_with_and_without_their_feed_forward_norm_are_refused(tmp_path):
    """llama.cpp runs a layer without ffn_norm as a parallel one; a file mixing the two
    is no StableLM config."""
    hf = hf_model()
    hf.model.layers[1].post_attention_layernorm = None  # layer 1 writes no ffn_norm
    with pytest.raises(UnsupportedError, match="in 1 of 2 layers"):
        load_model(write_stablelm_gguf(tmp_path / "m.gguf", hf), CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model(**SHAPES["2-12b"], use_qkv_bias=True)
    path = write_stablelm_gguf(tmp_path / "stablelm.gguf", hf)
    check_run_and_show(hf, path, "stablelm")
    # Two KV heads of 16 features a layer, keys and values, f32: 2 * 2 * 2 * 16 * 4 bytes.
    check_show(path, "stablelm", 2 * 2 * 2 * 16 * 4 * 8192)

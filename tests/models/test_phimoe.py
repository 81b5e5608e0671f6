"""Phi-3.5-MoE against transformers' PhimoeForCausalLM, from a config.json (the Hub's
keys: block_sparse_moe.gate, experts.N.w1/w2/w3) and from a "phimoe" GGUF written as
llama.cpp's converter writes it (conversion/phi.py PhiMoeModel over Phi3MiniModel: its
keys, LongRoPE's factors as rope_factors_long/short with rope.scaling.attn_factor
sqrt(1 + ln(scale) / ln(original)), the experts stacked, every bias and LayerNorm
as it is).

The tiny models: 8 experts (two a token, as the sparsemixer always picks), q/k/v/o and
lm_head biases, LayerNorms, LongRoPE with distinct short and long factors and the
mscales the converter's attn_factor equals (as Phi-3.5-MoE's), a margin
(router_jitter_noise) of 0.3, so that the sparsemixer's softmax weighs several experts.
Its features each move the logits by far more than the tolerance (asserted): the
sparsemixer (llama.cpp's renormalized softmax top-2 gives another model), its margin,
the LayerNorms (RMS with bias, llama.cpp's, gives another model), the biases, the
LongRoPE factors.

Tolerances: f32 logits (within about ±8) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. The sparsemixer against transformers' function: exact (it is the same f32 ops).
A Q8_0 GGUF against transformers on the weights gguf dequantizes: 1e-4. An f16 or bf16
cache: 1e-5 against an f32 cache holding the rounded values (no bound on the drift from
f32: see that test).
"""

import math

import numpy as np
import pytest
import torch
from family_checks import (
    cache_logits,
    check_paged,
    check_run_and_show,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize
from moe_helpers import hub_state_dict
from test_cache_types import rounded_to

from llmrun import static_decode
from llmrun.errors import UnsupportedError
from llmrun.loading import phimoe as phimoe_loading
from llmrun.loading.loader import load_model
from llmrun.models import phimoe
from llmrun.models.base import mix_experts, route

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
ORIGINAL, CONTEXT = 4096, 4096 * 32
MSCALE = math.sqrt(1 + math.log(CONTEXT / ORIGINAL) / math.log(ORIGINAL))  # the converter's
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0 + 0.1 * i for i in range(8)],
    long_factor=[1.0 + 0.5 * i for i in range(8)],
    short_mscale=MSCALE,
    long_mscale=MSCALE,
    original_max_position_embeddings=ORIGINAL,
)
PHIMOE = dict(
    BASE,
    model_type="phimoe",
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    attention_bias=True,
    lm_head_bias=True,
    max_position_embeddings=CONTEXT,
    rope_parameters=LONGROPE,
    router_jitter_noise=0.3,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
Q8 = gguf.GGMLQuantizationType.Q8_0


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**PHIMOE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """hf's weights under the Hub's keys (transformers 5 names the router `router`)."""
    return {
        k.replace(".block_sparse_moe.router.", ".block_sparse_moe.gate."): v
        for k, v in hub_state_dict(hf, "mixtral").items()
    }


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hub_state(hf))


@pytest.fixture(scope="module", params=["longrope", "default-rope"])
def family(request):
    rope = dict(rope_type="default", rope_theta=10000.0)
    hf = hf_model(**({} if request.param == "longrope" else dict(rope_parameters=rope)))
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_STACKS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, each layer's experts stacked, and LongRoPE's
    factors as tensors where the config has them (Phi3MiniModel.generate_extra_tensors)."""
    out, stacks = {}, {}
    for name, t in hub_state(hf).items():
        module, _, suffix = name.rpartition(".")
        data = t.float().numpy()
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = data
            continue
        _, _, layer, rest = module.split(".", 3)
        if rest.startswith("block_sparse_moe.experts."):
            _, _, expert, proj = rest.split(".")
            stacks.setdefault((layer, proj), {})[int(expert)] = data
        else:
            out[f"blk.{layer}.{_LAYER[rest]}.{suffix}"] = data
    for (layer, proj), experts in stacks.items():
        out[f"blk.{layer}.{_STACKS[proj]}.weight"] = np.stack([experts[e] for e in sorted(experts)])
    rope = hf.config.rope_parameters
    if rope["rope_type"] == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return out


def write_phimoe_gguf(path, hf, qtype=None, **changed):
    """hf as llama.cpp's converter writes Phi-3.5-MoE (Phi3MiniModel's keys, the expert
    counts). `changed`: keys replaced (None: left out)."""
    c = hf.config
    rope = c.rope_parameters
    keys = {
        gguf.Keys.LLM.CONTEXT_LENGTH: c.max_position_embeddings,
        gguf.Keys.Rope.SCALING_ORIG_CTX_LEN: rope.get("original_max_position_embeddings")
        or c.max_position_embeddings,
        gguf.Keys.LLM.EMBEDDING_LENGTH: c.hidden_size,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: c.intermediate_size,
        gguf.Keys.LLM.BLOCK_COUNT: c.num_hidden_layers,
        gguf.Keys.Attention.HEAD_COUNT: c.num_attention_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: c.num_key_value_heads,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        gguf.Keys.Rope.DIMENSION_COUNT: c.hidden_size // c.num_attention_heads,
        gguf.Keys.Rope.FREQ_BASE: rope["rope_theta"],
        gguf.Keys.Attention.SLIDING_WINDOW: 0,  # the converter's "none"
        gguf.Keys.LLM.EXPERT_USED_COUNT: c.num_experts_per_tok,
        gguf.Keys.LLM.EXPERT_COUNT: c.num_local_experts,
    }
    if rope["rope_type"] == "longrope":
        keys[gguf.Keys.Rope.SCALING_ATTN_FACTOR] = MSCALE
    keys.update(changed)
    return write_keyed_gguf(path, phimoe_loading.ARCH, keys, converted(hf), qtype)


# ---- the model ----------------------------------------------------------------------


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


@pytest.mark.parametrize("jitter", [0.0, 0.01, 0.3, 2.0])
def test_the_sparsemixer_is_transformers(jitter):
    """Its choices and weights on random logits (and ones with near ties) are those of
    transformers' sparsemixer at inference."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 8, generator=gen) * 2
    logits[:20, 1] = logits[:20, 0] * (1 + 1e-3)  # within a small margin of another
    logits[20:40] = -logits[20:40].abs()  # all negative: the margin's factor is |s|
    weights, indices = phimoe.sparsemixer(logits, jitter)
    expected_weights, expected_indices = sparsemixer(logits, jitter, training=False)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(weights, expected_weights)


def test_each_feature_moves_the_logits():
    """Without the biases, with a margin of 0.01, or with short factors for the long ones,
    transformers' logits move by far more than the tolerance and llmrun follows; llama.cpp's
    routing (the softmax's top two renormalized) or its RMS norms (with the LayerNorms'
    biases) in llmrun's model miss transformers' logits by far more."""
    expected = reference(hf_model())
    short = dict(LONGROPE, short_factor=LONGROPE["long_factor"])
    for variant in (
        dict(attention_bias=False),
        dict(lm_head_bias=False),
        dict(router_jitter_noise=0.01),
        dict(rope_parameters=short),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1, variant
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4
    model = ours(hf_model())
    for layer in model.model.layers:
        block = layer.block_sparse_moe
        block.forward = _softmax_top2(block)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    model = ours(hf_model())
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = _rms_with_bias(norm)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def _softmax_top2(block):
    """block's forward with llama.cpp's phimoe routing: the softmax's top two, renormalized."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        weights, indices = route(block.gate(x2), 2, normalize=True)
        return mix_experts(x2, weights, indices, block.experts).view(x.shape)

    return forward


def _rms_with_bias(norm):
    """norm's forward as llama.cpp's phimoe graph computes it: x / rms(x) * w + b."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias

    return forward


def test_long_contexts_take_the_long_factors_and_mscale():
    """Past original_max_position_embeddings (judged by the cache's capacity) the long
    factors and long_mscale turn the heads, as Phi-3's LongRoPE does in llmrun."""
    params = dict(LONGROPE, long_mscale=2.0, short_mscale=1.5, rope_type="longrope")
    rotary = phimoe.RotaryEmbedding(params, 16, CONTEXT)
    positions = torch.arange(4)[None]
    short_cos, _ = rotary(positions, ORIGINAL)
    long_cos, _ = rotary(positions, ORIGINAL + 1)
    assert torch.allclose(short_cos[0, 0], torch.full((16,), 1.5))  # cos(0) * short mscale
    assert torch.allclose(long_cos[0, 0], torch.full((16,), 2.0))
    inv_freq = 1.0 / (
        torch.tensor(LONGROPE["long_factor"]) * 10000.0 ** (torch.arange(0, 16, 2) / 16)
    )
    angles = torch.cat((inv_freq, inv_freq)) * 3
    torch.testing.assert_close(long_cos[0, 3], angles.cos() * 2.0)
    whole, _ = rotary(torch.arange(ORIGINAL + 1)[None])  # no cache: by the row's length
    torch.testing.assert_close(whole[0, 3], angles.cos() * 2.0)


def test_other_expert_counts_are_refused():
    with pytest.raises(UnsupportedError, match="routes each token to 2 experts"):
        phimoe.ModelArgs.from_config({**PHIMOE, "num_experts_per_tok": 3})


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The logits of a typed cache are those of an f32 cache holding the rounded values
    (1e-5), and differ from f32's. No bound on how much: a rounding that turns a
    router's choice of its second expert moves that token's logits by units (measured
    up to 4 here; 6e-3 to 7e-2 where no choice turns)."""
    hf, expected = family
    model = ours(hf)
    typed = cache_logits(model, IDS, model.new_cache(1, 64, cache_type, "cpu"))
    rounded = model.new_cache(1, 64, torch.float32, "cpu")
    rounded.encode = rounded_to(cache_type)
    assert max_diff(typed, cache_logits(model, IDS, rounded)) < 1e-5
    assert max_diff(typed, expected) > 0


def test_no_static_decode_step():
    """CUDA graphs' static step refuses a mixture of experts (its routers' choices are
    read back to the host)."""
    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None  # the native step does not know PhiMoE
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers_with_margin_0_01(family, tmp_path):
    """The file has no margin: llmrun takes Phi-3.5-MoE's 0.01."""
    hf, _ = family
    hf.config.router_jitter_noise = 0.01
    for layer in hf.model.layers:
        layer.mlp.router.router_jitter_noise = 0.01
    try:
        loaded = load_model(write_phimoe_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
        config = loaded.checkpoint.config
        assert config["model_type"] == "phimoe" and config["lm_head_bias"] is True
        assert config["rope_parameters"]["rope_type"] == hf.config.rope_parameters["rope_type"]
        assert loaded.model.decode_step is None
        assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4
    finally:
        hf.config.router_jitter_noise = PHIMOE["router_jitter_noise"]
        for layer in hf.model.layers:
            layer.mlp.router.router_jitter_noise = PHIMOE["router_jitter_noise"]


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    """Every matrix and stack of experts Q8_0 but the routers, which the converter keeps
    in F32."""
    hf = hf_model(router_jitter_noise=0.01)
    loaded = load_model(write_phimoe_gguf(tmp_path / "q.gguf", hf, Q8), CPU, "f32")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.router.weight"):
                blocks = gguf.quants.quantize(p.numpy(), Q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8)))
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_that_routes_to_three_experts_is_refused(tmp_path):
    path = write_phimoe_gguf(
        tmp_path / "m.gguf", hf_model(), **{gguf.Keys.LLM.EXPERT_USED_COUNT: 3}
    )
    with pytest.raises(UnsupportedError, match="routes each token to 2 experts"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model(router_jitter_noise=0.01)
    path = write_phimoe_gguf(tmp_path / "phimoe.gguf", hf)
    check_run_and_show(hf, path, "phimoe")

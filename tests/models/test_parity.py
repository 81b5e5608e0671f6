"""Logits of every architecture against transformers on tiny random-weight configs,
three ways: one forward without a cache, a prefill of 3 tokens and then one token at a
time, and prefills in chunks (helpers.CHUNKS) and then one at a time. 40 tokens: past
the sliding windows of 5 (Mistral, Gemma 2/3, Phi-3 with a window; the KV cache keeps
Gemma's windowed layers in rings) and LongRoPE's 16 pretraining positions. Besides
helpers.CONFIGS: every RoPE type llmrun takes (linear, YaRN with and without its
options, llama3, LongRoPE on Llama and on Phi-3 with partial rotary), Llama's biases,
a Phi-3 window, and Gemma's query_pre_attn_scalar apart from head_dim.

Tolerance: 1e-4 max abs difference in float32; logits span ±3 (Gemma 2's soft-cap) to
±8. Measured: the forward alone 0 (Phi-3) to 4e-6; the cached ways, whose decode steps
take the native kernels, 4e-6..6e-6 for Gemma 2 and 3, 5e-6..2.5e-5 for the others, and
3.6e-5 for YaRN with attention_factor 1.3 (its sharper attention).
"""

import pytest
import torch
from helpers import BASE, CONFIGS, cached_logits, our_model, tiny_hf_model

from llmrun.models import model_module
from llmrun.models.base import RotaryEmbedding, rope_parameters

pytest.importorskip("transformers")
SEQ = 40


def rope(**params) -> dict:
    return {"rope_parameters": {"rope_theta": 10000.0, **params}}


# YaRN's correction range (beta_fast, beta_slow) lies within the 8 frequencies of
# head_dim 16 only with a long pretraining context: 2048 here.
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)
LONGROPE = dict(
    rope_type="longrope",
    original_max_position_embeddings=16,
    short_factor=[1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
    long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
)
# Name -> (helpers.CONFIGS entry, overrides).
VARIANTS = {
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-linear": ("llama", rope(rope_type="linear", factor=4.0)),
    "llama-yarn": ("llama", rope(**YARN)),
    "llama-yarn-betas": ("llama", rope(**YARN, beta_fast=8.0, beta_slow=2.0, truncate=False)),
    "llama-yarn-mscale": ("llama", rope(**YARN, mscale=1.0, mscale_all_dim=0.5)),
    "llama-yarn-attention-factor": ("llama", rope(**YARN, attention_factor=1.3)),
    "llama-longrope": ("llama", dict(max_position_embeddings=64, **rope(**LONGROPE))),
    "qwen2-yarn": ("qwen2", rope(**YARN)),
    "phi3-window": ("phi3", dict(sliding_window=5)),
    # Phi-4-mini's shape: LongRoPE over part of each head.
    "phi3-partial-longrope": (
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            max_position_embeddings=64,
            original_max_position_embeddings=16,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0, 1.2, 1.5, 2.0],
                long_factor=[1.0, 2.0, 4.0, 8.0],
            ),
        ),
    ),
    # query_pre_attn_scalar 24, not head_dim (32), as in the 27B models.
    "gemma2-query-scale": ("gemma2", dict(query_pre_attn_scalar=24)),
    "gemma3-query-scale": ("gemma3", dict(query_pre_attn_scalar=24)),
}
CASES = {name: (name, {}) for name in CONFIGS} | VARIANTS


def ids_for(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(
        0, BASE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    name, overrides = CASES[case]
    hf, config = tiny_hf_model(name, **overrides)
    ours = our_model(config, hf.state_dict())
    ids = ids_for()
    with torch.no_grad():
        expected = hf(ids).logits
        full = ours(ids, torch.arange(SEQ)[None])
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(cached_logits(ours, ids, chunks=(3,)), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(cached_logits(ours, ids), expected, atol=1e-4, rtol=0)


def test_each_rope_variant_is_its_own():
    """The RoPE variants above differ from one another and from plain RoPE in their
    frequencies or their attention scaling, so each tests something (YaRN's betas
    within 16 pretraining positions, say, change nothing at head_dim 16)."""
    seen = []
    for case in [
        "llama",
        "llama-linear",
        "llama-longrope",
        *(c for c in VARIANTS if c.startswith("llama-yarn")),
    ]:
        name, overrides = CASES[case]
        params = rope_parameters({**BASE, **CONFIGS[name], **overrides})
        emb = RotaryEmbedding(params, 16, overrides.get("max_position_embeddings", 256))
        freqs = emb.long_inv_freq if emb.long_inv_freq is not None else emb.inv_freq
        key = (tuple(freqs.tolist()), emb.attention_scaling)
        assert key not in seen, case
        seen.append(key)
    # llama3's smoothed band: a frequency divided by neither 1 nor the factor of 8.
    params = rope_parameters({**BASE, **CONFIGS["llama3-scaled"]})
    plain = RotaryEmbedding({**params, "rope_type": "default"}, 16, 256).inv_freq
    ratios = plain / RotaryEmbedding(params, 16, 256).inv_freq
    assert any(1.01 < r < 7.99 for r in ratios.tolist()), ratios


def test_longrope_short_factors_within_the_pretraining_length():
    """12 tokens in a cache of 16 positions (no more than the 16 of pretraining): the
    short factors, as transformers takes them for 12 tokens."""
    hf, config = tiny_hf_model("phi3-longrope")
    ours = our_model(config, hf.state_dict())
    ids = ids_for(seq=12)
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids, torch.arange(12)[None]), expected, atol=1e-4, rtol=0)
    for chunks in [(3,), (4, 1, 5)]:
        got = cached_logits(ours, ids, chunks, capacity=16)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "rope_config",
    [
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ],
)
def test_rope_types_llmrun_does_not_take_are_refused(rope_config):
    """Dynamic NTK scaling (its frequencies change with the sequence length, so cached
    keys would need rotating again) is refused, not run as plain RoPE."""
    from llmrun.errors import UnsupportedError

    module = model_module("llama")
    with pytest.raises(UnsupportedError) as raised:
        module.ModelArgs.from_config({**BASE, **CONFIGS["llama"], **rope_config})
    assert str(raised.value) == (
        "RoPE type 'dynamic' is not supported (supported: default, linear, llama3, yarn, longrope)"
    )


def test_gemma3_config_styles_agree():
    """transformers 5's per-layer-type rope_parameters and the older rope_theta /
    rope_scaling / rope_local_base_freq / sliding_window_pattern give one model."""
    _, config = tiny_hf_model("gemma3")
    module = model_module("gemma3_text")
    new = module.ModelArgs.from_config(config)
    old_style = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    old_style.update(
        rope_theta=100000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=1000.0,
        sliding_window_pattern=6,
    )
    old = module.ModelArgs.from_config(old_style)
    assert old.layer_types == new.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert old.rope_parameters == new.rope_parameters
    assert new.rope_parameters["rope_type"] == "linear" and new.rope_parameters["factor"] == 4.0
    assert old.rope_local_parameters == new.rope_local_parameters
    assert new.rope_local_parameters == {"rope_type": "default", "rope_theta": 1000.0}


def test_multimodal_gemma3_config_is_its_text_config():
    _, config = tiny_hf_model("gemma3")
    multimodal = {"model_type": "gemma3", "text_config": config, "vision_config": {}}
    module = model_module("gemma3")
    assert module.ModelArgs.from_config(multimodal) == module.ModelArgs.from_config(config)


@pytest.mark.parametrize(
    "name,change,message",
    [
        ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
         "layer type 'chunked_attention' is not supported (supported: full_attention, "
         "sliding_attention)"),
        ("gemma3", {"layer_types": ["full_attention"]},
         "layer_types lists 1 layers, but num_hidden_layers is 6"),
        ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                                        "sliding_attention": {"rope_type": "default"}}},
         "RoPE type 'dynamic' is not supported (supported: default, linear, llama3, yarn, "
         "longrope)"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)  # fmt: skip
def test_gemma_configs_refused(name, change, message):
    from llmrun.errors import LlmrunError

    _, config = tiny_hf_model(name)
    module = model_module(config["model_type"])
    with pytest.raises(LlmrunError) as raised:
        module.ModelArgs.from_config({**config, **change})
    assert message in str(raised.value)


def test_gemma2_null_softcap_turns_it_off():
    _, config = tiny_hf_model("gemma2")
    module = model_module("gemma2")
    args = module.ModelArgs.from_config({**config, "final_logit_softcapping": None})
    assert args.final_logit_softcapping is None and args.attn_logit_softcapping == 2.0
    # Left out, it is transformers' default.
    rest = {k: v for k, v in config.items() if k != "final_logit_softcapping"}
    assert module.ModelArgs.from_config(rest).final_logit_softcapping == 30.0


def test_longrope_keys_do_not_depend_on_how_the_prompt_was_split():
    """LongRoPE's factors are chosen once for a cache (long, as its 64 positions outgrow
    the 16 of pretraining): a prompt prefilled in two chunks, or over an earlier turn's
    keys, equals one forward over all 30 tokens. Chosen per forward call, a first chunk
    of fewer than 16 positions kept short-factor keys (serve's 256-token chunks and a
    chat's earlier turns did that to Phi-3.5's 4096)."""
    hf, config = tiny_hf_model("phi3-longrope")
    ours = our_model(config, hf.state_dict())
    ids = torch.randint(0, BASE["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(30)[None]
    with torch.no_grad():
        expected = hf(ids).logits  # one forward of 30 > 16 positions: long factors
        for split in (5, 10, 15, 20):
            cache = ours.new_cache(1, 64, torch.float32, "cpu")
            first = ours(ids[:, :split], positions[:, :split], cache)
            rest = ours(ids[:, split:], positions[:, split:], cache)
            torch.testing.assert_close(torch.cat([first, rest], 1), expected, atol=1e-4, rtol=0)

"""Logits of every architecture against transformers on tiny random-weight configs.

Tolerance: 1e-4 max abs difference in float32 (logits span about ±1 here).
"""

import pytest
import torch
from helpers import BASE, CONFIGS, our_model, tiny_hf_model

from llmrun.models import model_module

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    hf, config = tiny_hf_model(name)
    ours = our_model(config, hf.state_dict())
    seq = 40 if name == "phi3-longrope" else 12  # long enough to switch to the long factors
    ids = torch.randint(0, BASE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        positions = torch.arange(seq)[None]
        full = ours(ids, positions)
        torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)

        # Cached decode: prefill part, then one token at a time, equals the full forward.
        cache = ours.new_cache(1, 64, torch.float32, "cpu")
        split = seq - 4
        steps = [ours(ids[:, :split], positions[:, :split], cache)]
        for t in range(split, seq):
            steps.append(ours(ids[:, t : t + 1], positions[:, t : t + 1], cache))
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_query_scale_other_than_head_dim(name):
    """query_pre_attn_scalar sets the score scale (24^-0.5 here, head_dim is 32), as in
    the 27B models; the cached decode crosses the window of 5."""
    hf, config = tiny_hf_model(name, query_pre_attn_scalar=24)
    ours = our_model(config, hf.state_dict())
    ids = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids, positions), expected, atol=1e-4, rtol=0)
        cache = ours.new_cache(1, 64, torch.float32, "cpu")
        steps = [ours(ids[:, :3], positions[:, :3], cache)]
        steps += [ours(ids[:, t : t + 1], positions[:, t : t + 1], cache) for t in range(3, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)


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

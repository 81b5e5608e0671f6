"""Logits of every architecture against transformers on tiny random-weight configs.

Tolerance: 1e-4 max abs difference in float32 (logits span about ±1 here).
"""

import pytest
import torch

from llmrun.models import model_module

transformers = pytest.importorskip("transformers")

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CONFIGS = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "llama3-scaled": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=5, head_dim=32),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_theta=1000000.0),
    "phi3": dict(model_type="phi3", num_key_value_heads=4, partial_rotary_factor=0.5),
    "phi3-longrope": dict(
        model_type="phi3",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
            long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
        ),
    ),
}


def hf_model(name: str):
    cfg = {**BASE, **CONFIGS[name]}
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, config.to_dict()


def our_model(config: dict, state_dict: dict):
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_config(config))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected
    assert all(k == "lm_head.weight" for k in missing)
    if config.get("tie_word_embeddings"):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    hf, config = hf_model(name)
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

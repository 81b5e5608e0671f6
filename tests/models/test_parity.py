"""Logits of every architecture against transformers on tiny random-weight configs.

Tolerance: 1e-4 max abs difference in float32 (logits span about ±1 here).
"""

import pytest
import torch
from helpers import BASE, CONFIGS, tiny_hf_model

from llmrun.models import model_module

pytest.importorskip("transformers")


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

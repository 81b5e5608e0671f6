"""gpt-oss (llmrun/models/gpt_oss.py) against transformers on tiny random configs: sinks,
the clamped SwiGLU, biases, YaRN (with and without the rounded correction range) and
alternating windows of 5 under prompts of 40: one forward (windows by a mask), and
through KV caches whose windowed layers keep rings of 5, a prefill of 3 or prefills in
chunks (helpers.CHUNKS), then one token at a time.

Tolerance: 1e-4 max abs difference in float32 (logits span about ±7 here). Measured:
the forward 8e-6 (llama.cpp's constants) and 1.3e-5, the cached ways 1.3e-5..1.8e-5.
"""

import pytest
import torch
from gpt_oss_helpers import LLAMA_CPP, llmrun_state, tiny_gpt_oss
from helpers import CHUNKS, cached_logits

from llmrun.errors import LlmrunError
from llmrun.models import model_module

pytest.importorskip("transformers")
SEQ = 24
LONG = 40  # parity: past the windows of 5 and helpers.CHUNKS


def our_model(config: dict, state: dict):
    module = model_module("gpt_oss")
    model = module.Model(module.ModelArgs.from_config(config))
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    # Frozen as the loader leaves it, so decode steps take the native kernels on CPU.
    return model.eval().requires_grad_(False)


def ids_for(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(seed))


def cached(model, ids, capacity: int, split: int = SEQ - 8) -> torch.Tensor:
    """Logits of a prefill of `split` tokens and then one token at a time, in a cache
    of `capacity` positions."""
    positions = torch.arange(ids.shape[1])[None]
    cache = model.new_cache(1, capacity, torch.float32, "cpu")
    steps = [model(ids[:, :split], positions[:, :split], cache)]
    steps += [
        model(ids[:, t : t + 1], positions[:, t : t + 1], cache) for t in range(split, ids.shape[1])
    ]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("variant", ["config", "llama.cpp"])
def test_logits_match_transformers(variant):
    hf, config = tiny_gpt_oss(**(LLAMA_CPP if variant == "llama.cpp" else {}))
    ours = our_model(config, llmrun_state(hf, config))
    assert ours.args.layer_types == ["sliding_attention", "full_attention"] * 2
    ids = ids_for(seq=LONG)
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids, torch.arange(LONG)[None]), expected, atol=1e-4, rtol=0)
    # A cache of 64 positions, and one of exactly the prompt's.
    for capacity in (64, LONG):
        assert ours.new_cache(1, capacity, torch.float32, "cpu").window == 5
        for chunks in [(3,), CHUNKS]:
            got = cached_logits(ours, ids, chunks, capacity)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_every_part_of_the_layer_matters():
    """Sinks, the clamp, biases and the window each change the logits (else parity
    would not test them)."""
    hf, config = tiny_gpt_oss()
    state = llmrun_state(hf, config)
    ids = ids_for()
    positions = torch.arange(SEQ)[None]
    with torch.no_grad():
        base = our_model(config, state)(ids, positions)
        changes = {
            "sinks": {
                k: torch.full_like(v, -30.0) if k.endswith("sinks") else v for k, v in state.items()
            },
            "biases": {k: v * 0 if k.endswith("bias") else v for k, v in state.items()},
        }
        for name, changed in changes.items():
            assert (our_model(config, changed)(ids, positions) - base).abs().max() > 1e-2, name
        for change in ({"swiglu_limit": 100.0}, {"sliding_window": 64}):
            other = our_model({**config, **change}, state)(ids, positions)
            assert (other - base).abs().max() > 1e-2, change


def test_batched_rows_equal_each_row_alone():
    """To 5e-5 (logits of ±7), as f32 rounds a one-row product differently from a
    many-row one: measured 2.3e-5; in f64 the rows are equal."""
    hf, config = tiny_gpt_oss()
    ours = our_model(config, llmrun_state(hf, config))
    rows = torch.cat([ids_for(s, 12) for s in (3, 4, 5)])
    positions = torch.arange(12).expand(3, 12)
    with torch.no_grad():
        cache = ours.new_cache(3, 32, torch.float32, "cpu")
        batched = [ours(rows[:, :9], positions[:, :9], cache)]
        batched += [ours(rows[:, t : t + 1], positions[:, t : t + 1], cache) for t in (9, 10, 11)]
        batched = torch.cat(batched, dim=1)
        for r in range(3):
            alone = cached(ours, rows[r : r + 1], 32, split=9)
            torch.testing.assert_close(alone[0], batched[r], atol=5e-5, rtol=0)


def test_defaults_are_transformers_and_bad_configs_are_refused():
    module = model_module("gpt_oss")
    _, config = tiny_gpt_oss()
    bare = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    args = module.ModelArgs.from_config(bare)
    assert args.rope_parameters["rope_type"] == "yarn" and args.rope_parameters["factor"] == 32.0
    assert args.rope_parameters["rope_theta"] == 150000.0
    assert args.rope_parameters["truncate"] is False
    assert args.layer_types[:2] == ["sliding_attention", "full_attention"]
    with pytest.raises(LlmrunError, match="num_experts_per_tok is 9, but there are 8"):
        module.ModelArgs.from_config({**config, "num_experts_per_tok": 9})
    with pytest.raises(LlmrunError, match="layer type 'chunked_attention'"):
        module.ModelArgs.from_config({**config, "layer_types": ["chunked_attention"] * 4})

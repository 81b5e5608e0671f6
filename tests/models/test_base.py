"""llmrun.models.base: which attention a forward's Frame lets the native prompt kernel
(ops.attend_prompt) take, and that a model's prompt through it answers as through
torch's SDPA."""

import torch

from llmrun import ops
from llmrun.models.base import Frame, attention_mask, key_positions


def frame(positions: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> Frame:
    start, length = int(positions[0, 0]), int(positions.max()) + 1
    none = torch.zeros(0)
    return Frame(positions, start, length, attention_mask(positions, keys, window), none, none)


def test_a_prompt_after_a_cached_prefix_is_plain_causal():
    cached = torch.arange(0, 5)[None]
    assert frame(cached, key_positions(cached, 5, cache=True)).causal
    chunk = torch.arange(5, 12)[None]
    assert frame(chunk, key_positions(chunk, 12, cache=True)).causal


def test_masks_other_than_plain_causal_are_left_to_torch():
    positions = torch.arange(3, 10)[None]
    keys = key_positions(positions, 10, cache=True)
    assert not frame(positions, keys, window=4).causal  # a sliding window hides keys
    assert frame(positions, keys, window=64).causal  # one that hides none does not
    batch = torch.stack([torch.arange(3, 10), torch.arange(3, 10)])
    assert not frame(batch, key_positions(batch, 10, cache=True)).causal
    assert not frame(torch.tensor([[9]]), key_positions(torch.tensor([[9]]), 10, True)).causal
    gap = torch.tensor([[3, 4, 6]])  # positions with a hole: keys past T
    assert not frame(gap, key_positions(gap, 7, cache=True)).causal


def test_a_models_prompt_answers_as_through_torch(monkeypatch, native_kernels):
    # Heads of 32 (whole vector pairs in both x86 families), two KV heads of two query
    # heads each, a prompt in two chunks (the second after a cached prefix).
    from helpers import BASE

    from llmrun.models.llama import Model, ModelArgs

    torch.manual_seed(0)
    args = ModelArgs.from_config({**BASE, "hidden_size": 128, "model_type": "llama"})
    model = Model(args).eval().requires_grad_(False)
    ids = torch.randint(3, 500, (1, 40))

    def prompt_logits() -> torch.Tensor:
        cache = model.new_cache(1, 64, torch.float32, "cpu")
        first = model(ids[:, :25], torch.arange(25)[None], cache)
        return torch.cat([first, model(ids[:, 25:], torch.arange(25, 40)[None], cache)], 1)

    taken = []
    real = ops.attend_prompt
    monkeypatch.setattr(
        ops, "attend_prompt", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1]
    )
    native = prompt_logits()
    assert len(taken) == 4 and all(y is not None for y in taken)  # 2 layers, 2 chunks
    monkeypatch.setattr(ops, "attend_prompt", lambda *a, **k: None)
    torch.testing.assert_close(native, prompt_logits(), rtol=1e-5, atol=1e-5)

"""llmrun.models.base: which attention a forward's Frame lets the native prompt kernel
(ops.attend_prompt) take, and that a model's prompt through it answers as through
torch's SDPA."""

import torch

from llmrun import ops
from llmrun.models.base import Frame, attention_mask, key_positions
from llmrun.models.cache import KVCache


def frame(positions: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> Frame:
    start, length = int(positions[0, 0]), int(positions.max()) + 1
    none = torch.zeros(0)
    return Frame(positions, start, length, attention_mask(positions, keys, window), none, none)


def test_a_prompt_after_a_cached_prefix_is_plain_causal():
    cached = torch.arange(0, 5)[None]
    assert frame(cached, key_positions(cached, 5, cache=True)).prompt == ((0,), (5,), 0)
    chunk = torch.arange(5, 12)[None]
    assert frame(chunk, key_positions(chunk, 12, cache=True)).prompt == ((5,), (7,), 0)


def test_a_sliding_window_that_hides_keys_is_told():
    positions = torch.arange(3, 10)[None]
    keys = key_positions(positions, 10, cache=True)
    assert frame(positions, keys, window=4).prompt == ((3,), (7,), 4)
    assert frame(positions, keys, window=1).prompt == ((3,), (7,), 1)
    assert frame(positions, keys, window=64).prompt == ((3,), (7,), 0)  # it hides none


def test_a_ring_gives_its_keys_in_position_order():
    """A cache whose windowed layers keep rings of 4: a first chunk attends to its own
    keys; a later one to the ring's (all 4, or the 2 written so far), in position order."""
    cache = KVCache(1, 1, 1, 32, 16, torch.float32, "cpu", windows=[4])
    assert cache.window == 4
    first = cache.plan_window(torch.arange(0, 2)[None])
    assert first.in_order == 0
    plan = cache.plan_window(torch.arange(2, 9)[None])
    assert plan.in_order == 2
    later = Frame(torch.arange(2, 9)[None], 2, 9, plan.mask, torch.zeros(0), torch.zeros(0), plan)
    assert later.prompt == ((2,), (7,), 4)
    plan = cache.plan_window(torch.arange(9, 12)[None])
    assert plan.in_order == 4
    last = Frame(torch.arange(9, 12)[None], 9, 12, plan.mask, torch.zeros(0), torch.zeros(0), plan)
    assert last.prompt == ((4,), (3,), 4)
    k = torch.arange(12.0).view(1, 1, 12, 1).expand(1, 1, 12, 16)
    cache.update_window(0, k[:, :, :9], k[:, :, :9], cache.plan_window(torch.arange(0, 9)[None]))
    keys, _ = cache.update_window(0, k[:, :, 9:], k[:, :, 9:], plan)
    assert keys[0, 0, :, 0].tolist() == [5, 6, 7, 8, 9, 10, 11]  # positions 5 .. 11


def test_rows_padded_on_the_right_are_told_row_by_row():
    """serve's prefill of several rows: each padded to the widest by repeating its last
    position (the padding sees what that position sees)."""
    rows = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5]])
    keys = key_positions(rows, 10, cache=True)
    assert frame(rows, keys).prompt == ((3, 0, 5), (7, 3, 1), 0)
    assert frame(rows, keys, window=2).prompt == ((3, 0, 5), (7, 3, 1), 2)
    short_first = torch.tensor([[0, 1, 1], [4, 5, 6]])  # the window hides row 1's keys only
    keys = key_positions(short_first, 7, cache=True)
    assert frame(short_first, keys, window=3).prompt == ((0, 4), (2, 3), 3)


def test_masks_other_than_a_prompts_are_left_to_torch():
    one = torch.tensor([[9]])
    assert frame(one, key_positions(one, 10, True)).prompt is None
    gap = torch.tensor([[3, 4, 6]])  # positions with a hole: keys past T
    assert frame(gap, key_positions(gap, 7, cache=True)).prompt is None
    positions = torch.arange(0, 6)[None]
    keys = key_positions(positions, 6, cache=True)
    other = frame(positions, keys)
    other.mask = other.mask.clone()
    other.mask[0, 0, 5, 2] = False  # a hole no window makes
    assert other.prompt is None


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

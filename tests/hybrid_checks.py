"""Checks the hybrid families' test files (a recurrent state per sequence beside the
attention layers' keys and values: Qwen3.5, Granite 4.0-H, Nemotron-H, Falcon-H1, Kimi
Linear, LFM2) hold their own model to: padded rows of a batch in the cache's rows,
serve's paged blocks with a state row, a typed cache beside a float32 state, a saved
folder loading without a native decode step, no CUDA-graphs static step, the scheduler's
concurrent greedy text. Each takes the family's model and its reference; only the code
is shared."""

from collections.abc import Callable
from pathlib import Path

import torch
from family_checks import cache_logits, check_typed_cache, greedy_text, max_diff
from helpers import cached_logits

from llmrun import static_decode
from llmrun.loading.loader import load_model
from llmrun.models.paged import PagedKVCache

Reference = Callable[[torch.Tensor], torch.Tensor]
"""The reference's logits of a [1, tokens] tensor of ids: [1, tokens, vocab]."""


def check_padded_rows_in_scattered_slots(
    model, reference: Reference, ids: torch.Tensor, padding_repeats: bool = False
) -> None:
    """Three prompts of `ids` (9, 4 and 28 tokens) padded on the right (a padded token
    repeats its row's last token and position, as the server pads them) in rows 3, 0, 2
    of a 4-row cache, then a decode step each: each row's logits are `reference`'s of
    its prompt alone (1e-4). With `padding_repeats`, also every token's logits through
    a fresh cache: a padded token's are its row's last real token's (1e-5)."""
    prompts = [ids[0, :9].tolist(), ids[0, :4].tolist(), ids[0, 2:30].tolist()]
    width = max(len(p) for p in prompts)
    padded = [p + [p[-1]] * (width - len(p)) for p in prompts]
    positions = [[min(i, len(p) - 1) for i in range(width)] for p in prompts]
    cache = model.new_cache(4, 64, torch.float32, "cpu")
    with torch.no_grad():
        view = cache.select([3, 0, 2])
        prefill = model(
            torch.tensor(padded), torch.tensor(positions), view,
            last=torch.tensor([len(p) - 1 for p in prompts]),
        )  # fmt: skip
        step = model(torch.tensor([[7]] * 3), torch.tensor([[len(p)] for p in prompts]), view)
        if padding_repeats:
            every = model(
                torch.tensor(padded), torch.tensor(positions), model.new_cache(3, 64, "f32", "cpu")
            )
    for row, prompt in enumerate(prompts):
        if padding_repeats:
            for t in range(len(prompt), width):
                assert max_diff(every[row, t], every[row, len(prompt) - 1]) < 1e-5
        assert max_diff(prefill[row, -1], reference(torch.tensor([prompt]))[0, -1]) < 1e-4
        expected = reference(torch.tensor([prompt + [7]]))[0, -1]
        assert max_diff(step[row, -1], expected) < 1e-4


def check_padded_rows_decoded_together(model, reference: Reference, ids: torch.Tensor) -> None:
    """Rows of 12, 7 and 10 tokens (`ids`, and `ids` rolled by 5 and by 11) prefilled
    together, padded on the right as the server pads them (a padded token repeats its
    row's last position), then 5 tokens decoded together: each row's logits are
    `reference`'s for it alone (1e-4)."""
    lengths, steps = [12, 7, 10], 5
    width = max(lengths)
    cache = model.new_cache(3, 64, torch.float32, "cpu")
    rows = ids[0, : width + steps].repeat(3, 1)
    rows[1] = rows[1].roll(5)
    rows[2] = rows[2].roll(11)
    positions = torch.tensor([[min(i, n - 1) for i in range(width)] for n in lengths])
    with torch.no_grad():
        prefill = model(rows[:, :width], positions, cache, last=torch.tensor(lengths) - 1)[:, 0]
        decoded = []
        for s in range(steps):
            step_ids = torch.stack([rows[r, n + s] for r, n in enumerate(lengths)])[:, None]
            step_positions = torch.tensor([[n + s] for n in lengths])
            decoded.append(model(step_ids, step_positions, cache)[:, 0])
    for row, n in enumerate(lengths):
        expected = reference(rows[row : row + 1, : n + steps])[0]
        assert max_diff(prefill[row], expected[n - 1]) < 1e-4
        assert max_diff(torch.stack([d[row] for d in decoded]), expected[n:]) < 1e-4


def check_paged_with_a_state_row(
    model,
    ids: torch.Tensor,
    expected: torch.Tensor,
    states=None,
    cache_type: str = "f32",
    tolerance: float | None = None,
    rows: int = 4,
    row: int = 2,
    blocks: tuple[int, ...] = (9, 2, 14),
) -> None:
    """serve's path: keys and values (a `cache_type` pool) through `blocks`, the
    recurrent state in `row` of `states` (the scheduler's RecurrentState; by default
    `rows` rows like the pool's), in prefills of 7 and 20 tokens, then decode steps: the
    logits are `expected` within `tolerance` (by default 1e-4 for f32 blocks, else 1e-2)."""
    if tolerance is None:
        tolerance = 1e-4 if cache_type == "f32" else 1e-2
    like = model.new_cache(1, 1, cache_type, "cpu")
    pool = PagedKVCache(like, 16, 16, 256)
    if states is None:
        states = like.recurrent.empty_like(rows)

    def view():
        paged = pool.view([list(blocks)])
        paged.recurrent = states.select([row])
        return paged

    assert max_diff(cache_logits(model, ids, view), expected) < tolerance


def check_typed_cache_with_a_float32_state(
    model, ids: torch.Tensor, expected: torch.Tensor, cache_type: str, drift: float
) -> None:
    """family_checks' check_typed_cache (the attention layers' rows rounded to
    `cache_type`), with the recurrent state kept in float32."""
    assert model.new_cache(1, 8, cache_type, "cpu").recurrent.dtype == torch.float32
    check_typed_cache(model, ids, expected, cache_type, drift)


def check_saved_folder_loads(hf, folder: Path, ids: torch.Tensor, expected: torch.Tensor) -> None:
    """`hf` saved by transformers to `folder` loads without a native decode step (it keeps
    no recurrent state), its logits through the cache `expected` within 1e-4."""
    hf.save_pretrained(folder)
    loaded = load_model(folder, torch.device("cpu"), "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, ids), expected) < 1e-4


def check_no_static_decode(model) -> None:
    """CUDA graphs' static step keeps no recurrent state: it refuses the model's cache."""
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))


def check_served_greedy_text(engine, hf, path, prompts: list[str], parallel: int) -> None:
    """serve's scheduler (`parallel` state rows, a queue of 8) decodes `prompts` (of
    different lengths, more than the rows or as many) 12 greedy tokens each: each gets
    transformers' greedy text for its prompt alone."""
    from test_batching import Collector

    from llmrun.batching import Request, Scheduler
    from llmrun.sampling import SamplingParams

    scheduler = Scheduler(engine, parallel=parallel, queue=8)
    greedy = SamplingParams(temperature=0)
    collectors = [Collector() for _ in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        scheduler.submit(Request(engine.tokenizer.encode(prompt), greedy, 12), collector)
    scheduler.start()
    try:
        for prompt, collector in zip(prompts, collectors, strict=True):
            text, _ = collector.result()
            assert text == greedy_text(hf, path, prompt, 12)
    finally:
        scheduler.close()

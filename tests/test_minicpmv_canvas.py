"""Canvas M-RoPE (llmrun.minicpmv_canvas) against transformers' MiniCPMV4_7Model.get_rope_index
on 100 random prompts of one to three images, whole or sliced in grids of up to 3x3, with
text, newlines and stray markers between them (frames that only markers separate share a
group) and after them. Every token's positions are get_rope_index's, and outside the
frames' spans every token turns by its place plus the shift the frames before it leave
(what a prefill in chunks and the decode take).

Tolerances: exact.
"""

import random

import pytest
import torch
from minicpmv_helpers import IMAGE_PAD, MARKER_IDS, tiny_minicpmv

from llmrun.minicpmv_canvas import Markers, positions

transformers = pytest.importorskip("transformers")
MARKERS = Markers(*MARKER_IDS.values())
TEXT = (300, 301, MARKERS.newline, MARKERS.image_end, MARKERS.slice_start)
MERGE = 4  # 16x mode: get_rope_index's grids are in patches, 4x4 a token


def image(rng: random.Random) -> tuple[list[int], list[tuple[int, int]]]:
    """An image's prompt text as MiniCPMV4_7Processor expands it, and its crops' grids."""
    whole = (rng.randint(1, 3), rng.randint(1, 3))
    ids = [MARKERS.image_start, *[IMAGE_PAD] * (whole[0] * whole[1]), MARKERS.image_end]
    rows, columns = rng.choice([(0, 0), (1, 2), (2, 1), (2, 2), (3, 3), (1, 3)])
    tile = (rng.randint(1, 3), rng.randint(1, 3))
    for row in range(rows):
        ids += [MARKERS.newline] if row else []
        for _ in range(columns):
            ids += [MARKERS.slice_start, *[IMAGE_PAD] * (tile[0] * tile[1]), MARKERS.slice_end]
    return ids, [whole] + [tile] * (rows * columns)


def test_positions_are_get_rope_index_s_and_text_turns_by_its_shift():
    model = tiny_minicpmv(version="4.7").model
    rng = random.Random(0)
    for _ in range(100):
        ids, grids = [], []
        for _ in range(rng.randint(1, 3)):
            ids += [rng.choice(TEXT) for _ in range(rng.randint(0, 3))]
            more, crops = image(rng)
            ids, grids = ids + more, grids + crops
        ids += [rng.choice(TEXT[:3]) for _ in range(rng.randint(0, 3))]
        tensor = torch.tensor([ids])
        expected, _ = model.get_rope_index(
            tensor,
            mm_token_type_ids=(tensor == IMAGE_PAD).int(),
            target_sizes=torch.tensor(grids) * MERGE,
        )
        rope, spans = positions(ids, [t == IMAGE_PAD for t in ids], grids, MARKERS)
        assert torch.equal(rope, expected[:, 0]), ids
        inside = {i for a, b in spans for i in range(a, b)}
        assert {i for i, t in enumerate(ids) if t == IMAGE_PAD} <= inside
        for i in sorted(set(range(len(ids))) - inside):
            before = max((b for _, b in spans if b <= i), default=0)
            shift = int(rope[:, :before].max()) + 1 - before if before else 0
            assert rope[:, i].tolist() == [i + shift] * 3, (ids, i)

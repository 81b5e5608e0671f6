"""M-RoPE, Qwen2-VL's and Qwen2.5-VL's multimodal RoPE, for a prompt with images: each
head's rotated pairs split into three sections turned by a token's time, height and width
positions. A text token's three are its position, so text alone turns as plain RoPE; an
image's tokens take (start, start + row, start + column) over its grid of merged tokens,
and the text after it goes on from the largest of those + 1, which is less than its place
in the sequence: from there on a token turns by its place plus a (negative) shift, also
while decoding, which the KV cache keeps (KVCache.rope_shifts), or for serve's paged
cache the scheduler, which gives each row's (PagedView.rope_shifts).

Reference: transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py (get_rope_index,
Qwen2_5_VLRotaryEmbedding, the rope_deltas of decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmrun.errors import ModelFormatError
from llmrun.models.base import RotaryEmbedding
from llmrun.models.cache import KVCache


@dataclass
class MRopeImages:
    """The images of a one-row forward: their embeddings [n, hidden] in the order of the
    placeholder tokens they replace, `groups` [T] (for each token the image it belongs to,
    -1 for text), every token's (time, height, width) positions `rope` [3, T], and the
    shift of the tokens after the forward (their rope position minus their place)."""

    embeds: torch.Tensor
    groups: torch.Tensor
    rope: torch.Tensor
    shift: int

    def place(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, hidden] with the image tokens' rows replaced."""
        x[0, self.groups >= 0] = self.embeds.to(x.dtype)
        return x


def rope_positions(
    positions: torch.Tensor, cache: KVCache | None, images: MRopeImages | None
) -> torch.Tensor | None:
    """The (time, height, width) positions [3, B, T] that the tokens at `positions` [B, T]
    turn by: the images' own, or the positions shifted as the images before them in the
    cache say (serve's paged view: each row's shift, which its scheduler knows); None
    where they turn by their positions (no image before them). Keeps a KVCache's shifts:
    those of tokens this forward overwrites dropped, the images' added."""
    shift = 0
    if images is None and getattr(cache, "paged", False) and cache.rope_shifts is not None:
        shifted = positions + cache.rope_shifts[:, None].to(positions.device)
        return shifted[None].expand(3, -1, -1)
    if isinstance(cache, KVCache) and positions.shape[0] == 1:
        start = int(positions[0, 0])
        # A forward from `start` writes over whatever the cache held from there on.
        kept = tuple(s for s in cache.rope_shifts if s[0] <= start)
        cache.rope_shifts = kept
        shift = kept[-1][1] if kept else 0
        if images is not None and images.shift != shift:
            cache.rope_shifts = (*kept, (start + positions.shape[1], images.shift))
    if images is not None:
        if positions.shape[0] != 1:
            raise ValueError("images go with a forward of one row")
        return images.rope.to(positions.device)[:, None]
    if shift == 0:
        return None
    return (positions + shift)[None].expand(3, -1, -1)


def angles(
    rotary: RotaryEmbedding,
    rope: torch.Tensor,
    sections: Sequence[int],
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [B, T, rotary_dim] (as RotaryEmbedding gives them) of the
    positions rope [3, B, T]: each pair of the first section turned by the time position,
    of the second by the height, of the third by the width (both halves alike)."""
    half = rotary.rotary_dim // 2
    if len(sections) != 3 or sum(sections) != half:
        raise ModelFormatError(
            f"mrope_section {list(sections)} does not split the {half} rotated pairs of a "
            "head into time, height and width"
        )
    turned = [rotary(rope[axis], capacity) for axis in range(3)]
    # Each feature's axis: [half] by section, for both halves -> [rotary_dim]
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
    axis = torch.cat([axis, axis]).to(rope.device)
    out = []
    for part in (0, 1):  # cos, sin
        stacked = torch.stack([t[part] for t in turned])  # [3, B, T, rotary_dim]
        pick = axis.expand(1, *stacked.shape[1:])
        out.append(stacked.gather(0, pick)[0])
    return out[0], out[1]

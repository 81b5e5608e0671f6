"""Canvas M-RoPE, MiniCPM-V 4.7's positions for a prompt with images: every token's (time,
height, width) position as MiniCPMV4_7Model.get_rope_index gives it, and which tokens each
image's positions reach (its frame).

Each image is a frame: <image>, the whole image's tokens (its thumbnail), </image>, then
its slices, each between <slice> and </slice>, a newline closing each row of them. A
frame lies on a canvas of its slices' grid of tokens (the thumbnail's own where it is not
sliced) at the text position it begins at (its origin): the thumbnail's tokens spread over
the whole canvas, each slice's at its place on it, all at time `origin`; <image> sits
just outside the canvas's top-left corner, </image> on its far corner, <slice> and
</slice> on their slice's corners and a row's newline past its right edge. The text after
a frame goes on from origin + the canvas's longer side + 1. Frames with nothing but
markers between them share a group (then the markers take the first frame's origin);
the markers that follow a frame's last crop (a newline, say) belong to it.

Reference: transformers/models/minicpmv4_7/modeling_minicpmv4_7.py (MiniCPMV4_7Model:
_group_visual_frames, get_vision_position_ids, get_rope_index).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

Span = tuple[int, int]


@dataclass(frozen=True)
class Markers:
    """The ids of the tokens that canvas M-RoPE pins (MiniCPMV4_7Config's *_id fields)."""

    image_start: int
    image_end: int
    slice_start: int
    slice_end: int
    newline: int

    def __contains__(self, token: int) -> bool:
        return token in (
            self.image_start,
            self.image_end,
            self.slice_start,
            self.slice_end,
            self.newline,
        )


@dataclass
class _Frame:
    """An image's crops in the prompt (its thumbnail's and its slices' spans of tokens)."""

    thumbnail: Span  # the whole image's tokens
    slices: list[Span]
    end: int = 0  # one past the markers that close it


def _runs(is_image: Sequence[bool]) -> Iterator[Span]:
    """The maximal runs of image tokens: each one crop (a thumbnail or a slice)."""
    start = None
    for i, image in enumerate([*is_image, False]):
        if image and start is None:
            start = i
        elif not image and start is not None:
            yield start, i
            start = None


def _groups(ids: Sequence[int], is_image: Sequence[bool], markers: Markers) -> list[list[_Frame]]:
    """The frames of a prompt, grouped where only markers lie between them
    (_group_visual_frames): a crop right after <slice> is a slice of the frame before."""
    groups: list[list[_Frame]] = []
    frame: _Frame | None = None
    previous_end = 0
    for start, end in _runs(is_image):
        if frame is not None and ids[start - 1] == markers.slice_start:
            frame.slices.append((start, end))
        else:
            frame = _Frame((start, end), [])
            between = ids[previous_end : start - 1]
            if groups and all(t in markers for t in between):
                groups[-1].append(frame)
            else:
                groups.append([frame])
        previous_end = end
    for group in groups:
        for f in group:
            f.end = f.slices[-1][1] if f.slices else f.thumbnail[1]
            while f.end < len(ids) and ids[f.end] in markers:
                f.end += 1
    return groups


def _grid(
    origin: int,
    grid: tuple[int, int],
    canvas: tuple[int, int] = (0, 0),
    offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """The positions [3, rows * columns] of a grid of tokens (row by row) spread over a
    canvas of rows x columns (its own size where 0), from `offset` on it
    (get_vision_position_ids)."""
    rows, columns = grid
    along = [
        torch.linspace(0, (size or count) - 1, count).round().long() + shift
        for size, count, shift in zip(canvas, grid, offset, strict=True)
    ]
    height, width = torch.meshgrid(along[0], along[1], indexing="ij")
    return torch.stack([torch.zeros_like(height), height, width]).reshape(3, -1) + origin


def _slice_columns(slices: list[Span]) -> tuple[int, int]:
    """The rows and columns of a frame's slices: a row ends where more than the two
    markers </slice><slice> lie between two slices (its newline)."""
    columns = len(slices)
    for k in range(len(slices) - 1):
        if slices[k + 1][0] - slices[k][1] > 2:
            columns = k + 1
            break
    rows = len(slices) // columns
    if rows * columns != len(slices):
        return 1, len(slices)
    return rows, columns


def positions(
    ids: Sequence[int],
    is_image: Sequence[bool],
    grids: Sequence[tuple[int, int]],
    markers: Markers,
) -> tuple[torch.Tensor, list[Span]]:
    """The positions [3, len(ids)] of a prompt whose image tokens are `is_image`, its crops'
    grids of tokens (rows, columns) `grids` in prompt order; and each frame's span of
    tokens (from its <image> to the markers that close it, not into the next frame)."""
    length = len(ids)
    rope = torch.arange(length).expand(3, -1).clone()
    crops = iter(grids)
    position, done = 0, 0
    spans: list[Span] = []
    for group in _groups(ids, is_image, markers):
        group_start, group_end = group[0].thumbnail[0] - 1, group[-1].end
        rope[:, done:group_start] = torch.arange(group_start - done) + position
        position += group_start - done
        cursor = group_start
        for frame in group:
            thumb_start, thumb_end = frame.thumbnail
            start, end = thumb_start - 1, min(frame.end, group_end)
            if start > cursor:
                rope[:, cursor:start] = torch.arange(start - cursor) + position
                # One step more: the next frame's <image> (its halo) is not on the last.
                position += start - cursor + 1
            origin = position
            thumbnail = next(crops)
            canvas, slice_grid, columns = thumbnail, (0, 0), 0
            if frame.slices:
                rows, columns = _slice_columns(frame.slices)
                slice_grid = next(crops)
                canvas = (rows * slice_grid[0], columns * slice_grid[1])
            # The frame's markers at the origin, <image> just outside the top-left corner,
            # </image> on the far one.
            rope[:, start:end] = origin
            rope[1:, start] = max(origin - 1, 0)
            if thumb_end < end:
                rope[1:, thumb_end] = torch.tensor(canvas) + origin
            rope[:, thumb_start:thumb_end] = _grid(origin, thumbnail, canvas)
            for k, (a, b) in enumerate(frame.slices):
                corner = ((k // columns) * slice_grid[0], (k % columns) * slice_grid[1])
                grid = slice_grid if k == 0 else next(crops)
                if a - 1 >= start:
                    rope[1:, a - 1] = torch.tensor(corner) + origin
                if b < end:
                    far = (corner[0] + grid[0] - 1, corner[1] + grid[1] - 1)
                    rope[1:, b] = torch.tensor(far) + origin
                rope[:, a:b] = _grid(origin, grid, offset=corner)
            for k in range(len(frame.slices) - 1):
                gap_start, gap_end = frame.slices[k][1], frame.slices[k + 1][0]
                if gap_end - gap_start > 2:
                    edge = ((k // columns + 1) * slice_grid[0] - 1, columns * slice_grid[1])
                    rope[1:, gap_start + 1 : gap_end - 1] = torch.tensor(edge)[:, None] + origin
            position = origin + max(canvas) + 1
            cursor = end
            spans.append((start, end))
        rope[:, cursor:group_end] = torch.arange(group_end - cursor) + position
        position += group_end - cursor
        done = group_end
    rope[:, done:] = torch.arange(length - done) + position
    # A frame's span stops where the next one (of its group) begins.
    following = [start for start, _ in spans[1:]] + [length]
    return rope, [
        (start, min(end, then)) for (start, end), then in zip(spans, following, strict=True)
    ]

"""M-RoPE, Qwen2-VL's and Qwen2.5-VL's multimodal RoPE, for a prompt with images: each
head's rotated pairs split into three sections turned by a token's time, height and width
positions. A text token's three are its position, so text alone turns as plain RoPE; an
image's tokens take (start, start + row, start + column) over its grid of merged tokens,
and the text after it goes on from the largest of those + 1, which is less than its place
in the sequence: from there on a token turns by its place plus a (negative) shift, also
while decoding, which the KV cache keeps (KVCache.rope_shifts), or for serve's paged
cache the scheduler, which gives each row's (PagedView.rope_shifts).

Qwen3-VL's and Qwen3.5's (mrope_interleaved) take the sections' pairs interleaved instead
of in blocks: pair 3i+1 turned by the height, 3i+2 by the width while the height's and
the width's sections last, the others by the time. Qwen3-VL's images carry deepstack
features too: each image token's embedding is followed by one more of the same width per
deepstack layer (llama.cpp's layout), added to the hidden states after the first decoder
layers.

Reference: transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py (get_rope_index,
Qwen2_5_VLRotaryEmbedding, the rope_deltas of decoding); models/qwen3_vl/
modeling_qwen3_vl.py (Qwen3VLTextRotaryEmbedding, Qwen3VLTextModel._deepstack_process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ModelFormatError
from llmrun.models.base import CausalLM, Frame, RotaryEmbedding, head_logits
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
        x[0, self.groups >= 0] = self.embeds[:, : x.shape[-1]].to(x.dtype)
        return x

    def deepstack_layers(self, hidden: int) -> int:
        """How many decoder layers take deepstack features (Qwen3-VL's) of the images,
        for a language model `hidden` wide."""
        width = self.embeds.shape[-1]
        if width % hidden:
            raise ModelFormatError(
                f"image embeddings of {width} features are not the language model's "
                f"{hidden} and its deepstack layers'"
            )
        return width // hidden - 1

    def add_deepstack(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [1, T, hidden] (the output of decoder layer `layer`) with that layer's
        deepstack features added at the image tokens."""
        hidden = x.shape[-1]
        features = self.embeds[:, hidden * (layer + 1) : hidden * (layer + 2)]
        x = x.clone()
        x[0, self.groups >= 0] += features.to(x.dtype)
        return x


def shifted(cache: Any, images: MRopeImages | None) -> bool:
    """Whether a forward may turn otherwise than by its positions: it takes images, or the
    cache (a KVCache, or serve's paged view) holds shifts of images before. A language
    model that takes images but turns text as plain RoPE skips rope_positions otherwise
    (its per-forward reads of positions)."""
    if images is not None:
        return True
    shifts = getattr(cache, "rope_shifts", None)
    return shifts is not None and (not isinstance(shifts, tuple) or len(shifts) > 0)


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
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [B, T, rotary_dim] (as RotaryEmbedding gives them) of the
    positions rope [3, B, T]: each pair of the first section turned by the time position,
    of the second by the height, of the third by the width (both halves alike); or,
    `interleaved`, pair 3i+1 by the height for i < sections[1], 3i+2 by the width for
    i < sections[2], the others by the time."""
    half = rotary.rotary_dim // 2
    if len(sections) != 3 or sum(sections) != half:
        raise ModelFormatError(
            f"mrope_section {list(sections)} does not split the {half} rotated pairs of a "
            "head into time, height and width"
        )
    turned = [rotary(rope[axis], capacity) for axis in range(3)]
    # Each feature's axis: [half], for both halves -> [rotary_dim]
    if interleaved:
        pair = torch.arange(half)
        axis = torch.zeros(half, dtype=torch.long)
        axis[(pair % 3 == 1) & (pair < 3 * sections[1])] = 1
        axis[(pair % 3 == 2) & (pair < 3 * sections[2])] = 2
    else:
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
    axis = torch.cat([axis, axis]).to(rope.device)
    out = []
    for part in (0, 1):  # cos, sin
        stacked = torch.stack([t[part] for t in turned])  # [3, B, T, rotary_dim]
        pick = axis.expand(1, *stacked.shape[1:])
        out.append(stacked.gather(0, pick)[0])
    return out[0], out[1]


def turns(
    model: Any,
    rope: torch.Tensor,
    cache: KVCache | None,
    images: MRopeImages | None,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [B, T, rotary_dim] of the positions rope [3, B, T]
    (rope_positions') by a language model's RoPE (model.model.rotary_emb): with images,
    each section by its axis (angles; the sections of the model's rope_parameters,
    `interleaved` or not); for text after images, every axis at the same shifted position."""
    rotary = model.model.rotary_emb
    capacity = cache.max_seq_len if cache is not None else None
    if images is None:
        return rotary(rope[0], capacity)
    sections = model.args.rope_parameters["mrope_section"]
    return angles(rotary, rope, sections, capacity, interleaved)


def deepstack_logits(
    model: Any,
    x: torch.Tensor,
    frames: Any,
    cache: KVCache | None,
    images: MRopeImages | None,
    last_only: bool = False,
    last: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits of x [B, T, hidden] through a language model's decoder layers (each
    given `frames`: a Frame, or a family's dict of them), final norm and head
    (model.model.layers, .norm, model.lm_head), the images' deepstack features added
    after the first layers; [B, 1, vocab] with last_only or `last` (as head_logits)."""
    deepstack = 0 if images is None else images.deepstack_layers(x.shape[-1])
    layers = model.model.layers
    if deepstack > len(layers):
        raise ModelFormatError(
            f"images with {deepstack} deepstack layers for a language model of {len(layers)}"
        )
    for i, layer in enumerate(layers):
        x = layer(x, frames, cache)
        if i < deepstack:
            x = images.add_deepstack(x, i)
    if last is not None:
        x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
    elif last_only:
        x = x[:, -1:]
    return model.lm_head(model.model.norm(x)).float()


def forward(
    model: Any,
    x: torch.Tensor,
    frame: Frame,
    rope: torch.Tensor,
    cache: KVCache | None,
    images: MRopeImages | None,
    interleaved: bool,
    last_only: bool = False,
    last: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits of the embedded tokens x [B, T, hidden] (their images placed)
    through a language model's decoder layers, final norm and head (model.model.layers,
    .norm, model.lm_head, as head_logits), turned by M-RoPE at rope [3, B, T]
    (rope_positions'; the sections of the model's rope_parameters, `interleaved` or not)
    instead of by the frame's positions, the images' deepstack features added after the
    first layers."""
    cos, sin = turns(model, rope, cache, images, interleaved)
    # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
    frame = dataclasses.replace(frame, cos=cos[:, None].to(x.dtype), sin=sin[:, None].to(x.dtype))
    if images is None or not images.deepstack_layers(x.shape[-1]):
        return head_logits(model, x, frame, cache, last_only, last).float()
    return deepstack_logits(model, x, frame, cache, images, last_only, last)


class MRopeLM(CausalLM):
    """A CausalLM whose prompts with images turn by M-RoPE where its rope_parameters have
    an mrope_section: the language model of Qwen2-VL, Qwen3-VL, GLM-4.1V, ... The sections
    take the rotated pairs `interleaved` (Qwen3-VL's) or in blocks."""

    interleaved = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: MRopeImages | None = None,
    ) -> torch.Tensor:
        """CausalLM.forward; `images`: image tokens (one row) in place of their
        placeholders, which with the text after them turn by M-RoPE; without an
        mrope_section (InternVL's), or image tokens other than MRopeImages (MiniCPM-V
        4.6's), CausalLM's image tokens, which turn by their positions as text does."""
        sections = self.args.rope_parameters.get("mrope_section")
        by_mrope = images is None or isinstance(images, MRopeImages)
        turned = sections and by_mrope and shifted(cache, images)
        rope = rope_positions(positions, cache, images) if turned else None
        if rope is None:
            return super().forward(input_ids, positions, cache, last_only, last, static, images)
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        if images is not None:
            x = images.place(x)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        return forward(self, x, frame, rope, cache, images, self.interleaved, last_only, last)

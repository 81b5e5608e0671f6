"""RoPE as the vision towers apply it to their patches: rotate_half's layout (a head's two
halves are the two parts of its rotation pairs), with cos/sin that a tower builds from its
own 2D or M-RoPE angles."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] with its halves swapped, the second negated: (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] turned by cos/sin that broadcast against it."""
    return x * cos + rotate_half(x) * sin


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] turned by cos/sin [N, head_dim], the same for every head."""
    return rotate(x, cos[:, None], sin[:, None])

"""A decode step with every shape fixed, for CUDA graphs.

Decoding one token runs hundreds of small kernels; on a GPU their launches and the
Python around them cost more than the kernels themselves. A static step fixes every
shape and keeps every value on the device: the token attends to a fixed span of the
cache, positions past it masked (llmrun.models.base.CausalLM.static_frame), and its keys
and values are stored by index_copy_ at a position tensor (KVCache.update_static), so
torch.compile with mode="reduce-overhead" can capture the step as a CUDA graph and
replay it for each token with one launch. A token attends to a bucket of the cache,
the smallest power of two from FIRST_BUCKET that holds its position (or the whole
cache), so it reads at most twice the keys it needs, and there is one graph per
bucket, each captured when first used.

It applies to the families whose forward is CausalLM's own and whose layers have no
experts (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, GLM-4, ERNIE 4.5, OLMo 2,
SmolLM3, Command-R): the others build frames of their own (sliding-window rings) or
route tokens through experts (routers read their choices back to the host). Elsewhere, and where the compiled step
fails, decoding runs the model's ordinary forward (a note says why, once).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from llmrun.models.base import CausalLM
from llmrun.models.cache import KVCache

Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

FIRST_BUCKET = 256
# Where the step is compiled: CUDA, the one device whose graphs pay (tests add "cpu").
DEVICES = ("cuda",)


def bucket(position: int, max_seq_len: int) -> int:
    """The cache positions a static step at `position` attends to (see the docstring)."""
    length = FIRST_BUCKET
    while length <= position:
        length *= 2
    return min(length, max_seq_len)


def supported(model: nn.Module, cache: KVCache) -> bool:
    """Whether `model` can decode `cache`'s one row in a static step."""
    return (
        isinstance(model, CausalLM)
        and type(model).frame is CausalLM.frame
        # Mixtures of experts read their routers' choices back to the host.
        and not any(isinstance(getattr(m, "experts", None), nn.ModuleList) for m in model.modules())
        and not cache.paged
        and cache.ring_k is None
        and cache.uniform
        and cache.recurrent is None
        and not cache.rope_shifts  # positions shifted after images (llmrun.models.mrope)
        and cache.rows is None
        and cache.k.shape[1] == 1
    )


def step(model: nn.Module, cache: KVCache) -> Step:
    """The static step over `cache`, eager: logits [1, 1, vocab] for ids [1, 1] at
    positions [1, 1] (a device tensor), attending to the first `length` positions
    (bucket())."""

    def decode(ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        return model(ids, positions, cache, static=length)

    return decode


def decoder(model: nn.Module, cache: KVCache) -> Step | None:
    """The decode step for `cache` on CUDA, captured as a CUDA graph per bucket when
    first called there (kept on the cache: a new cache compiles again); None where it
    does not apply."""
    if cache.k.device.type not in DEVICES or not supported(model, cache):
        return None
    found = getattr(cache, "static_step", None)
    if found is None:
        # A graph per bucket: more than dynamo's default limit of 8 compiles.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # The graphs write the cache in place: like a module's buffers, it must keep its
        # address for them (as transformers' StaticCache marks its tensors).
        torch._dynamo.mark_static_address(cache.k)
        torch._dynamo.mark_static_address(cache.v)
        compiled = torch.compile(
            step(model, cache), mode="reduce-overhead", fullgraph=True, dynamic=False
        )
        found = cache.static_step = _guarded(compiled, model, cache)
    return found


def _guarded(compiled: Step, model: nn.Module, cache: KVCache) -> Step:
    """`compiled`, or the ordinary forward from the first failure on (noted once)."""
    failed = False

    def decode(ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        nonlocal failed
        if not failed:
            try:
                # The graph's outputs are overwritten by its next replay: a copy.
                return compiled(ids, positions, length).clone()
            except Exception as e:  # a torch.compile or graph capture failure
                failed = True
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(
                    f"note: CUDA graph decoding failed ({reason}); decoding eagerly",
                    file=sys.stderr,
                )
        return model(ids, positions, cache)

    return decode

"""Nanbeige 4.2 (NanbeigeForCausalLM, Nanbeige/Nanbeige4.2-3B): a looped Llama. Its
layers run num_loops times over the token stream, the final norm applied between loops
(unless skip_loop_final_norm) and after the last; every run of a layer keeps keys and
values of its own, so the KV cache holds layers * num_loops entries, loop-major.

Reference: llama.cpp's src/models/nanbeige.cpp (the checkpoints' modeling code is remote
code). Parameter names are Llama's, as the Hub's checkpoints have them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import CausalLM, DecoderLayer, Frame, GatedMLP, args_from_config, attend
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    num_loops: int = 1
    skip_loop_final_norm: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.num_loops, int) and self.num_loops >= 1):
            raise ModelFormatError(f"Nanbeige: num_loops is {self.num_loops!r}, not 1 or more")

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        return args_from_config(cls, config)

    def layer_windows(self) -> list[None]:
        """One entry per KV cache entry (each layer's run in each loop): no windows."""
        return [None] * (self.num_hidden_layers * self.num_loops)


class Attention(llama.Attention):
    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, entry: int
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return self.o_proj(attend(frame.rotate(q), frame.rotate(k), v, entry, frame, cache))


class LoopLayer(DecoderLayer):
    """Llama's layer, its attention writing the cache entry of this run of it."""

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, entry: int
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache, entry)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, LoopLayer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (or [B, 1, vocab]: last_only, or `last` [B], each
        row's last real token) of input_ids [B, T] at positions [B, T]; `static`: see
        CausalLM.forward."""
        args, body = self.args, self.model
        x = self.embed(input_ids)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        layers = len(body.layers)
        for loop in range(args.num_loops):
            if loop and not args.skip_loop_final_norm:
                x = body.norm(x)
            for i, layer in enumerate(body.layers):
                x = layer(x, frame, cache, loop * layers + i)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(body.norm(x)).float()

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        """A KV cache of an entry per layer and loop."""
        args = self.args
        return KVCache(
            args.num_hidden_layers * args.num_loops, batch, args.num_key_value_heads,
            max_seq_len, args.head_dim, dtype, device,
        )  # fmt: skip

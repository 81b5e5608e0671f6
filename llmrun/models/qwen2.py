"""Qwen2 and Qwen2.5: Llama with biases on the q/k/v projections; also the language model
of Qwen2-VL and Qwen2.5-VL, whose prompts with images turn by M-RoPE
(llmrun.models.mrope; rope_parameters' mrope_section).

Reference: transformers/models/qwen2/modeling_qwen2.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import mrope
from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config, attend, head_logits
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_sliding_window:
            raise UnsupportedError("Qwen2 with use_sliding_window=true is not supported")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: mrope.MRopeImages | None = None,
    ) -> torch.Tensor:
        """CausalLM.forward; `images`: Qwen2-VL's image tokens (one row) in place of their
        placeholders, which with the text after them turn by M-RoPE; without M-RoPE
        (InternVL's), CausalLM's image tokens, which turn by their positions as text does."""
        sections = self.args.rope_parameters.get("mrope_section")
        rope = mrope.rope_positions(positions, cache, images) if sections else None
        if rope is None:
            return super().forward(input_ids, positions, cache, last_only, last, static, images)
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        if images is not None:
            x = images.place(x)
        capacity = cache.max_seq_len if cache is not None else None
        if images is None:  # text after images: every axis at the same shifted position
            cos, sin = self.model.rotary_emb(rope[0], capacity)
        else:
            cos, sin = mrope.angles(self.model.rotary_emb, rope, sections, capacity)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        frame = dataclasses.replace(
            frame, cos=cos[:, None].to(x.dtype), sin=sin[:, None].to(x.dtype)
        )
        return head_logits(self, x, frame, cache, last_only, last).float()

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 (an RMSNorm on each query and
key head) with a mixture-of-experts feed-forward, the top-k of many small experts; also
the language model of Qwen3-VL-MoE, whose prompts with images turn by interleaved M-RoPE
and take the images' deepstack features (llmrun.models.mrope).

Reference: transformers/models/qwen3_moe/modeling_qwen3_moe.py. Parameter names are
the Hub's per-expert checkpoint keys (`mlp.experts.N.gate_proj`, ...), which
transformers 5 fuses into 3-D tensors when it loads them; llmrun keeps one module
per expert, so a loader can hand it any expert's weights as they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import mrope
from llmrun.models.base import (
    Frame,
    RMSNorm,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend,
    attention_mask,
    head_logits,
    key_positions,
    mix_experts,
    new_cache,
    route,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 6144  # the dense layers' (mlp_only_layers)
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_sliding_window:
            raise UnsupportedError("Qwen3-MoE with use_sliding_window=true is not supported")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but there are "
                f"{self.num_experts} experts (num_experts)"
            )
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "num_experts" not in config and "num_local_experts" in config:
            # transformers 5 writes the Hub's num_experts under its alias.
            config = {**config, "num_experts": config["num_local_experts"]}
        return args_from_config(cls, config)

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)).transpose(
            1, 2
        )
        k = self.k_norm(
            self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        ).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(self.attend(q, k, v, frame, cache))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        """The rotated queries' attention [B, T, H*D] over the cache with k/v added
        (Mellum's sliding layers keep only their window)."""
        return attend(q, k, v, self.layer, frame, cache)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) of a given width: an expert or a dense layer's
    feed-forward."""

    def __init__(self, args: ModelArgs, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, args.hidden_size, bias=False)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gated(self.act, self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router's softmax, renormalized if norm_topk_prob."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route(self.gate(x2), self.top_k, self.norm_topk_prob)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        if args.sparse(layer):
            self.mlp = SparseMoeBlock(args)
        else:
            self.mlp = MLP(args, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(nn.Module):
    """embed -> decoder layers -> norm -> lm_head, with the Hub checkpoint's module names."""

    decode_step = None  # see llmrun.models.base.run_layers

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        images: mrope.MRopeImages | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward). `images`:
        Qwen3-VL-MoE's image tokens (one row) in place of their placeholders, which with
        the text after them turn by M-RoPE (others' image tokens, as text does)."""
        sections = self.args.rope_parameters.get("mrope_section")
        shifted = sections and mrope.shifted(cache, images)
        rope = mrope.rope_positions(positions, cache, images) if shifted else None
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.model.embed_tokens(input_ids)
        if images is not None:
            x = images.place(x)
        frame = self.frame(positions, cache, x.dtype)
        if rope is None:
            return head_logits(self, x, frame, cache, last_only, last).float()
        # Qwen3VLMoeTextRotaryEmbedding interleaves the sections whatever the config says.
        return mrope.forward(self, x, frame, rope, cache, images, True, last_only, last)

    def frame(self, positions: torch.Tensor, cache: KVCache | None, dtype: torch.dtype) -> Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        mask = attention_mask(positions, key_positions(positions, length, cache))
        cos, sin = self.model.rotary_emb(positions)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        return Frame(positions, start, length, mask, cos[:, None].to(dtype), sin[:, None].to(dtype))

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.args, batch, max_seq_len, dtype, device)

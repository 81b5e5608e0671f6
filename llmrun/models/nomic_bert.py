"""Nomic BERT (NomicBertModel: nomic-embed-text v1 and v1.5, and v2-moe; llama.cpp's
"nomic-bert" and "nomic-bert-moe" GGUFs): a BERT-style encoder with rotary positions instead
of a position table: token and token-type (0) embeddings summed and normalized, then
post-norm blocks x = LN(x + attn(x)), x = LN(x + mlp(x)), the attention bidirectional over
the unpadded keys, its queries and keys turned by RoPE (half-split, over whole heads). No
final norm and no head: an embedding model (`hidden_states`).

v1 and v1.5 have a SwiGLU feed-forward and no biases but the LayerNorms'. v2-moe has biases
on the attention's and the feed-forward's projections, a plain GELU feed-forward
(gated_mlp false), and in every layer i with i % moe_every_n_layers == 1 a mixture of
experts instead: the router's softmax over all experts, the top moe_top_k of it weighing
their experts' down(gelu(up(x))) as they are (not renormalized), then one bias added to
the sum.

Module names are transformers 5's (layers.N.self_attn.q_proj, mlp.gate_proj,
post_attention_layernorm, post_mlp_layernorm) and, for the experts, llmrun's
(mlp.router, mlp.experts.N.up_proj / down_proj, mlp.bias); the Hub's original names (emb_ln,
encoder.layers.N.attn.Wqkv, mlp.fc11/fc12/fc2, norm1/norm2, mlp.experts.mlp.w1/w2) and
config fields (n_embd, rotary_emb_base, ...) are mapped at the loader edge
(llmrun/loading/nomic_bert.py).

Reference: transformers/models/nomic_bert/modeling_nomic_bert.py (v1.5); v2-moe's is the
Hub's remote code, nomic-ai/nomic-bert-2048's modeling_hf_nomic_bert.py (NomicRouter,
NomicExperts, NomicMoELayer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError
from llmrun.models.base import (
    GatedMLP,
    RotaryEmbedding,
    activation,
    mix_experts,
    rope_parameters,
    route,
)
from llmrun.models.bert import encoder_attention, key_padding_mask

# NomicBertConfig's default_theta: the RoPE base of a config that names none.
DEFAULT_ROPE_THETA = 1000.0


@dataclass
class ModelArgs:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    vocab_size: int = 30528
    head_dim: int | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # v2-moe's (set by the loader from the Hub's fields or a "nomic-bert-moe" GGUF):
    attention_bias: bool = False
    mlp_bias: bool = False
    gated_mlp: bool = True  # False: down(act(up(x))), the Hub's activation_function "gelu"
    moe_every_n_layers: int = 0  # 0: no experts
    num_experts: int = 0
    moe_top_k: int = 0

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.moe_every_n_layers and not 0 < self.moe_top_k <= self.num_experts:
            raise ModelFormatError(
                f"moe_top_k is {self.moe_top_k}, but there are {self.num_experts} experts "
                "(num_experts)"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the mixture of experts (the Hub's
        NomicBertEncoder and llama.cpp alike: layer 0 dense, 1 experts, ...)."""
        every = self.moe_every_n_layers
        return every > 0 and layer % every == 1

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        has_theta = "rope_theta" in config or "rope_theta" in (config.get("rope_parameters") or {})
        theta = {} if has_theta else {"rope_theta": DEFAULT_ROPE_THETA}
        values["rope_parameters"] = rope_parameters({**theta, **config})
        return cls(**values)


class Embeddings(nn.Module):
    """LayerNorm(word + token type 0): no position table (nomic-bert's RoPE, jina-bert-v2's
    ALiBi place the tokens in the attention)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Type 0's row by lookup: the loader may hold the table as f16 blocks.
        types = self.token_type_embeddings(torch.zeros_like(input_ids[:, :1]))
        return self.LayerNorm(self.word_embeddings(input_ids) + types)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        width, bias = self.n_heads * self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.o_proj = nn.Linear(width, args.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            # [B, T, H * D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        cos, sin = rope
        q = ops.rotary(heads(self.q_proj(x)), cos, sin)
        k = ops.rotary(heads(self.k_proj(x)), cos, sin)
        return self.o_proj(encoder_attention(q, k, heads(self.v_proj(x)), mask))


class MLP(nn.Module):
    """down(act(up(x))): v2-moe's dense feed-forward (the Hub's fc1, fc2), and each of its
    experts (bias-free)."""

    def __init__(self, args: ModelArgs, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=bias)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MoE(nn.Module):
    """sum over the top moe_top_k experts of p_e * expert_e(x), p the softmax of the
    router's logits over all experts (not renormalized over the chosen), plus one bias
    after the sum (NomicExperts')."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.moe_top_k
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(args, bias=False) for _ in range(args.num_experts))
        self.bias = nn.Parameter(torch.zeros(args.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B * T, D]
        weights, indices = route(self.router(flat), self.top_k, normalize=False)
        return (mix_experts(flat, weights, indices, self.experts) + self.bias).view_as(x)


def feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: the experts, a SwiGLU (v1, v1.5) or a plain one."""
    if args.is_moe_layer(layer):
        return MoE(args)
    return GatedMLP(args) if args.gated_mlp else MLP(args, args.mlp_bias)


class Layer(nn.Module):
    """x = LN(x + attn(x)), then LN(x + mlp(x))."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.mlp = feed_forward(args, index)
        self.post_mlp_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = self.post_attention_layernorm(x + self.self_attn(x, mask, rope))
        return self.post_mlp_layernorm(x + self.mlp(x))


class Model(nn.Module):
    """The encoder under NomicBertModel's module names (embeddings., layers.N.)."""

    generates = False  # no LM head: an embedding model (llmrun embed)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleList(Layer(args, i) for i in range(args.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 last hidden states [B, T, hidden] of input_ids [B, T] at positions
        [B, T], each row's first lengths[b] tokens real (padding after them is never
        attended to)."""
        x = self.embeddings(input_ids)
        mask = key_padding_mask(lengths, input_ids.shape[1])
        cos, sin = self.rotary_emb(positions)
        # [B, T, D] -> [B, 1, T, D], broadcast over heads
        rope = (cos[:, None].to(x.dtype), sin[:, None].to(x.dtype))
        for layer in self.layers:
            x = layer(x, mask, rope)
        return x.float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)

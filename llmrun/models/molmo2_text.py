"""Molmo 2's language model: Qwen3's (an RMSNorm on each query and key head) or OLMo's
(one RMSNorm over each whole query and key projection) attention, q/k/v biases where the
config says and none on the output, its norms before each sublayer or after it
(norm_after), an embedding longer than the output head by additional_vocab_size rows (the
image tokens'), held as the checkpoint's two tables (TwoTableEmbedding). Prompts with
images take Molmo2Model's image features added to their <im_patch> tokens' embeddings,
and every image token of the prompt (patches, column ends, starts and ends) sees every
other both ways (llmrun.molmo2_images).

Reference: transformers/models/molmo2/modeling_molmo2.py (Molmo2TextModel, Molmo2Model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    args_from_config,
    attend,
    head_logits,
)
from llmrun.models.cache import KVCache
from llmrun.models.gemma3 import ImageTokens

QK_NORMS = ("qwen3", "olmo")


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    additional_vocab_size: int = 128
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 36864
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm_type: str = "qwen3"
    norm_after: bool = False
    rope_scaling_layers: list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # The first embedding table's rows (wte.embedding's), the rest in the second; the
    # loader reads it off the checkpoint (transformers' save_pretrained cuts in halves).
    embedding_rows: int | None = None

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.qk_norm_type not in QK_NORMS:
            raise UnsupportedError(f"Molmo 2 with qk_norm_type {self.qk_norm_type!r}")
        if self.additional_vocab_size < 0:
            raise UnsupportedError(f"additional_vocab_size {self.additional_vocab_size} < 0")
        rows = self.vocab_size + self.additional_vocab_size
        if self.embedding_rows is None:
            self.embedding_rows = self.vocab_size
        if not 0 <= self.embedding_rows <= rows:
            raise UnsupportedError(
                f"embedding_rows {self.embedding_rows} outside the embedding's {rows} rows"
            )
        scaled = self.rope_scaling_layers
        every = scaled is None or set(scaled) >= set(range(self.num_hidden_layers))
        if not every and self.rope_parameters.get("rope_type", "default") != "default":
            raise UnsupportedError(
                "Molmo 2 whose scaled RoPE turns only some layers (rope_scaling_layers) is "
                "not supported"
            )

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
        self.per_head = args.qk_norm_type == "qwen3"
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        q_norm, k_norm = (self.head_dim, self.head_dim) if self.per_head else (q_width, kv_width)
        self.q_norm = RMSNorm(q_norm, args.rms_norm_eps)
        self.k_norm = RMSNorm(k_norm, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if not self.per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        # [B, T, H*D] -> [B, T, H, D]
        q = q.view(batch, tokens, self.n_heads, self.head_dim)
        k = k.view(batch, tokens, self.n_kv_heads, self.head_dim)
        if self.per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), x + mlp(norm(x)); with norm_after, x + norm(attn(x)) and
    x + norm(mlp(x)), the same norms'."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.norm_after = args.norm_after
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        if self.norm_after:
            x = x + self.input_layernorm(self.self_attn(x, frame, cache))
            return x + self.post_attention_layernorm(self.mlp(x))
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TwoTableEmbedding(nn.Module):
    """One embedding of `rows` + `new_rows` rows held as two tables, as the checkpoint
    holds them (wte.embedding and wte.new_embedding), so loading joins no copy: ids below
    `rows` read the first table, the rest the second from its row 0."""

    def __init__(self, rows: int, new_rows: int, hidden: int) -> None:
        super().__init__()
        self.rows, self.new_rows = rows, new_rows
        self.embedding = nn.Embedding(rows, hidden)
        self.new_embedding = nn.Embedding(new_rows, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.new_rows == 0:
            return self.embedding(input_ids)
        if self.rows == 0:
            return self.new_embedding(input_ids)
        # Both lookups for every id (clamped in range), then each id's own: no
        # data-dependent shapes, so no wait on an accelerator for a mask's count.
        base = self.embedding(input_ids.clamp(max=self.rows - 1))
        added = self.new_embedding((input_ids - self.rows).clamp(min=0))
        return torch.where((input_ids < self.rows)[..., None], base, added)


class BlockImageTokens(ImageTokens):
    """Molmo 2's image tokens of a forward: `embeds` [n, hidden] added to the embeddings
    of the tokens where groups >= 0 (zero rows at the markers), and all of those tokens
    one block that sees itself both ways, whichever image each belongs to (transformers'
    mm_token_type_ids mask)."""

    def place(self, x: torch.Tensor) -> torch.Tensor:
        x[0, self.groups >= 0] += self.embeds.to(x.dtype)
        return x

    def unmask(self, frames: dict[str, Frame], window: int | None) -> dict[str, Frame]:
        return ImageTokens(self.embeds, (self.groups >= 0).long() - 1).unmask(frames, window)


class Model(CausalLM):
    """Molmo 2's language model, with the *ForCausalLM's module names."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, DecoderLayer)
        rows = args.vocab_size + args.additional_vocab_size
        self.model.embed_tokens = TwoTableEmbedding(
            args.embedding_rows, rows - args.embedding_rows, args.hidden_size
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: BlockImageTokens | None = None,
    ) -> torch.Tensor:
        """CausalLM.forward; `images` (one row): image features added to their tokens'
        embeddings, the image tokens seeing each other both ways."""
        if images is None:
            return super().forward(input_ids, positions, cache, last_only, last, static)
        x = images.place(self.embed(input_ids))
        frame = images.unmask({"full_attention": self.frame(positions, cache, x.dtype, last)}, None)
        return head_logits(self, x, frame["full_attention"], cache, last_only, last).float()

"""Kosmos-2's language model (Kosmos2TextForCausalLM, the text_model of
microsoft/kosmos-2-patch14-224): pre-LayerNorm decoder layers whose attention normalizes
its heads' output before the out projection (inner_attn_ln, MAGNETO's sub-LN) and whose
feed-forward normalizes its hidden activations before fc2 (ffn_layernorm), a final
LayerNorm, biased projections and an output head tied to the embeddings by default.

The input is the token embedding (an image's 64 projected tokens in place of their
placeholders, llmrun.kosmos2_images) scaled by sqrt(hidden size) where scale_embedding says
(the image's too), plus fairseq's sinusoids of row p + pad_token_id + 1 for position p
(M2M100's table). The image's tokens are seen causally, as text is.

The checkpoints' names (text_model.model.*, text_model.lm_head) are the *ForCausalLM's
under text_model., read by llmrun.loading.vl_text; the final layer_norm is model.norm here.

Reference: transformers/models/kosmos2/modeling_kosmos2.py (Kosmos2TextTransformer,
Kosmos2TextBlock, KosmosTextAttention, Kosmos2TextFFN,
Kosmos2TextSinusoidalPositionalEmbedding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import gpt2
from llmrun.models.bart import fairseq_positions
from llmrun.models.base import CausalLM, Frame, activation, args_from_config, attend, head_logits
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    """Kosmos2TextConfig's fields under llmrun's names (llmrun.loading.vl_text maps
    embed_dim, layers and attention_heads), its defaults."""

    vocab_size: int = 65037
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    ffn_dim: int = 8192
    activation_function: str = "gelu"
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    scale_embedding: bool = True
    pad_token_id: int = 1
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"Kosmos-2 embed_dim {self.hidden_size} is not a multiple of its "
                f"{self.num_attention_heads} heads"
            )
        activation(self.activation_function)
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(nn.Module):
    """q, k, v projections, attention, inner_attn_ln over the heads' output, out_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim = args.hidden_size
        self.layer, self.heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.inner_attn_ln = nn.LayerNorm(dim, eps=args.layer_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = attend(q, k, v, self.layer, frame, cache)
        return self.out_proj(self.inner_attn_ln(out))


class FeedForward(nn.Module):
    """fc2(ffn_layernorm(act(fc1(x))))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.ffn_dim)
        self.fc2 = nn.Linear(args.ffn_dim, args.hidden_size)
        self.ffn_layernorm = nn.LayerNorm(args.ffn_dim, eps=args.layer_norm_eps)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ffn_layernorm(self.act(self.fc1(x))))


class Layer(nn.Module):
    """Kosmos2TextBlock without cross-attention: x + attn(ln(x)), x + ffn(ln(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        eps = args.layer_norm_eps
        self.self_attn = attention(args, layer)
        self.self_attn_layer_norm = nn.LayerNorm(args.hidden_size, eps=eps)
        self.ffn = mlp(args)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), frame, cache)
        return x + self.ffn(self.final_layer_norm(x))


class Body(nn.Module):
    """The token embeddings, the layers and the final LayerNorm. No RoPE: GPT-2's empty
    tables where the frame reads one."""

    rotary_emb = gpt2.Body.rotary_emb

    def __init__(self, args: ModelArgs, attention: type, mlp: type, layer: type, norm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, FeedForward, Layer, body=Body)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """CausalLM.forward; `images` (the image's projected tokens, one row) take their
        placeholders' token embeddings before the scale, as Kosmos2TextTransformer
        places image_embeds."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.model.embed_tokens(input_ids)
        if images is not None:
            x = images.place(x)
        if self.args.scale_embedding:
            x = x * self.args.hidden_size**0.5
        rows = positions + self.args.pad_token_id + 1
        x = x + fairseq_positions(rows, self.args.hidden_size).to(x.dtype)
        if static is not None:  # llmrun.static_decode's step
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        return head_logits(self, x, frame, cache, last_only, last).float()

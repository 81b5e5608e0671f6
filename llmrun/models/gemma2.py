"""Gemma 2: Gemma with four norms per layer (before and after attention and the
feed-forward), local sliding-window layers alternating with global ones, scores
scaled by query_pre_attn_scalar^-0.5, and tanh soft-capping of the attention
scores and of the final logits.

Reference: transformers/models/gemma2/modeling_gemma2.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    Frame,
    GatedMLP,
    GemmaRMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    head_logits,
    layer_frames,
    new_cache,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache

if TYPE_CHECKING:  # gemma3 builds on this module
    from llmrun.models.gemma3 import ImageTokens


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    use_bidirectional_attention: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_bidirectional_attention:
            raise UnsupportedError("Gemma 2 with use_bidirectional_attention=true is not supported")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.hidden_act = self.hidden_activation  # the name GatedMLP reads
        # transformers' default layer types: local and global layers alternate, local first.
        self.layer_types = windowed_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(
            cls, config, nullable=("final_logit_softcapping", "attn_logit_softcapping")
        )

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.layer_type = args.layer_types[layer]
        self.scale = args.query_pre_attn_scalar**-0.5
        self.softcap = args.attn_logit_softcapping
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale, self.softcap)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    attention = Attention

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = self.attention(args, layer)
        self.mlp = GatedMLP(args)
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), frames, cache)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Body(nn.Module):
    layer = DecoderLayer

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(self.layer(args, i) for i in range(args.num_hidden_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class Model(nn.Module):
    """embed * sqrt(hidden) -> decoder layers -> norm -> lm_head (-> soft-cap), with
    HF's module names."""

    decode_step = None  # see llmrun.models.base.run_layers
    body = Body

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = self.body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        images: ImageTokens | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only or `last` (as CausalLM.forward). `images` (Gemma 3's,
        PaliGemma's): the image soft tokens in place of their placeholders (one row),
        seeing each other as unmask says."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        frames = self.frames(positions, cache, x.dtype, last)
        if images is not None:
            x = images.place(x)
            frames = self.unmask(images, frames)
        logits = head_logits(self, x, frames, cache, last_only, last)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def unmask(self, images: ImageTokens, frames: dict[str, Frame]) -> dict[str, Frame]:
        """The frames with each image's tokens seeing each other, on sliding layers within
        the window (Gemma 3's, as transformers composes its masks)."""
        return images.unmask(frames, self.args.sliding_window)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, hidden] of input_ids [B, T], scaled by sqrt(hidden)
        rounded to the compute dtype, as transformers does (an image's are not scaled)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)

    def frames(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type: global layers see every earlier position, sliding
        ones the last sliding_window (in a cache that keeps only those: its plan), each
        with its own RoPE where the body has one for the sliding layers (Gemma 3's)."""
        return layer_frames(
            positions,
            cache,
            dtype,
            self.args.sliding_window,
            self.model.rotary_emb,
            getattr(self.model, "rotary_emb_local", None),
            last=last,
        )

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.args, batch, max_seq_len, dtype, device)

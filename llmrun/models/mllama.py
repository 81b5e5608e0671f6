"""Llama 3.2 Vision's (mllama's) language model: Llama 3.1 whose layers at
cross_attention_layers are cross-attention layers instead of self-attention ones. Such a
layer attends from the text to an image's states (llmrun.models.mllama_vision) through its
q/k RMS norms, and adds its attention and its MLP each weighted by tanh of a gate; a token
before the image's <|image|> still attends to every image token (its row of the processor's
cross-attention mask is empty, which transformers turns into no mask) but takes no MLP
(full_text_row_masked_out_mask); a token from <|image|> on attends to the image's real tiles.
Without an image the cross-attention layers are skipped, as transformers skips them. The
embedding has 8 rows past the vocabulary (<|image|> is the first).

The KV cache (Cache) holds the self-attention layers alone, and per sequence the image's
keys and values of every cross-attention layer, computed once by the forward that holds the
image (llmrun.mllama_images feeds the prompt up to its <|image|> in one forward) and read by
every later one. A forward from position 0 without an image drops the sequence's image, and a
cached prefix is never kept while a sequence holds one (Cache.reusable), so a later prompt
never sees a stale image.

Reference: transformers/models/mllama/modeling_mllama.py (MllamaTextModel,
MllamaCrossAttentionDecoderLayer, _prepare_cross_attention_mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import llama
from llmrun.models.base import (
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    args_from_config,
    layer_frames,
)
from llmrun.models.base import RotaryEmbedding as Rotary
from llmrun.models.cache import KVCache

EXTRA_EMBEDDINGS = 8  # rows of the embedding past the vocabulary (MllamaTextModel's)


@dataclass
class ModelArgs(llama.ModelArgs):
    # MllamaTextConfig's default (the 11B's)
    cross_attention_layers: list[int] = field(
        default_factory=lambda: [3, 8, 13, 18, 23, 28, 33, 38]
    )

    def __post_init__(self) -> None:
        # MllamaTextSelfAttention's and MllamaTextCrossAttention's heads, whatever head_dim says.
        self.head_dim = None
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        args = args_from_config(cls, config)
        layers = args.cross_attention_layers
        if any(
            not isinstance(i, int) or not 0 <= i < args.num_hidden_layers for i in layers
        ) or len(set(layers)) != len(layers):
            raise ModelFormatError(
                f"cross_attention_layers {layers} are not distinct layers of the "
                f"{args.num_hidden_layers}"
            )
        if args.sliding_window is not None:
            raise UnsupportedError("an mllama text model with a sliding window")
        return args

    @property
    def self_attention_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.cross_attention_layers]

    def layer_windows(self) -> list[int | None]:
        """One entry per KV cache layer: the self-attention layers, none windowed."""
        return [None] * len(self.self_attention_layers)


@dataclass
class CrossImage:
    """One image as the cross-attention layers take it: its states [tiles * patches,
    hidden] (every tile the tower ran, padding ones too), the prompt position of its
    <|image|> and how many of its tiles are real (the first `tiles`)."""

    states: torch.Tensor
    position: int
    tiles: int
    patches: int


@dataclass
class HeldImage:
    """A sequence's image in the cache: each cross-attention layer's keys and values
    [1, Hkv, L, D], and where and how much of it the text attends to (as CrossImage)."""

    keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]]
    position: int
    tiles: int
    patches: int


class Cache(KVCache):
    """The self-attention layers' KV cache, and each sequence's image (by allocation row)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.images: dict[int, HeldImage] = {}

    def reusable(self, n: int) -> int:
        """A prefix is kept only where no row holds an image: the tokens before it attended
        to it, and a prompt without it must not."""
        if any(row in self.images for row in self.base_rows):
            return 0
        return super().reusable(n)


class CrossAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [1, Hkv, L, D] of an image's states [L, hidden]."""
        length = states.shape[0]
        k = self.k_proj(states).view(1, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(states).view(1, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return self.k_norm(k), v

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        q = self.q_norm(q)
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=self.n_heads != k.shape[1]
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


@dataclass
class CrossFrame:
    """What the cross-attention layers need of one forward: each layer's keys and values,
    the mask [1, 1, T, L] (True: attend) and which rows take the MLP [1, T, 1]."""

    keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    rows: torch.Tensor


class CrossAttentionDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.cross_attn = CrossAttention(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = GatedMLP(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cross: CrossFrame):
        attn = self.cross_attn(self.input_layernorm(x), k, v, cross.mask)
        x = x + self.cross_attn_attn_gate.tanh() * attn
        mlp = self.mlp(self.post_attention_layernorm(x)) * cross.rows.to(x.dtype)
        return x + self.cross_attn_mlp_gate.tanh() * mlp


class Body(nn.Module):
    """MllamaTextModel's modules under its checkpoint names."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size + EXTRA_EMBEDDINGS, args.hidden_size)
        cache_index = {layer: i for i, layer in enumerate(args.self_attention_layers)}
        self.layers = nn.ModuleList(
            CrossAttentionDecoderLayer(args)
            if i in args.cross_attention_layers
            else DecoderLayer(args, cache_index[i], llama.Attention, GatedMLP)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = Rotary(args.rope_parameters, args.head_dim, args.max_position_embeddings)


class Model(nn.Module):
    decode_step = None  # no native decode step: the cross-attention layers are its own
    generates = True

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
        images: CrossImage | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T]
        ([B, 1, vocab] with last_only, or with `last` [B], each row's last real token).
        `images`: the image of this forward's one row (llmrun.mllama_images), kept in the
        cache for the forwards after it."""
        x = self.model.embed_tokens(input_ids)
        frame = layer_frames(positions, cache, x.dtype, None, self.model.rotary_emb, last=last)
        frame = frame["full_attention"]
        crosses = {
            row: self._cross_frame(positions[row], held)
            for row, held in self._held_images(positions, cache, images, x.dtype).items()
        }
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer, CrossAttentionDecoderLayer):
                x = layer(x, frame, cache)
            elif crosses:
                # Each row with an image attends to its own; the others skip the layer.
                rows = [
                    layer(x[r : r + 1], *crosses[r].keys_values[i], crosses[r])
                    if r in crosses
                    else x[r : r + 1]
                    for r in range(x.shape[0])
                ]
                x = rows[0] if len(rows) == 1 else torch.cat(rows)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()

    def _held_images(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        image: CrossImage | None,
        dtype: torch.dtype,
    ) -> dict[int, HeldImage]:
        """The image of each row (by index in this forward) that has one: `image`'s keys and
        values (of its states in the compute `dtype`), computed now and kept in the cache
        (`images`: Cache's, by allocation row; a paged view's, by row, where the server's
        scheduler gives it its sequences' images), else what the cache holds for the row. A
        row that starts at position 0 without an image is a new sequence: the image its row
        held is dropped."""
        held = getattr(cache, "images", None)
        rows = getattr(cache, "base_rows", range(positions.shape[0]))
        if image is not None:
            if positions.shape[0] != 1:
                raise ValueError("an image goes in a forward of one row")
            keys_values = {
                i: layer.cross_attn.keys_values(image.states.to(dtype))
                for i, layer in enumerate(self.model.layers)
                if isinstance(layer, CrossAttentionDecoderLayer)
            }
            new = HeldImage(keys_values, image.position, image.tiles, image.patches)
            if held is not None:
                held[rows[0]] = new
            return {0: new}
        if held is None:
            return {}
        out = {}
        for index, (row, start) in enumerate(zip(rows, positions[:, 0].tolist(), strict=True)):
            if start == 0:
                held.pop(row, None)
            elif row in held:
                out[index] = held[row]
        return out

    @staticmethod
    def _cross_frame(positions: torch.Tensor, image: HeldImage) -> CrossFrame:
        """One row's cross-attention masks at positions [T]: text from <|image|> on attends
        to the real tiles, text before it to every token (its row of the processor's mask
        is empty, which transformers turns into none) and takes no MLP."""
        length = next(iter(image.keys_values.values()))[0].shape[2]
        after = positions >= image.position
        real = torch.arange(length, device=positions.device) < image.tiles * image.patches
        mask = (real[None, :] | ~after[:, None])[None, None]
        return CrossFrame(image.keys_values, mask, after[None, :, None])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> Cache:
        args = self.args
        return Cache(
            len(args.self_attention_layers),
            batch,
            args.num_key_value_heads,
            max_seq_len,
            args.head_dim,
            dtype,
            device,
        )

"""GIT's text decoder (GitForCausalLM: microsoft/git-base, git-base-coco, git-large-coco,
git-base-textcaps, git-base-textvqa ...): BERT's post-LayerNorm layers run causally, over
an image's projected CLIP tokens (llmrun.git_images) first in the prompt, which see each
other both ways and no text (transformers' block mask over token_type_ids); an output
projection with a bias.

A text token's embedding is LayerNorm(word + learned position), its position counted
from the first text token, as generate() gives them (position_ids from the text's own
attention mask); the image's tokens take no position and no embedding norm. llmrun's
positions count the image's tokens too, so a text token's is its position less
`image_tokens`: the decoder runs only after an image.

The checkpoints' names (git.embeddings.*, git.encoder.layer.N.*, output.*) are renamed
at the loader edge (llmrun.loading.git) to model.embed_tokens, model.embed_positions,
model.embed_norm, model.layers.N.* (BERT's names within a layer) and lm_head.

Reference: transformers/models/git/modeling_git.py (GitEmbeddings, GitLayer, GitModel,
GitForCausalLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.models import gpt2
from llmrun.models.base import (
    CausalLM,
    Frame,
    activation,
    args_from_config,
    attend,
    head_logits,
    learned_positions,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    """GitConfig's text fields (its names and defaults) and the image's token count."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 1024
    layer_norm_eps: float = 1e-12
    tie_word_embeddings: bool = False
    # The image's tokens before the text: (image_size / patch_size)² + 1 (its class token),
    # from vision_config (llmrun.loading.git).
    image_tokens: int = 197
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"GIT hidden_size {self.hidden_size} is not a multiple of its "
                f"{self.num_attention_heads} heads"
            )
        activation(self.hidden_act)
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("num_image_with_embedding") is not None:
            raise UnsupportedError(
                "a GIT for video (num_image_with_embedding): llmrun takes one image a prompt"
            )
        return args_from_config(cls, config)


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)


class SelfOutput(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps)


class Attention(nn.Module):
    """BERT's attention block: LayerNorm(x + dense(attention(x)))."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.self = SelfAttention(args)
        self.output = SelfOutput(args.hidden_size, args.layer_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)

        attention = self.self
        q, k, v = heads(attention.query(x)), heads(attention.key(x)), heads(attention.value(x))
        out = attend(q, k, v, self.layer, frame, cache)
        return self.output.LayerNorm(x + self.output.dense(out))


class Intermediate(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = activation(args.hidden_act)


class Output(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.intermediate_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


class Layer(nn.Module):
    """GitLayer: the attention block, then LayerNorm(x + dense(act(dense(x))))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.attention = attention(args, layer)
        self.intermediate = Intermediate(args)
        self.output = Output(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = self.attention(x, frame, cache)
        hidden = self.intermediate.act(self.intermediate.dense(x))
        return self.output.LayerNorm(x + self.output.dense(hidden))


class Body(nn.Module):
    """The embeddings, the layers and no final norm (each layer ends in one). No RoPE:
    GPT-2's empty tables where the frame reads one."""

    rotary_emb = gpt2.Body.rotary_emb

    def __init__(self, args: ModelArgs, attention: type, mlp: type, layer: type, norm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_positions = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.embed_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = nn.Identity()


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, None, Layer, body=Body)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size)

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
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T] (the
        image's tokens counted); `images`: the image's projected tokens
        (llmrun.models.gemma3.ImageTokens, one row, from position 0), seen both ways."""
        text = positions - self.args.image_tokens
        image_rows = torch.zeros_like(positions, dtype=torch.bool)
        if images is not None:
            image_rows = images.groups[None] >= 0
        # A static step (a CUDA graph) reads nothing back; it decodes after the prompt.
        if static is None and bool(((text < 0) & ~image_rows).any()):
            raise UsageError("GIT's decoder reads an image before its text: give one (--image)")
        rows = learned_positions(text.clamp(min=0), self.args.max_position_embeddings)
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(image_rows, 0)
        body = self.model
        x = body.embed_norm(body.embed_tokens(input_ids) + body.embed_positions(rows))
        if static is not None:  # llmrun.static_decode's step
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        if images is not None:
            x = images.place(x)
            frame = images.unmask({"full_attention": frame}, None)["full_attention"]
        return head_logits(self, x, frame, cache, last_only, last).float()

"""OPT (OPTForCausalLM: facebook/opt-125m to opt-66b and their fine-tunes): learned
absolute positions read two rows past the token's position (OPT's offset), token
embeddings word_embed_proj_dim wide projected in to the hidden size (and the final
states projected back out) where the two differ, biased q, k, v, out projections and a
ReLU feed-forward fc2(act(fc1(x))) (biases unless enable_bias is false), LayerNorms with
or without weights (layer_norm_elementwise_affine), before each sublayer or, where
do_layer_norm_before is false (opt-350m), after each residual sum, without a final one.

BioGPT (BioGptForCausalLM: microsoft/biogpt, BioGPT-Large) is the pre-LN model with its
token embeddings scaled by sqrt(hidden size) (scale_embedding) and its own config names
(intermediate_size, hidden_act), read by from_config; its LayerNorms take torch's default
epsilon, as transformers' do, whatever layer_norm_eps says. XGLM
(XGLMForCausalLM: facebook/xglm-564M to 7.5B) is BioGPT's model with fairseq's sinusoidal
positions (row p + 2 of a computed table, the pad_token_id row zeroed) in place of the
learned table, under its own names (d_model, num_layers, attention_heads).

The checkpoints name the modules (model.)decoder.embed_tokens, decoder.layers.N, ...;
llmrun/loading/opt.py renames them to llmrun's: model.layers.N, and model.norm for the
final LayerNorm and project_out, which head_logits applies as the final norm (BioGPT's
and XGLM's names: llmrun/loading/fairseq_lm.py).

Reference: transformers/models/opt/modeling_opt.py, transformers/models/biogpt/
modular_biogpt.py, transformers/models/xglm/modeling_xglm.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models import gpt2
from llmrun.models.bart import fairseq_positions
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

POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding: position p reads row p + 2
# BioGptConfig's names for OPT's fields.
BIOGPT_NAMES = {"intermediate_size": "ffn_dim", "hidden_act": "activation_function"}
# XGLMConfig's.
XGLM_NAMES = {
    "d_model": "hidden_size",
    "num_layers": "num_hidden_layers",
    "attention_heads": "num_attention_heads",
}


@dataclass
class ModelArgs:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    ffn_dim: int = 3072
    vocab_size: int = 50272
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    _remove_final_layer_norm: bool = False
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    activation_function: str = "relu"
    scale_embedding: bool = False
    sinusoidal_positions: bool = False
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.word_embed_proj_dim = self.word_embed_proj_dim or self.hidden_size

    @property
    def final_norm(self) -> bool:
        """Whether a LayerNorm follows the last layer (pre-LN models only)."""
        return self.do_layer_norm_before and not self._remove_final_layer_norm

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("model_type") == "biogpt":
            config = {BIOGPT_NAMES.get(k, k): v for k, v in config.items()}
            config.setdefault("scale_embedding", True)  # BioGptConfig's default
        if config.get("model_type") == "xglm":
            config = {XGLM_NAMES.get(k, k): v for k, v in config.items()}
            # XGLMConfig's defaults where they differ from OPT's.
            config = {"scale_embedding": True, "activation_function": "gelu", **config}
            config.update(sinusoidal_positions=True)
        return args_from_config(cls, config)


def layer_norm(args: ModelArgs) -> nn.LayerNorm:
    """OPT's LayerNorm: torch's default epsilon, weights only where the config says."""
    return nn.LayerNorm(args.hidden_size, elementwise_affine=args.layer_norm_elementwise_affine)


class Attention(nn.Module):
    """q, k, v and out projections (biased unless enable_bias is false)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        hidden, bias = args.hidden_size, args.enable_bias
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        return self.out_proj(attend(q, k, v, self.layer, frame, cache))


class MLP(nn.Module):
    """fc2(act(fc1(x))), biased unless enable_bias is false."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.ffn_dim, bias=args.enable_bias)
        self.fc2 = nn.Linear(args.ffn_dim, args.hidden_size, bias=args.enable_bias)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    """Pre-LN x + attn(ln(x)), x + mlp(ln(x)); or post-LN ln(x + attn(x)), ln(x + mlp(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.pre_norm = args.do_layer_norm_before
        self.self_attn = attention(args, layer)
        self.self_attn_layer_norm = layer_norm(args)
        self.mlp = mlp(args)
        self.final_layer_norm = layer_norm(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), frame, cache)
            return x + self.mlp(self.final_layer_norm(x))
        x = self.self_attn_layer_norm(x + self.self_attn(x, frame, cache))
        return self.final_layer_norm(x + self.mlp(x))


class FinalNorm(nn.Module):
    """What follows the last layer: the final LayerNorm (pre-LN models), then project_out
    back to the embeddings' width (where it differs from the hidden size)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.final_layer_norm = layer_norm(args) if args.final_norm else None
        self.project_out = None
        if args.word_embed_proj_dim != args.hidden_size:
            self.project_out = nn.Linear(args.hidden_size, args.word_embed_proj_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)


class Body(nn.Module):
    """The token embeddings (and project_in), the position table, the layers and the
    final norm. No RoPE: GPT-2's empty tables where the frame reads one."""

    rotary_emb = gpt2.Body.rotary_emb

    def __init__(self, args: ModelArgs, attention: type, mlp: type, layer: type, norm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.word_embed_proj_dim)
        self.project_in = None
        if args.word_embed_proj_dim != args.hidden_size:
            self.project_in = nn.Linear(args.word_embed_proj_dim, args.hidden_size, bias=False)
        self.embed_positions = None
        if not args.sinusoidal_positions:
            rows = args.max_position_embeddings + POSITION_OFFSET
            self.embed_positions = nn.Embedding(rows, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = FinalNorm(args)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)
        self.lm_head = nn.Linear(args.word_embed_proj_dim, args.vocab_size, bias=False)

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
        """CausalLM.forward; `images` (BLIP-2's image tokens, one row) take their
        placeholders' token embeddings, before project_in and the positions, as OPTDecoder
        takes inputs_embeds."""
        if images is None:
            return super().forward(input_ids, positions, cache, last_only, last, static)
        # placeholder ids may lie past the vocabulary
        x = self.embed_at(input_ids.masked_fill(images.groups >= 0, 0), positions, images)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        return head_logits(self, x, frame, cache, last_only, last).float()

    def embed_at(
        self, input_ids: torch.Tensor, positions: torch.Tensor, images: Any = None
    ) -> torch.Tensor:
        """The token embeddings (scaled; `images` in their places; projected in) plus the
        embeddings of their positions, two rows on: the learned table's, or XGLM's
        sinusoids."""
        x = self.model.embed_tokens(input_ids)
        if self.args.scale_embedding:
            x = x * self.args.hidden_size**0.5
        if images is not None:
            x = images.place(x)
        if self.model.project_in is not None:
            x = self.model.project_in(x)
        rows = learned_positions(positions, self.args.max_position_embeddings)
        rows = rows + POSITION_OFFSET
        if self.model.embed_positions is not None:
            return x + self.model.embed_positions(rows)
        table = fairseq_positions(rows, self.args.hidden_size)
        if self.args.pad_token_id is not None:  # XGLM's table has zeros in that row
            table = table.masked_fill((rows == self.args.pad_token_id)[..., None], 0)
        return x + table.to(x.dtype)

"""Snowflake Arctic (snowflake-arctic-base/-instruct): Mixtral's attention and experts
with a dense residual feed-forward in parallel (parallel_attn_mlp_res): the dense one
(hidden_size wide) reads the layer's input after attention, the experts read its input
before attention, and both add to the residual.

Reference: the Hub's remote code (modeling_arctic.py, ArcticDecoderLayer) as llama.cpp's
src/models/arctic.cpp runs it, the only form llama.cpp runs: experts in every layer
(moe_layer_frequency 1) and the residual feed-forward beside them. Parameter names are
the Hub's checkpoint keys (residual_layernorm, residual_mlp.w1, block_sparse_moe, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import mixtral
from llmrun.models.base import CausalLM, Frame, RMSNorm
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(mixtral.ModelArgs):
    moe_layer_frequency: int = 2  # the remote code's default
    parallel_attn_mlp_res: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_layer_frequency != 1 or not self.parallel_attn_mlp_res:
            raise UnsupportedError(
                f"Arctic with moe_layer_frequency {self.moe_layer_frequency} and "
                f"parallel_attn_mlp_res {self.parallel_attn_mlp_res} is not supported (only "
                "experts and a residual feed-forward in every layer, as Snowflake's models and "
                "llama.cpp have them)"
            )


class DecoderLayer(nn.Module):
    """h = x + attn(input_layernorm(x)); h + residual_mlp(residual_layernorm(h)) +
    experts(post_attention_layernorm(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, moe: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.block_sparse_moe = moe(args)
        self.residual_mlp = mixtral.Expert(replace(args, intermediate_size=args.hidden_size))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.residual_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), frame, cache)
        h = h + self.residual_mlp(self.residual_layernorm(h))
        return h + self.block_sparse_moe(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, mixtral.Attention, mixtral.SparseMoeBlock, DecoderLayer)

"""Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's layers (Gated DeltaNet and gated
attention, three to one by default, a top-k softmax mixture of experts with a sigmoid-gated
shared expert) one generation earlier, with dense feed-forwards where mlp_only_layers
or decoder_sparse_step say so.

Its checkpoints fuse the linear attention's input projections per key head:
in_proj_qkvz holds, for each key head, its query, its key, and the values and gates of
the value heads it serves; in_proj_ba each key head's betas, then its decays. The loader
splits them (llmrun.loading.qwen3_next) into Qwen3.5's in_proj_qkv (every query, then
every key, then every value: the convolution's channel order), in_proj_z, in_proj_b and
in_proj_a, which this model takes.

Reference: transformers/models/qwen3_next/modeling_qwen3_next.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from llmrun.models import qwen2_moe, qwen3_5, qwen3_5_moe


@dataclass
class ModelArgs(qwen3_5_moe.ModelArgs):
    intermediate_size: int = 5120  # the dense layers' (mlp_only_layers)
    num_experts: int = 512
    num_experts_per_tok: int = 10
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    always_renormalized: ClassVar[bool] = False  # norm_topk_prob says

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class DecoderLayer(qwen3_5.DecoderLayer):
    def feed_forward(self, args: ModelArgs, layer: int, mlp: type) -> nn.Module:
        if args.sparse(layer):
            return qwen2_moe.SparseMoeBlock(args)
        return qwen2_moe.MLP(args, args.intermediate_size)


class Model(qwen3_5.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen2_moe.SparseMoeBlock, DecoderLayer)

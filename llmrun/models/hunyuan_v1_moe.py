"""Hunyuan MoE (Tencent Hunyuan-A13B; llama.cpp's "hunyuan-moe" GGUFs): Hunyuan dense's
attention (per-head query and key RMSNorms after RoPE, NTK-alpha RoPE) with a
mixture-of-experts feed-forward in every layer: a router (mlp.gate.wg, computed in f32)
whose softmax picks the top moe_topk experts, their weights renormalized to sum to 1,
plus one shared expert (mlp.shared_mlp) every token goes through.

Widths: the shared expert is intermediate_size wide, as transformers and llama.cpp
(expert_shared_feed_forward_length, the converter's intermediate_size) both build it;
the routed experts moe_intermediate_size where a config gives it (the Hub's config
lists one per layer, all equal), else intermediate_size as transformers builds them.

Reference: transformers/models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py. Parameter
names are the Hub's per-expert checkpoint keys (`mlp.experts.N.gate_proj`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import hunyuan_v1_dense
from llmrun.models.base import CausalLM, mix_experts, route
from llmrun.models.qwen3_moe import MLP

# Hub config switches whose other setting is a model llmrun does not compute
# (transformers ignores them and computes the setting on the right).
FIXED_SWITCHES = {"use_qk_norm": True, "use_mixed_mlp_moe": True, "use_cla": False}


@dataclass
class ModelArgs(hunyuan_v1_dense.ModelArgs):
    # HunYuanMoEV1Config's defaults.
    num_experts: int = 1
    moe_topk: int = 1
    moe_intermediate_size: int | None = None
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.moe_topk <= self.num_experts:
            raise ModelFormatError(
                f"moe_topk is {self.moe_topk}, but there are {self.num_experts} experts "
                "(num_experts)"
            )
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        for name, value in FIXED_SWITCHES.items():
            if config.get(name, value) != value:
                raise UnsupportedError(f"Hunyuan MoE with {name}={config[name]} is not supported")
        config = dict(config)
        for alias, name in (
            ("num_local_experts", "num_experts"),
            ("num_experts_per_tok", "moe_topk"),
        ):
            if name not in config and alias in config:
                config[name] = config[alias]
        for name in ("num_experts", "moe_topk", "moe_intermediate_size"):
            config[name] = _one_per_model(config.get(name), name)
        return super().from_config(config)


def _one_per_model(value: Any, name: str) -> Any:
    """A field the Hub's config lists per layer, as one value; refused where the layers
    differ."""
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise UnsupportedError(f"Hunyuan MoE whose {name} differs between layers is not supported")
    return value[0]


class Gate(nn.Module):
    """The router: its weight is `wg`, as the Hub names it."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.wg = nn.Linear(args.hidden_size, args.num_experts, bias=False)


class MoE(nn.Module):
    """The top-k routed experts (softmax, renormalized) plus the shared expert."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.moe_topk
        self.gate = Gate(args)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.shared_mlp = MLP(args, args.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        # transformers keeps the router in f32
        logits = F.linear(x2.float(), self.gate.wg.weight.float())
        weights, indices = route(logits, self.top_k, normalize=True)
        routed = mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)
        return routed + self.shared_mlp(x)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, hunyuan_v1_dense.Attention, MoE)

"""PLM (PLM-Team/PLM-1.8B-Base and -Instruct): DeepSeek-V2's multi-head latent attention
without a query bottleneck (q_proj; the cached latent, RoPE on adjacent pairs of the rope
parts) in every layer, and a feed-forward without a gate, down(relu(up(x))^2); the output
matrix is the token embedding.

Reference: llama.cpp's src/models/plm.cpp and conversion/plm.py (the checkpoints'
modeling code is remote code). Parameter names are DeepSeek-V2's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v2, youtu
from llmrun.models.base import CausalLM, args_from_config

SQUARED_RELU = "relu2"


@dataclass
class ModelArgs(youtu.ModelArgs):
    q_lora_rank: int | None = None
    hidden_act: str = SQUARED_RELU

    def __post_init__(self) -> None:
        if self.hidden_act != SQUARED_RELU:
            raise UnsupportedError(
                f"PLM with hidden_act {self.hidden_act!r} is not supported ({SQUARED_RELU})"
            )
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        experts = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts")
        config = {k: v for k, v in config.items() if k not in experts}
        return args_from_config(cls, config, nullable=("q_lora_rank",))


class MLP(nn.Module):
    """down(relu(up(x))^2): a squared-ReLU feed-forward without a gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, deepseek_v2.Attention, MLP)

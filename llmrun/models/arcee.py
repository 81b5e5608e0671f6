"""Arcee AFM (AFM-4.5B; llama.cpp's "arcee" GGUFs): Llama whose feed-forward has no
gate, down(relu(up(x))^2) (Nemotron's), with YaRN RoPE in the released configs.

Reference: transformers/models/arcee/modular_arcee.py (ArceeMLP is NemotronMLP, the rest
Llama's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import llama, nemotron
from llmrun.models.base import CausalLM, args_from_config


@dataclass
class ModelArgs(llama.ModelArgs):
    # ArceeConfig's defaults where they differ from Llama's.
    hidden_act: str = nemotron.RELU2
    rms_norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, llama.Attention, nemotron.MLP)

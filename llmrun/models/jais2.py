"""Jais 2 (inceptionai's Jais-2-8B, 70B; llama.cpp's "jais2" GGUFs): Llama's attention
with biases on q/k/v/o (attention_bias, default on), in pre-norm blocks whose norms are
LayerNorm with a bias, and Nemotron's feed-forward without a gate, down(relu(up(x))^2),
with biases (mlp_bias, default on).

Reference: transformers/models/jais2/modular_jais2.py (Jais2MLP is NemotronMLP, the rest
Llama's with nn.LayerNorm for the norms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from llmrun.models import llama, nemotron
from llmrun.models.base import CausalLM, DecoderLayer, args_from_config


@dataclass
class ModelArgs(llama.ModelArgs):
    # Jais2Config's defaults where they differ from Llama's.
    hidden_act: str = nemotron.RELU2
    attention_bias: bool = True
    mlp_bias: bool = True
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Layer(DecoderLayer):
    """base.DecoderLayer with LayerNorm (weight and bias) for its two norms."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        super().__init__(args, llama.Attention, nemotron.MLP, Layer, norm=norm)

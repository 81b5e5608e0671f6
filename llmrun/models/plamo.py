"""Preferred Networks' PLaMo-13B (PlamoForCausalLM): Llama's attention (NEOX-style RoPE,
n_shared_head query heads to each key/value head) and SwiGLU feed-forward side by side,
both from the one RMSNorm of each layer: x + attn(norm(x)) + mlp(norm(x)).

Reference: llama.cpp's src/models/plamo.cpp (the Hub's modeling_plamo.py is remote code).
Parameter names are the Hub's keys but for its layers' "model.layers.layers.N." here
"model.layers.N."; the Hub's query heads take their key/value head in turn (head h the
(h mod kv heads)-th), llmrun's (as llama.cpp's) in groups (llmrun/loading/plamo.py
reorders the query rows and o_proj's columns, as llama.cpp's converter does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    n_shared_head: int = 8  # query heads a key/value head serves

    def __post_init__(self) -> None:
        heads = self.num_attention_heads
        if self.n_shared_head <= 0 or heads % self.n_shared_head:
            raise ModelFormatError(
                f"PLaMo's {heads} attention heads do not share key/value heads "
                f"{self.n_shared_head} each (n_shared_head)"
            )
        # The Hub's num_key_value_heads is not the model's (llama.cpp's converter says so).
        self.num_key_value_heads = heads // self.n_shared_head
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        h = self.norm(x)
        return x + self.self_attn(h, frame, cache) + self.mlp(h)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, llama.Attention, GatedMLP, DecoderLayer)

"""openPangu-Embedded (FreedomIntelligence/openPangu-Embedded-1B-V1.1, -7B-V1.1;
PanguEmbeddedForCausalLM): Llama with biases on the queries, keys and values (where the
checkpoint has them) and always on the output projection.

Reference: llama.cpp's src/models/pangu-embed.cpp and conversion/pangu.py (the
checkpoints' modeling code is remote code). Parameter names are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from llmrun.models import llama
from llmrun.models.base import CausalLM, GatedMLP


@dataclass
class ModelArgs(llama.ModelArgs):
    attention_bias: bool = True  # the queries', keys' and values'


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=True)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)

"""GLM-4 (glm-4-9b-hf, glm-4-9b-chat-hf and their 1M-context variant; GlmForCausalLM):
GLM-4 0414's attention and fused gate_up MLP (glm4.py: q/k/v biases, RoPE on adjacent
pairs of the first half of each head) in Llama's pre-norm layers, without 0414's norms
after each sublayer.

Reference: transformers/models/glm/modeling_glm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrun.models import glm4
from llmrun.models.base import CausalLM
from llmrun.models.phi3 import MLP

HEAD_DIM = 128  # GlmConfig's default, which a config.json without head_dim takes


@dataclass
class ModelArgs(glm4.ModelArgs):
    head_dim: int | None = HEAD_DIM


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, glm4.Attention, MLP)

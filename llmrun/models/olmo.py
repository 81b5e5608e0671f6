"""OLMo (AllenAI's first OLMo: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf and 0724;
llama.cpp's "olmo" GGUFs): Llama with LayerNorms that have neither weight nor bias
(epsilon 1e-5, computed in float32), and, where clip_qkv is set, the query, key and
value projections clamped to [-clip_qkv, clip_qkv] before attention.

Reference: transformers/models/olmo/modeling_olmo.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models import llama
from llmrun.models.base import CausalLM, DecoderLayer, Frame, GatedMLP, args_from_config
from llmrun.models.cache import KVCache

NORM_EPS = 1e-5  # OlmoLayerNorm's, fixed: OlmoConfig has no field for it


@dataclass
class ModelArgs(llama.ModelArgs):
    max_position_embeddings: int = 2048
    clip_qkv: float | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class LayerNorm(nn.Module):
    """(x - mean(x)) / sqrt(var(x) + 1e-5) over the last dimension, without weight or
    bias, in float32 and cast back (transformers' OlmoLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], eps=NORM_EPS).type_as(x)


class Attention(llama.Attention):
    """Llama's attention with the projections clamped to ±clip_qkv. The clamp is
    elementwise, so clamping the split heads of q and k before they turn, and v before
    attention, is clamping the projections."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.clip = args.clip_qkv

    def clamp(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.clip is None else x.clamp(-self.clip, self.clip)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return frame.rotate(self.clamp(x))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        return super().attend(q, k, self.clamp(v), frame, cache)


class Layer(DecoderLayer):
    """The pre-norm block, with OLMo's LayerNorms."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.input_layernorm = LayerNorm()
        self.post_attention_layernorm = LayerNorm()


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, Layer, LayerNorm())

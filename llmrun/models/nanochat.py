"""nanochat (Karpathy's karpathy/nanochat-d32 and kin): Llama's attention with its RoPE
turned the other way (rotate_half's signs flipped) and a weightless RMSNorm on each
query and key head *after* RoPE, weightless RMSNorms everywhere (the same norm also
applied to the embeddings before the first layer), a gateless relu(x)^2 feed-forward
(fc1, fc2) and the logits soft-capped by tanh (final_logit_softcapping, 15).

Reference: transformers/models/nanochat/modeling_nanochat.py. llama.cpp has no
converter for it: HF folders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.models import llama
from llmrun.models.base import CausalLM, DecoderLayer, Frame, activation, args_from_config
from llmrun.models.cache import KVCache
from llmrun.models.nemotron import relu_squared


@dataclass
class ModelArgs(llama.ModelArgs):
    max_position_embeddings: int = 2048
    hidden_act: str = "relu2"
    final_logit_softcapping: float | None = 15.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # null soft-capping: none (transformers skips it then)
        return args_from_config(cls, config, nullable=("final_logit_softcapping",))


class WeightlessRMSNorm(nn.Module):
    """x / rms(x) over the last axis: no scale to learn (transformers' NanoChatRMSNorm)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.qk_norm = WeightlessRMSNorm(args.rms_norm_eps)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        # nanochat's rotate_half is cat(x2, -x1): the rotation by minus the angle, i.e.
        # the sign-folded sin negated. Its q/k norm comes after RoPE, not before.
        return self.qk_norm(ops.rotary(x, frame.cos, -frame.sin))


class MLP(nn.Module):
    """fc2(act(fc1(x))), act relu(x)^2 unless hidden_act names another: no gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = relu_squared if args.hidden_act == "relu2" else activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(DecoderLayer):
    """base.DecoderLayer with weightless norms."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.input_layernorm = WeightlessRMSNorm(args.rms_norm_eps)
        self.post_attention_layernorm = WeightlessRMSNorm(args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, Layer, norm=WeightlessRMSNorm(args.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings normalized: nanochat runs its final norm on them first too."""
        return self.model.norm(self.model.embed_tokens(input_ids))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """CausalLM's logits, soft-capped: cap * tanh(logits / cap)."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

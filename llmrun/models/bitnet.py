"""BitNet b1.58 (microsoft/bitnet-b1.58-2B-4T and its -bf16 master weights; llama.cpp's
"bitnet" GGUFs): Llama's attention and gated feed-forward with an RMSNorm before o_proj
(attn_sub_norm) and before down_proj (ffn_sub_norm), ReLU² as the gate's activation.

Where the config holds a BitNet quantization_config (transformers' BitLinear and
AutoBitLinear: the packed 2B-4T repo), each projection's input is quantized per token to
int8 first (absmax: round(x * 127 / max|x|), clamped to [-128, 127], scaled back), as
transformers computes it; q/k/v and gate/up share their input, so it is quantized once for
them. The ternary weights with their scale folded in are the loader's (loading/bitnet.py:
float, or TQ2_0 blocks), so the projections are those of any checkpoint. The -bf16
master weights carry no quantization_config, and transformers runs them as plain linear
layers: so does this model. The output head is never quantized (transformers leaves
lm_head out). Parity: transformers' logits within 1e-4, but where llmrun's ~1e-6 float
differences carry a value across an int8 rounding tie (tests/models/test_bitnet.py).

llama.cpp's graph (src/models/bitnet.cpp) quantizes no activations (its ternary dot
products quantize them to Q8_K blocks, as any quantized type's do, and llmrun's exact
kernels do not), gates with SiLU and takes the token embedding as its output head: the
GGUF loader writes that config (hidden_act "silu", tied, no quantization_config).

Reference: transformers/models/bitnet/modeling_bitnet.py, integrations/bitnet.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models import llama, nemotron
from llmrun.models.base import CausalLM, Frame, RMSNorm, activation, args_from_config
from llmrun.models.cache import KVCache

DEFAULT_ROPE_THETA = 500000.0  # BitNetConfig.default_theta, where a config gives none
QUANT_METHOD = "bitnet"
ACTIVATION_MAX = 127  # int8 absmax quantization: [-128, 127], scaled by 127 / max|x|


@dataclass
class ModelArgs(llama.ModelArgs):
    # BitNetConfig's defaults where they differ from Llama's.
    hidden_act: str = nemotron.RELU2
    rms_norm_eps: float = 1e-5
    quantization_config: dict[str, Any] | None = None

    @property
    def quantized_activations(self) -> bool:
        return (self.quantization_config or {}).get("quant_method") == QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" not in config and "rope_theta" not in rope:
            config = {**config, "rope_theta": DEFAULT_ROPE_THETA}
        return args_from_config(cls, config)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row (token) quantized to int8 by its absmax and scaled back, as
    transformers' BitLinear.activation_quant (the max clamped to at least 1e-5)."""
    scale = ACTIVATION_MAX / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-ACTIVATION_MAX - 1, ACTIVATION_MAX) / scale


def _projection_input(args: ModelArgs):
    return quantize_activations if args.quantized_activations else nn.Identity()


class Attention(llama.Attention):
    """Llama's attention, its output normed (attn_sub_norm) before o_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.attn_sub_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.quantize = _projection_input(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        x = self.quantize(x)
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = self.attend(self.rotate(q, frame), self.rotate(k, frame), v, frame, cache)
        return self.o_proj(self.quantize(self.attn_sub_norm(out)))


class MLP(nn.Module):
    """down(sub_norm(act(gate(x)) * up(x))): the gated feed-forward, normed (ffn_sub_norm)
    before down_proj; act ReLU² (BitNet's) or SiLU (llama.cpp's graph)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.ffn_sub_norm = RMSNorm(args.intermediate_size, args.rms_norm_eps)
        relu2 = args.hidden_act == nemotron.RELU2
        self.act = nemotron.relu_squared if relu2 else activation(args.hidden_act)
        self.quantize = _projection_input(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quantize(x)
        gated = ops.gated(self.act, self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.quantize(self.ffn_sub_norm(gated)))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP)

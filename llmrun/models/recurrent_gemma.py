"""Google RecurrentGemma (recurrentgemma-2b, -9b and their -it; RecurrentGemmaForCausalLM):
Griffin's residual blocks, each h = x + temporal(norm(x)), then h + mlp(norm(h)), the
temporal block by block_types taken in turn (recurrent, recurrent, attention by default).

The recurrent block: gelu(linear_y(x)) gating linear_out's input, the RG-LRU's output of
a causal depthwise convolution of linear_x(x). The RG-LRU (per head of lru_width /
num_attention_heads features, block-diagonal gates) takes in, per feature,
    a_t = exp(-8 r_t softplus(recurrent_param)),  h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t x_t
(r_t, i_t the sigmoid recurrent and input gates); at position 0 the state starts again
and the input is not scaled. Each sequence keeps the convolution's last inputs and h
(float32) in cache.recurrent (llmrun.models.recurrent).

The attention block: local attention over the last attention_window_size positions
(its keys and values kept at full length, masked to the window), RoPE on the first half
of each head (partial_rotary_factor 0.5), an o_proj bias. Gemma's RMSNorm x * (1 + w),
the embedding scaled by sqrt(hidden_size) rounded to bfloat16 (transformers' buffer),
a GeGLU of intermediate_size / 2 with biases, tied embeddings, the logits soft-capped.

Reference: transformers/models/recurrent_gemma/modeling_recurrent_gemma.py. Parameter
names are its keys. llama.cpp has no converter for it: folders only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    GemmaRMSNorm,
    Hybrid,
    RotaryEmbedding,
    activation,
    args_from_config,
    head_logits,
)
from llmrun.models.cache import KVCache
from llmrun.models.mamba import selective_scan

RECURRENT, ATTENTION = "recurrent", "attention"
PARTIAL_ROTARY_FACTOR = 0.5  # RecurrentGemmaConfig's default, where config.json has none
LOG_DECAY_SCALE = -8.0  # the RG-LRU's constant c in a = exp(c r softplus(lambda))


@dataclass
class ModelArgs:
    hidden_size: int = 2560
    num_hidden_layers: int = 26
    vocab_size: int = 256000
    intermediate_size: int = 3 * 2560  # the GeGLU is half as wide
    num_attention_heads: int = 10
    num_key_value_heads: int | None = None
    lru_width: int | None = None  # None: hidden_size
    attention_window_size: int = 2048
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    block_types: list[str] = field(default_factory=lambda: [RECURRENT, RECURRENT, ATTENTION])
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.lru_width = self.lru_width or self.hidden_size
        unknown = sorted({str(k) for k in self.block_types if k not in (RECURRENT, ATTENTION)})
        if unknown or not self.block_types:
            raise UnsupportedError(
                f"RecurrentGemma block types {unknown or '[]'} are not supported "
                f"(supported: {RECURRENT}, {ATTENTION})"
            )
        # RecurrentGemmaConfig repeats block_types over the layers.
        repeats = -(-self.num_hidden_layers // len(self.block_types))
        self.layer_types = (list(self.block_types) * repeats)[: self.num_hidden_layers]
        if self.hidden_size % self.num_attention_heads or self.lru_width % self.num_attention_heads:
            raise ModelFormatError(
                f"RecurrentGemma's hidden size {self.hidden_size} and lru_width "
                f"{self.lru_width} must split into {self.num_attention_heads} heads"
            )
        self.act = activation(self.hidden_activation)
        self.rope_parameters.setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
        rope_type = self.rope_parameters.setdefault("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedError(
                f"RecurrentGemma with RoPE type {rope_type!r} is not supported (transformers "
                "runs the default alone)"
            )
        self.rope_parameters.setdefault("rope_theta", 10000.0)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def sliding_window(self) -> int:
        """The attention's window (CausalLM.frame masks keys beyond it)."""
        return self.attention_window_size

    @property
    def attention_layers(self) -> list[int]:
        """The attention layers' indices; the KV cache holds these alone, in order."""
        return [i for i, kind in enumerate(self.layer_types) if kind == ATTENTION]

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each recurrent layer's state of one sequence: the convolution's last inputs
        [lru_width, conv1d_width - 1] and the RG-LRU's h [lru_width]."""
        shapes = [(self.lru_width, self.conv1d_width - 1), (self.lru_width,)]
        return {i: shapes for i, kind in enumerate(self.layer_types) if kind == RECURRENT}

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: kept at full length (masked to the window)."""
        return [None] * len(self.attention_layers)


class Attention(llama.Attention):
    """Llama's attention (partial RoPE from the frame, head_dim^-0.5) with an o_proj
    bias; `layer` is the model's layer index."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=True)


def starts(positions: torch.Tensor) -> torch.Tensor:
    """[B, T, 1]: where a sequence starts (position 0), the RG-LRU's state begins again
    and its input goes in unscaled."""
    return (positions == 0)[..., None]


class RGLRU(nn.Module):
    """The Real-Gated Linear Recurrent Unit over lru_width features in heads."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        heads, width = args.num_attention_heads, args.lru_width
        block = width // heads
        self.heads = heads
        self.recurrent_param = nn.Parameter(torch.empty(width))
        self.input_gate_weight = nn.Parameter(torch.empty(heads, block, block))
        self.input_gate_bias = nn.Parameter(torch.empty(heads, block))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(heads, block, block))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(heads, block))

    def gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """sigmoid(x_h W_h + b_h) for each head h: x [B, T, W] -> [B, T, W]."""
        heads = x.unflatten(-1, (self.heads, -1))  # [B, T, W] -> [B, T, H, W / H]
        return torch.sigmoid(torch.einsum("bthi,hij->bthj", heads, weight) + bias).flatten(-2)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every h_t [B, T, W] (x's dtype) of x [B, T, W] at positions [B, T] from
        `state` [B, W] (float32), and the state after each row's last real token
        (`real` [B, T]: the padding past it neither decays nor adds)."""
        input_gate = self.gate(x, self.input_gate_weight, self.input_gate_bias)
        recurrent_gate = self.gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = LOG_DECAY_SCALE * recurrent_gate * F.softplus(self.recurrent_param)
        reset = starts(positions)
        scale = torch.where(reset, 1.0, torch.sqrt(1 - torch.exp(2 * log_a)))
        inputs = (x * input_gate * scale.to(x.dtype)).float()
        decay = torch.exp(log_a).masked_fill(reset, 0.0).float()
        keep = real[..., None]
        decay, inputs = torch.where(keep, decay, 1.0), inputs * keep
        states, last = selective_scan(decay[..., None], inputs[..., None], state.float()[..., None])
        return states[..., 0].to(x.dtype), last[..., 0]


class RecurrentBlock(nn.Module):
    """linear_out(rg_lru(conv_1d(linear_x(x))) * act(linear_y(x))); `layer` is the
    model's layer index, under which cache.recurrent keeps its state."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        width = args.lru_width
        self.layer, self.act = layer, args.act
        self.linear_y = nn.Linear(args.hidden_size, width)
        self.linear_x = nn.Linear(args.hidden_size, width)
        self.linear_out = nn.Linear(width, args.hidden_size)
        self.conv_1d = nn.Conv1d(width, width, args.conv1d_width, groups=width)
        self.rg_lru = RGLRU(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        y = self.act(self.linear_y(x))
        inputs = self.linear_x(x).transpose(1, 2)  # [B, T, W] -> [B, W, T]
        kept = self.conv_1d.kernel_size[0] - 1
        if cache is None:
            past = inputs.new_zeros(batch, inputs.shape[1], kept)
            state = inputs.new_zeros(batch, inputs.shape[1], dtype=torch.float32)
            counts = torch.full((batch,), tokens, device=x.device)
        else:
            if cache.recurrent is None:
                raise RuntimeError(
                    "RecurrentGemma's recurrent layers need a cache with their state "
                    "(the model's new_cache)"
                )
            past, state = cache.recurrent.read(self.layer)
            counts = frame.counts.to(x.device)
        window = torch.cat((past.to(inputs.dtype), inputs), dim=-1)  # [B, W, kept + T]
        conv = F.conv1d(window, self.conv_1d.weight, self.conv_1d.bias, groups=window.shape[1])
        real = torch.arange(tokens, device=x.device)[None] < counts[:, None]
        h, state = self.rg_lru(conv.transpose(1, 2), frame.positions.to(x.device), real, state)
        if cache is not None:
            # Each row's last inputs: those up to its last real token, not its padding.
            starts = counts[:, None] + torch.arange(kept, device=x.device)
            new_past = window.gather(2, starts[:, None, :].expand(-1, window.shape[1], -1))
            cache.recurrent.write(self.layer, [new_past.float(), state])
        out = h * y
        if cache is not None and bool((counts < tokens).any()):
            # A padded token repeats its row's last real token, so it gets that token's
            # output, as in an attention-only model.
            last = torch.minimum(torch.arange(tokens, device=x.device)[None], counts[:, None] - 1)
            out = out.gather(1, last[..., None].expand(-1, -1, out.shape[-1]))
        return self.linear_out(out)


class MLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), intermediate_size / 2 wide, biased."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.intermediate_size // 2
        self.act = args.act
        self.gate_proj = nn.Linear(args.hidden_size, width)
        self.up_proj = nn.Linear(args.hidden_size, width)
        self.down_proj = nn.Linear(width, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """h = x + temporal_block(temporal_pre_norm(x)); h + mlp_block(channel_pre_norm(h))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        eps = args.rms_norm_eps
        self.temporal_pre_norm = GemmaRMSNorm(args.hidden_size, eps)
        if args.layer_types[layer] == ATTENTION:
            self.temporal_block = attention(args, layer)
        else:
            self.temporal_block = RecurrentBlock(args, layer)
        self.channel_pre_norm = GemmaRMSNorm(args.hidden_size, eps)
        self.mlp_block = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        h = x + self.temporal_block(self.temporal_pre_norm(x), frame, cache)
        return h + self.mlp_block(self.channel_pre_norm(h))


class Body(nn.Module):
    """The embedding, the layers, the final norm under its Hugging Face name (final_norm)
    and the RoPE tables of the attention's rotated half."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.final_norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.head_dim, 0)

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_norm


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)
        # transformers' normalizer: sqrt(hidden_size) in a bfloat16 buffer. On the CPU
        # explicitly: models are built under torch.device("meta").
        root = torch.tensor(args.hidden_size**0.5, dtype=torch.bfloat16, device="cpu")
        self.normalizer = root.item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.normalizer, dtype=x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (CausalLM.forward's), soft-capped at
        logits_soft_cap."""
        x = self.embed(input_ids)
        frame = self.frame(positions, cache, x.dtype, last)
        logits = head_logits(self, x, frame, cache, last_only, last).float()
        cap = self.args.logits_soft_cap
        return torch.tanh(logits / cap) * cap

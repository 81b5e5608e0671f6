"""NVIDIA Nemotron-H (Nemotron-H 8B/47B, Nemotron Nano 9B/12B v2) and its mixture of
experts (Nemotron 3 Nano 30B-A3B, Nemotron 3 Super): a stack of single-mixer layers,
each x + mixer(norm(x)), the mixer by the layer pattern (layers_block_type, or the older
hybrid_override_pattern string): Mamba-2 ("M"), attention without position encoding
("*"), a squared-ReLU MLP ("-") or a mixture of squared-ReLU experts ("E").

The Mamba-2 mixer is Granite 4.0-H's (granitemoehybrid.Mamba2Mixer: n_groups of B/C,
the grouped gated RMSNorm, its state in cache.recurrent). The experts are routed as
DeepSeek-V3's (deepseek_v3.Router: sigmoid scores, e_score_correction_bias for the
choice, the best two of each of n_group groups choosing topk_group groups, weights
renormalized with norm_topk_prob and times routed_scaling_factor), run in a latent
width where moe_latent_size is set (fc1_latent_proj before, fc2_latent_proj after),
and a shared expert beside them sees the layer's input.

Reference: transformers/models/nemotron_h/modeling_nemotron_h.py. Parameter names are
its keys (the Hub's checkpoints say backbone. for model. and store each expert apart;
llmrun/loading/nemotron_h.py renames and splits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v3, llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    Hybrid,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    mix_experts,
)
from llmrun.models.cache import KVCache
from llmrun.models.granitemoehybrid import Mamba2Mixer, Mamba2Shape, _float

# Layer kinds by config.json's names and the pattern's letters.
LAYER_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}
ACTIVATIONS = ("relu2",)  # llama.cpp's graph: LLM_FFN_RELU_SQR, whatever the config says
# Older (remote-code) config.json names -> NemotronHConfig's, as its __post_init__ maps them.
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_limit": "time_step_limit",
    "attention_head_dim": "head_dim",
    "num_local_experts": "n_routed_experts",
}


@dataclass
class ModelArgs:
    hidden_size: int = 4096
    vocab_size: int = 131072
    layers_block_type: list[str] = field(
        default_factory=lambda: ["mamba", "moe", "attention", "mlp"]  # transformers' default
    )
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int = 128
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False  # the Mamba-2 mixer's in_proj and out_proj
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    layer_norm_epsilon: float = 1e-5
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no RoPE

    def __post_init__(self) -> None:
        unknown = sorted({str(k) for k in self.layers_block_type if k not in LAYER_KINDS})
        if unknown:
            raise UnsupportedError(
                f"Nemotron-H layer types {unknown} are not supported "
                "(supported: mamba, attention, mlp, moe)"
            )
        self.layers_block_type = [LAYER_KINDS[k] for k in self.layers_block_type]
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.mlp_hidden_act not in ACTIVATIONS:
            raise UnsupportedError(
                f"Nemotron-H mlp_hidden_act {self.mlp_hidden_act!r} is not supported "
                "(supported: relu2)"
            )
        if self.mamba_hidden_act != "silu":
            raise UnsupportedError(
                f"Nemotron-H mamba_hidden_act {self.mamba_hidden_act!r} is not supported "
                "(supported: silu)"
            )
        if self.mamba_num_heads % self.n_groups:
            raise ModelFormatError(
                f"Nemotron-H's {self.mamba_num_heads} Mamba-2 heads do not split into "
                f"{self.n_groups} groups (n_groups)"
            )
        if "moe" in self.layers_block_type:
            self.check_routing()
        self.time_step_limit = tuple(_float(v) for v in self.time_step_limit)

    def check_routing(self) -> None:
        experts, groups = self.n_routed_experts, self.n_group
        if not 0 < self.num_experts_per_tok <= experts:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but there are "
                f"{experts} experts (n_routed_experts)"
            )
        if experts % groups or not 0 < self.topk_group <= groups:
            raise ModelFormatError(
                f"{experts} experts do not route in {groups} groups (n_group), "
                f"{self.topk_group} of them (topk_group)"
            )
        if groups > 1 and experts // groups < 2:
            raise UnsupportedError(
                "expert groups of one expert are not supported (a group scores its best two)"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = {**{new: config[old] for old, new in ALIASES.items() if old in config}, **config}
        kinds = config.get("layers_block_type") or config.get("layer_types")
        pattern = config.get("hybrid_override_pattern")
        if kinds is None and pattern is not None:
            kinds = list(pattern)
        if kinds is not None:
            # The pattern decides the layer count (NemotronHConfig ignores num_hidden_layers).
            config = {**config, "layers_block_type": kinds}
        return args_from_config(cls, config)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def attention_layers(self) -> list[int]:
        """The attention layers' indices; the KV cache holds these alone, in order."""
        return [i for i, kind in enumerate(self.layers_block_type) if kind == "attention"]

    # deepseek_v3.Router's routing settings.
    scoring_func = "sigmoid"
    group_score = "top2"

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            self.hidden_size, self.mamba_num_heads, self.mamba_head_dim, self.n_groups,
            self.ssm_state_size, self.conv_kernel, self.use_conv_bias, self.use_bias,
            self.layer_norm_epsilon, self.time_step_limit,
        )  # fmt: skip

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each Mamba-2 layer's state of one sequence (Mamba2Shape.state_shapes)."""
        shapes = self.mamba_shape().state_shapes()
        return {i: shapes for i, kind in enumerate(self.layers_block_type) if kind == "mamba"}

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: the attention layers, all full."""
        return [None] * len(self.attention_layers)


class Attention(llama.Attention):
    """Llama's attention without RoPE; `layer` is its index among the attention layers."""

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return x


class MLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): the dense layers, each expert and the shared one."""

    def __init__(self, args: ModelArgs, width: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or args.hidden_size
        self.up_proj = nn.Linear(hidden, width, bias=args.mlp_bias)
        self.down_proj = nn.Linear(width, hidden, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class MoE(nn.Module):
    """sum_k w_k expert_k(x) (in the latent width where there is one) + shared_experts(x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = deepseek_v3.Router(args)
        width = args.moe_latent_size or args.hidden_size
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size, width) for _ in range(args.n_routed_experts)
        )
        self.shared_experts = MLP(args, args.moe_shared_expert_intermediate_size)
        if args.moe_latent_size:
            bias = args.mlp_bias
            self.fc1_latent_proj = nn.Linear(args.hidden_size, width, bias=bias)
            self.fc2_latent_proj = nn.Linear(width, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [N, D]
        weights, indices = self.gate(flat)
        latent = hasattr(self, "fc1_latent_proj")
        routed = self.fc1_latent_proj(flat) if latent else flat
        routed = mix_experts(routed, weights, indices, self.experts)
        if latent:
            routed = self.fc2_latent_proj(routed)
        return routed.view_as(x) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), the mixer the layer kind's."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.kind = args.layers_block_type[layer]
        self.norm = RMSNorm(args.hidden_size, args.layer_norm_epsilon)
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(args.mamba_shape(), layer)
        elif self.kind == "attention":
            self.mixer = attention(args, args.attention_layers.index(layer))
        elif self.kind == "mlp":
            self.mixer = mlp(args, args.intermediate_size)
        else:
            self.mixer = MoE(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind in ("mamba", "attention"):
            return x + self.mixer(h, frame, cache)
        return x + self.mixer(h)


class Body(nn.Module):
    """The embedding and the final norm under their Hugging Face names (embeddings,
    norm_f), the layers, and the RoPE tables the attention does not use (CausalLM's
    frame computes them)."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm_f = norm if norm is not None else RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
            args.head_dim,
            args.max_position_embeddings,
        )

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embeddings

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.norm_f


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)

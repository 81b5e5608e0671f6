"""Ling 3 (inclusionAI's Ling-3.0-Flash and Ling-3.0-tiny; transformers' bailing_hybrid,
the Hub's BailingMoeV3ForCausalLM; llama.cpp's GGUF arch "bailingmoe3"). A hybrid of
pieces other families have:

- in each group of layer_group_size layers, the last is DeepSeek-V3's multi-head latent
  attention (RoPE on adjacent pairs of the qk_rope_head_dim part, the latent cached as
  llmrun.models.deepseek_v2 caches it), its heads' outputs each gated by sigmoid(g_proj(x))
  (one gate per head, before o_proj); the other layers are Kimi Linear's KDA
  (llmrun.models.kimi_linear: q, k, v convolutions with SiLU, L2-normalized queries and
  keys, a delta rule with a decay per key channel, an RMSNorm per head gated by a sigmoid)
  with full-rank projections for the forget gate (f_proj) and the output gate (g_proj),
  and GLM-5-Next's forget gate (kda_safe_gate: kda_lower_bound * sigmoid(exp(A_log) *
  (f_proj(x) + dt_bias)), so each step keeps at least e^kda_lower_bound of the state;
  without it Kimi's -exp(A_log) * softplus(...));
- the feed-forward is a dense SwiGLU in the first first_k_dense_replace layers, else
  DeepSeek-V3's experts: sigmoid scores, chosen by score + e_score_correction_bias among
  the topk_group best of n_group groups (a group scores its best two), the unbiased
  scores renormalized, times routed_scaling_factor, plus the shared experts; the routed
  and the shared experts' SwiGLU are clamped per layer as Step 3.7's are (swiglu_limits,
  swiglu_limits_shared: silu(gate) at most the limit, up within +-limit; 0 none), the
  dense layers' never.

transformers' rules are kept where the Hub's config.json leaves a field out: layer_types
from layer_group_size (refused where the layers do not fill whole groups, which
transformers and the Hub's code place differently), the KDA heads num_attention_heads
of head_dim features (transformers saves them as linear_num_heads and linear_head_dim,
and head_dim as the RoPE width), RoPE turning qk_rope_head_dim features whatever
partial_rotary_factor says. The KDA layers keep their state in cache.recurrent
(llmrun.models.recurrent); the KV cache holds the MLA layers' latents only. The
multi-token-prediction layers past num_hidden_layers are not run.

Parameter names are transformers' module names (self_attn, o_proj, e_score_correction_bias,
one module per expert) but for the KDA layers' three convolutions and forget gate, named
as the Hub's checkpoint names them (q_conv1d, k_conv1d, v_conv1d; f_proj, dt_bias, A_log
on the layer); the loader renames the Hub's (word_embeddings, attention, dense,
expert_bias): llmrun.loading.bailingmoe3.

Reference: transformers/models/bailing_hybrid/modeling_bailing_hybrid.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2, deepseek_v3, glm5_next, kimi_linear, step3p5
from llmrun.models.base import CausalLM, DecoderLayer, GatedMLP, Hybrid, args_from_config

MODEL_TYPES = ("bailing_hybrid", "bailing_moe_v3")
LINEAR, FULL = "linear_attention", "full_attention"
# transformers' BailingHybridConfig.attribute_map (the names it saves) and the Hub's
# config.json names -> the fields of the DeepSeek and Kimi Linear args this family takes.
_RENAMED = {
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "expert_swiglu_limit_list": "swiglu_limits",
    "share_expert_swiglu_limit_list": "swiglu_limits_shared",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}
ROPE_THETA = 6_000_000.0  # BailingHybridConfig's default


@dataclass
class ModelArgs(kimi_linear.ModelArgs):
    # BailingHybridConfig's defaults where they differ from Kimi Linear's.
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    n_routed_experts: int = 512
    routed_scaling_factor: float = 2.5
    n_group: int | None = 8
    topk_group: int | None = 4
    first_k_dense_replace: int = 2
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    layer_group_size: int = 6
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    swiglu_limits: list[float | None] | None = None
    swiglu_limits_shared: list[float | None] | None = None

    def __post_init__(self) -> None:
        layers, group = self.num_hidden_layers, self.layer_group_size
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"Ling 3 with hidden_act {self.hidden_act!r} is not supported (silu)"
            )
        if self.layer_types is None:
            if group < 1 or layers % group:
                raise UnsupportedError(
                    f"Ling 3 with {layers} layers in groups of layer_group_size {group} and "
                    "no layer_types is not supported: transformers and the Hub's code place "
                    "the attention layers of an incomplete group differently"
                )
            self.layer_types = [FULL if (i + 1) % group == 0 else LINEAR for i in range(layers)]
        for kind in self.layer_types:
            if kind not in kimi_linear.LAYER_TYPES:
                raise UnsupportedError(
                    f"Ling 3 layer type {kind!r} is not supported "
                    f"(supported: {', '.join(kimi_linear.LAYER_TYPES)})"
                )
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            limits = getattr(self, name)
            if limits is not None and len(limits) != layers:
                raise ModelFormatError(f"{name} lists {len(limits)} layers, not {layers}")
        super().__post_init__()

    @property
    def linear_lower_bound(self) -> float | None:
        """The KDA forget gate's lower bound (glm5_next.DeltaAttention's); None: Kimi's
        unbounded gate."""
        return self.kda_lower_bound if self.kda_safe_gate else None

    def limit(self, layer: int, shared: bool) -> float | None:
        """The SwiGLU clamp of `layer`'s routed experts (or, `shared`, its shared
        experts); None (no list, a 0 or null entry): no clamp."""
        limits = self.swiglu_limits_shared if shared else self.swiglu_limits
        return (limits[layer] or None) if limits else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, normalized(config), nullable=("q_lora_rank",))


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A Ling 3 config.json (the Hub's BailingMoeV3 one, or as transformers saves it) in
    the field names ModelArgs takes; refused where it asks for what transformers' model
    does not compute."""
    config = dict(config)
    gates = config.get("gated_attention_proj_granularity_type", "head_wise")
    if gates != "head_wise":
        raise UnsupportedError(
            f"Ling 3 with gated_attention_proj_granularity_type {gates!r} is not supported "
            "(head_wise: one gate per attention head)"
        )
    if config.get("no_kda_lora") is False or config.get("use_kda_lora"):
        raise UnsupportedError(
            "Ling 3 with low-rank KDA gate projections (no_kda_lora false) is not supported"
        )
    for name in ("score_function", "scoring_func"):
        if config.get(name, "sigmoid") != "sigmoid":
            raise UnsupportedError(
                f"Ling 3 with {name} {config[name]!r} is not supported (sigmoid)"
            )
    if config.get("rope_interleave") is False:
        raise UnsupportedError(
            "Ling 3 with rope_interleave false is not supported (transformers turns adjacent pairs)"
        )
    for old, new in _RENAMED.items():
        if config.get(old) is not None and config.get(new) is None:
            config[new] = config[old]
    heads = config.get("num_attention_heads")
    config.setdefault("linear_num_heads", heads)
    # The Hub's head_dim is the KDA heads' width; transformers saves that as
    # linear_head_dim, and head_dim as qk_rope_head_dim.
    if config.get("linear_head_dim") is None:
        config["linear_head_dim"] = config.get("head_dim") or 128
    width = config.get("moe_intermediate_size", 768) * (config.get("n_shared_experts") or 0)
    shared = config.get("moe_shared_expert_intermediate_size")
    if shared is not None and config.get("n_shared_experts") and shared != width:
        raise UnsupportedError(
            f"Ling 3 with moe_shared_expert_intermediate_size {shared} is not supported: "
            f"transformers' shared experts are moe_intermediate_size x n_shared_experts "
            f"({width}) wide"
        )
    layers = config["num_hidden_layers"]
    padded = layers + (config.get("num_nextn_predict_layers") or 0)
    for name in ("swiglu_limits", "swiglu_limits_shared"):
        limits = config.get(name)
        if isinstance(limits, list) and len(limits) == padded:  # MTP layers' entries at the end
            config[name] = limits[:layers]
    # RoPE turns qk_rope_head_dim features, whatever share of a head a config names.
    config.pop("partial_rotary_factor", None)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        config["rope_parameters"] = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    config.setdefault("rope_theta", ROPE_THETA)
    config["rope_interleave"] = True
    return config


class Attention(deepseek_v2.Attention):
    """DeepSeek-V3's latent attention with RoPE, each head's output times
    sigmoid(g_proj(x)) of its own (the KV cache's layer: its index among the MLA ones)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.attention_layers.index(layer))
        self.g_proj = nn.Linear(args.hidden_size, args.num_attention_heads, bias=False)

    def gated_output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = out.shape
        gate = torch.sigmoid(self.g_proj(x).float()).to(out.dtype)[..., None]  # [B, T, H, 1]
        # [B, T, H*v] -> [B, T, H, v], each head times its gate
        return (out.view(batch, tokens, self.n_heads, -1) * gate).flatten(2)


class DeltaAttention(glm5_next.DeltaAttention):
    """KDA whose forget and output gates each come from one full-rank projection."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        del self.f_a_proj, self.f_b_proj, self.g_a_proj, self.g_b_proj
        self.f_proj = nn.Linear(args.hidden_size, self.width, bias=False)
        self.g_proj = nn.Linear(args.hidden_size, self.width, bias=False)

    def forget_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.f_proj(x)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x)


class MoE(deepseek_v3.MoE):
    """DeepSeek-V3's routed and shared experts, each SwiGLU clamped by the layer's limit."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args)
        limit, width = args.limit(layer, shared=False), args.moe_intermediate_size
        self.experts = nn.ModuleList(
            step3p5.MLP(args, width, limit) for _ in range(args.n_routed_experts)
        )
        shared = args.n_shared_experts
        self.shared_experts = (
            step3p5.MLP(args, width * shared, args.limit(layer, shared=True)) if shared else None
        )


class Layer(DecoderLayer):
    """A pre-norm block: KDA or latent attention, then a dense or experts feed-forward."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        experts = lambda a: MoE(a, layer)  # noqa: E731 (the layer's own limits)
        super().__init__(args, layer, attention, experts if args.sparse(layer) else mlp)


def mixer(args: ModelArgs, layer: int) -> nn.Module:
    """A layer's token mixer: KDA, or latent attention."""
    if args.layer_types[layer] == LINEAR:
        return DeltaAttention(args, layer)
    return Attention(args, layer)


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, mixer, GatedMLP, Layer)

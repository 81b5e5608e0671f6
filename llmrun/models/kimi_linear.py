"""Kimi Linear (Moonshot's Kimi-Linear-48B-A3B): a hybrid of Kimi Delta Attention (KDA)
and multi-head latent attention, with DeepSeek-V3's mixture of experts.

KDA, most layers (layer_types "linear_attention"): q, k and v each go through their own
projection and a causal depthwise convolution of linear_conv_kernel_dim taps with SiLU;
queries and keys are L2-normalized (queries then scaled by head_dim^-0.5). The state, a
[head_dim, head_dim] matrix per head, follows a gated delta rule whose decay is per key
channel rather than one scalar per head: S <- diag(exp(g)) S, then S += k (beta (v -
S^T k))^T, output S^T q. The log decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)
(a low-rank projection, A_log one per head), beta = sigmoid(b_proj(x)) per head. The
output goes through an RMSNorm per head gated by sigmoid(g_b(g_a(x))), then o_proj.

The other layers are DeepSeek-V3's MLA without RoPE (the reference applies none; the
qk_rope_head_dim part of each key is still one vector shared by every head), caching the
latent as llmrun.models.deepseek_v2 does. The feed-forward is dense where mlp_layer_types
says "dense" (the first first_k_dense_replace layers), else DeepSeek-V3's sigmoid-routed
experts with a selection bias and shared experts.

Reference: transformers/models/kimi_linear/modeling_kimi_linear.py. Parameter names are
the Hub checkpoint's (self_attn.q_conv1d, self_attn.f_a_proj, ...) but for the experts,
named as DeepSeek's (the loader renames block_sparse_moe.experts.N.w1/w3/w2). The KDA
layers keep their state in cache.recurrent (llmrun.models.recurrent); the KV cache holds
the MLA layers' latents only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2, deepseek_v3
from llmrun.models.base import CausalLM, Frame, GatedMLP, Hybrid, args_from_config
from llmrun.models.cache import KVCache

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
CHUNK = 32  # tokens the chunked delta rule takes at once (its pairwise decays: L x L x dim)
L2_EPS = 1e-6  # the reference's l2norm, as the FLA kernels compute it
# Moonshot's config.json names -> transformers' (KimiLinearConfig.attribute_map) ->
# DeepSeek's, which the experts' args take.
_RENAMED = {
    "num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "model_max_length": "max_position_embeddings",
}
# linear_attn_config's keys (Moonshot's config.json) -> the flat fields.
_LINEAR_KEYS = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    # KimiLinearConfig's defaults where they differ from DeepSeek-V3's.
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.446
    q_lora_rank: int | None = None
    n_group: int | None = 1
    topk_group: int | None = 1
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every fourth from layer 4
            self.layer_types = [
                "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)
            ]
        if self.mlp_layer_types is None:
            dense = self.first_k_dense_replace
            self.mlp_layer_types = ["dense" if i < dense else "sparse" for i in range(layers)]
        for name, kinds, known in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES),
        ):
            if len(kinds) != layers:
                raise ModelFormatError(
                    f"{name} lists {len(kinds)} layers, but num_hidden_layers is {layers}"
                )
            for kind in kinds:
                if kind not in known:
                    raise UnsupportedError(
                        f"Kimi Linear {name} entry {kind!r} is not supported "
                        f"(supported: {', '.join(known)})"
                    )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, normalized(config), nullable=("q_lora_rank",))

    def sparse(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @property
    def attention_layers(self) -> list[int]:
        """The MLA layers, in order: the KV cache's layers."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    def layer_windows(self) -> list[int | None]:
        """The KV cache's layers' windows: none, one per MLA layer."""
        return [None] * len(self.attention_layers)

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each KDA layer's state per sequence: the convolutions' last inputs [q, k and
        v channels, kernel - 1] and the delta rule's [heads, head_dim, head_dim]."""
        width = self.linear_num_heads * self.linear_head_dim
        dim = self.linear_head_dim
        return {
            i: [(3 * width, self.linear_conv_kernel_dim - 1), (self.linear_num_heads, dim, dim)]
            for i, kind in enumerate(self.layer_types)
            if kind == "linear_attention"
        }


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A Kimi Linear config.json (Moonshot's, with linear_attn_config and 1-based layer
    lists, or transformers') in the field names ModelArgs takes."""
    # NoPE: RoPE settings (YaRN's mscale on the softmax among them) do not apply.
    config = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
    if config.get("mla_use_nope") is False:
        raise UnsupportedError(
            "Kimi Linear with mla_use_nope false (MLA with RoPE) is not supported"
        )
    router = config.get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise UnsupportedError(
            f"Kimi Linear moe_router_activation_func {router!r} is not supported (sigmoid)"
        )
    for old, new in _RENAMED.items():
        if old in config and new not in config:
            config[new] = config[old]
    linear = config.get("linear_attn_config") or {}
    for old, new in _LINEAR_KEYS.items():
        if old in linear:
            config[new] = linear[old]
    if config.get("layer_types") is None and "full_attn_layers" in linear:
        full = set(linear["full_attn_layers"])  # 1-based
        config["layer_types"] = [
            "full_attention" if i + 1 in full else "linear_attention"
            for i in range(config["num_hidden_layers"])
        ]
    config.setdefault("first_k_dense_replace", 1)  # KimiLinearConfig's default
    return config


class LatentAttention(deepseek_v2.Attention):
    """DeepSeek's MLA over the latent cache, without RoPE: the rope parts of the queries
    and the shared key are taken as they are (NoPE)."""

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return x


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * sigmoid(gate), in float32 (the reference's
    KimiLinearRMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)


class DeltaAttention(nn.Module):
    """A KDA layer (see the module docstring), its state carried in cache.recurrent."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.dim = args.linear_num_heads, args.linear_head_dim
        self.kernel = args.linear_conv_kernel_dim
        width, hidden = self.heads * self.dim, args.hidden_size
        self.width = width
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        # Depthwise, weights [width, 1, kernel]: applied together in forward.
        self.q_conv1d = nn.Conv1d(width, width, self.kernel, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, self.kernel, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, self.kernel, groups=width, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.dim, bias=False)
        self.f_b_proj = nn.Linear(self.dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))  # the Hub's shape
        self.b_proj = nn.Linear(hidden, self.heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.dim, bias=False)
        self.g_b_proj = nn.Linear(self.dim, width, bias=False)
        self.o_norm = GatedRMSNorm(self.dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, 3 * width] -> [B, 3 * width, T]: the convolutions' channels q, k, v
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1).transpose(1, 2)
        if cache is None:
            conv_state = mixed.new_zeros(batch, mixed.shape[1], self.kernel - 1)
            state, counts = None, torch.full((batch,), tokens, device=x.device)
        else:
            conv_state, state = cache.recurrent.read(self.layer)
            counts = frame.counts
        weight = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))
        conv, kept = causal_convolution(mixed, conv_state.to(mixed.dtype), weight, counts)
        # [B, 3 * width, T] -> three [B, heads, T, dim] in float32
        q, k, v = (
            part.reshape(batch, tokens, self.heads, self.dim).transpose(1, 2).float()
            for part in F.silu(conv).transpose(1, 2).split(self.width, dim=-1)
        )
        q = l2_normalize(q) * self.dim**-0.5
        k = l2_normalize(k)
        real = (torch.arange(tokens, device=x.device) < counts[:, None])[..., None]  # [B, T, 1]
        # Padding (rows padded on the right) leaves the state as it is: no decay, no write.
        beta = torch.sigmoid(self.b_proj(x).float()) * real  # [B, T, heads]
        decay = self.log_decay(x) * real[..., None]  # [B, T, heads, dim]
        if state is None:
            state = v.new_zeros(batch, self.heads, self.dim, self.dim)
        rule = recurrent_kda if tokens == 1 else chunked_kda
        out, state = rule(q, k, v, decay.transpose(1, 2), beta.transpose(1, 2), state.float())
        if cache is not None:
            cache.recurrent.write(self.layer, [kept, state])
        gate = self.output_gate(x).view(batch, tokens, self.heads, self.dim)
        out = self.o_norm(out.transpose(1, 2).to(x.dtype), gate)  # [B, T, heads, dim]
        return self.o_proj(out.reshape(batch, tokens, self.width))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output norm's gate logits [B, T, width] of x: g_b(g_a(x)), here; a family
        with one full-rank projection (Ling 3) says so."""
        return self.g_b_proj(self.g_a_proj(x))

    def forget_input(self, x: torch.Tensor) -> torch.Tensor:
        """The forget gate's input [B, T, width] of x, before dt_bias: f_b(f_a(x)), here;
        a family with one full-rank projection (Ling 3) says so."""
        return self.f_b_proj(self.f_a_proj(x))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """The forget gate's log decay [B, T, heads, dim] of x [B, T, hidden]:
        -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)."""
        batch, tokens, _ = x.shape
        gate = self.forget_input(x).float() + self.dt_bias.float()
        return -self.A_log.float().exp() * F.softplus(gate.view(batch, tokens, self.heads, -1))


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def causal_convolution(
    inputs: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution of inputs [B, C, T] continuing from `state`, the
    last kernel - 1 inputs before them [B, C, K - 1], with `weight` [C, 1, K] (no
    activation). Returns the outputs [B, C, T] and each row's new state: its last K - 1
    inputs up to its `counts` [B] real tokens."""
    taps = weight.shape[-1] - 1
    joined = torch.cat((state, inputs), dim=-1)  # [B, C, K - 1 + T]
    if inputs.shape[-1] == 1:  # one output per channel: a dot product with its taps
        out = (joined * weight[:, 0]).sum(dim=-1, keepdim=True)
    else:
        out = F.conv1d(joined, weight, groups=joined.shape[1])
    ends = counts[:, None] + torch.arange(taps, device=inputs.device)  # [B, K - 1]
    kept = joined.gather(2, ends[:, None].expand(-1, joined.shape[1], -1))
    return out, kept


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's delta rule one token at a time: q, k [B, H, T, Dk], v [B, H, T, Dv], log
    decay [B, H, T, Dk] (per key channel), beta [B, H, T], state [B, H, Dk, Dv]. Returns
    the outputs [B, H, T, Dv] and the state after the last token."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * decay[:, :, t, :, None].exp()
        k_t = k[:, :, t, None]  # [B, H, 1, Dk]
        # What the state recalls for k_t, corrected toward v_t by beta.
        error = (v[:, :, t, None] - k_t @ state) * beta[:, :, t, None, None]  # [B, H, 1, Dv]
        state = state + k_t.transpose(-1, -2) @ error
        outputs.append(q[:, :, t, None] @ state)
    return torch.cat(outputs, dim=2), state


def chunked_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_kda's outputs and final state, computed `chunk` tokens at a time.

    Within a chunk starting from state S, with G_i the summed log decays of its tokens up
    to i (a vector over key channels) and D_ij = diag(exp(G_i - G_j)) for j <= i, the
    state's corrections u_i = beta_i (v_i - (exp(G_i) * k_i)^T S - sum_{j<i} (k_i^T D_ij
    k_j) u_j) form a unit lower-triangular system, solved once per chunk; each output is
    (exp(G_i) * q_i)^T S + sum_{j<=i} (q_i^T D_ij k_j) u_j, and the chunk ends at
    diag(exp(G_L)) S + sum_j (exp(G_L - G_j) * k_j) u_j^T. The pairwise decays are
    formed per channel (exp of differences that are never positive), not factored as
    exp(G_i) exp(-G_j), which overflows when a chunk decays far. Tokens past the end are
    padded with beta = 0 and no decay, which leave the state alone."""
    tokens, size = q.shape[2], min(chunk, q.shape[2])
    pad = -tokens % size
    q, k, v, decay = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, decay))
    beta = F.pad(beta, (0, pad))
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    outputs = []
    for start in range(0, tokens + pad, size):
        span = slice(start, start + size)
        q_c, k_c, v_c, beta_c = q[:, :, span], k[:, :, span], v[:, :, span], beta[:, :, span]
        summed = decay[:, :, span].cumsum(dim=2)  # G [B, H, L, Dk]
        # [B, H, L, L, Dk]: exp(G_i - G_j) for j <= i, 0 above the diagonal
        gaps = summed[:, :, :, None] - summed[:, :, None]
        decays = gaps.masked_fill(~causal[..., None], float("-inf")).exp()
        decayed_keys = decays * k_c[:, :, None]  # [i, j]: D_ij k_j
        # [B, H, L, 1, Dk] @ [B, H, L, Dk, L] -> [B, H, L, L]: x_i^T D_ij k_j
        keys = (k_c[:, :, :, None] @ decayed_keys.transpose(-1, -2))[:, :, :, 0]
        scores = (q_c[:, :, :, None] @ decayed_keys.transpose(-1, -2))[:, :, :, 0]
        system = (keys * beta_c[..., None]).tril(-1) + torch.eye(size, device=q.device)
        rise = summed.exp()
        targets = (v_c - (k_c * rise) @ state) * beta_c[..., None]
        u = torch.linalg.solve_triangular(system, targets, upper=False, unitriangular=True)
        outputs.append((q_c * rise) @ state + scores @ u)
        to_end = (summed[:, :, -1:] - summed).exp()
        state = state * rise[:, :, -1, :, None] + (k_c * to_end).transpose(-1, -2) @ u
    return torch.cat(outputs, dim=2)[:, :, :tokens], state


def mixer(args: ModelArgs, layer: int) -> nn.Module:
    """A layer's token mixer: KDA, or MLA (its KV cache layer: its index among them)."""
    if args.layer_types[layer] == "linear_attention":
        return DeltaAttention(args, layer)
    return LatentAttention(args, args.attention_layers.index(layer))


class Model(Hybrid, deepseek_v3.Model):
    def __init__(self, args: ModelArgs) -> None:
        CausalLM.__init__(self, args, mixer, GatedMLP, self.layer)

"""DeepSeek-V2 (V2, V2-Lite, V2.5): multi-head latent attention (MLA) and DeepSeekMoE.

MLA: queries come from the hidden state directly (q_proj) or through a low-rank
bottleneck (q_a_proj -> q_a_layernorm -> q_b_proj). Keys and values come from one
compressed latent per token (kv_a_proj_with_mqa -> kv_a_layernorm), expanded per head
by kv_b_proj into a key part without position (qk_nope_head_dim) and the value
(v_head_dim); the rest of each key (qk_rope_head_dim) is one RoPE'd vector shared by
all heads, from kv_a_proj_with_mqa too. RoPE turns adjacent pairs of the rope part
(V3 may say otherwise: rope_interleave). With YaRN, mscale_all_dim scales the softmax.

The KV cache holds the latent, as llama.cpp's MLA graph does (src/models/deepseek2.cpp,
"absorbed" MLA): per token and layer one KV head [kv_a_layernorm(latent); rotated k_rope]
of kv_lora_rank + qk_rope_head_dim features (576 for V2-Lite, V3 and GLM-4.7-Flash),
where every head's key and value took heads x 2 x 192 (V2-Lite: 16 heads). A query is
taken into the latent space through kv_b_proj's key rows, [W_uk^T q_nope; q_rope], so its
dot product with a cached latent key is the decompressed key's; the same key serves as
the value (its first kv_lora_rank features are the latent), and each head's output is
expanded to v_head_dim by kv_b_proj's value rows. Every query head attends to the one KV
head (MQA, any cache type and the paged cache alike), and the softmax scale stays
qk_head_dim's. The cache keeps the latent once, its values the keys' buffer
(cache_values_are_keys): 576 features per token and layer, as llama.cpp keeps.

DeepSeekMoE: the first first_k_dense_replace layers are dense; the others route each
token to num_experts_per_tok of n_routed_experts small experts (softmax scores, the top
experts overall, "greedy", or among the topk_group best of n_group groups,
"group_limited_greedy") and add n_shared_experts always-on experts. The routed weights
are scaled by routed_scaling_factor, and renormalized first with norm_topk_prob (as V3
and llama.cpp do; transformers' V2 ignores the flag, which released V2 models leave
false).

Reference: transformers/models/deepseek_v2/modeling_deepseek_v2.py. Parameter names are
the Hub's checkpoint keys (one module per expert, `mlp.experts.N.gate_proj`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    CausalLM,
    DecoderLayer,
    Frame,
    GatedMLP,
    RMSNorm,
    args_from_config,
    attend_scaled,
    mix_experts,
    query_temperature,
    rotate_pairs,
    route_grouped,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP

# The routings of each family (config.json's topk_method and scoring_func).
TOPK_METHODS = ("greedy", "group_limited_greedy")
SCORING = "softmax"
# The norms inside attention: transformers builds them with its RMSNorm's default eps.
LATENT_NORM_EPS = 1e-6
# A rope_parameters key of llmrun's (from a GGUF's attention.temperature_length): the
# positions a step of the query temperature counts, where it is not YaRN's original context.
TEMPERATURE_LENGTH = "llama_4_scaling_length"


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_experts_per_tok: int
    intermediate_size: int = 11008  # the dense layers'
    moe_intermediate_size: int = 1407
    n_routed_experts: int = 64
    n_shared_experts: int | None = 2
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "greedy"
    scoring_func: str = SCORING
    n_group: int | None = None
    topk_group: int | None = None
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    # Not a config.json field: llama.cpp normalizes the latents with rms_norm_eps, so a
    # GGUF's config sets it to that.
    latent_norm_eps: float = LATENT_NORM_EPS
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mlp_bias:
            raise UnsupportedError("DeepSeek with mlp_bias=true is not supported")
        if self.moe_layer_freq != 1:
            raise UnsupportedError(
                f"DeepSeek with moe_layer_freq {self.moe_layer_freq} is not supported (only 1)"
            )
        if "partial_rotary_factor" in self.rope_parameters:
            raise UnsupportedError("DeepSeek with partial_rotary_factor is not supported")
        if self.first_k_dense_replace >= self.num_hidden_layers:
            return  # every layer dense (Youtu-LLM): nothing is routed
        self.check_routing()
        experts, groups = self.n_routed_experts, self.n_group or 1
        if experts % groups:
            raise ModelFormatError(f"{experts} experts do not split into n_group {groups} groups")
        if not 0 < (self.topk_group or 1) <= groups:
            raise ModelFormatError(f"topk_group is {self.topk_group}, but n_group is {groups}")
        reachable = experts // groups * (self.topk_group or 1) if self.grouped else experts
        if not 0 < self.num_experts_per_tok <= reachable:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but a token can reach "
                f"{reachable} of the {experts} experts (n_routed_experts, n_group, topk_group)"
            )

    def check_routing(self) -> None:
        """Refuse a routing this family does not compute."""
        if self.topk_method not in TOPK_METHODS:
            raise UnsupportedError(
                f"DeepSeek-V2 topk_method {self.topk_method!r} is not supported "
                f"(supported: {', '.join(TOPK_METHODS)})"
            )
        if self.scoring_func != SCORING:
            raise UnsupportedError(
                f"DeepSeek-V2 scoring_func {self.scoring_func!r} is not supported ({SCORING})"
            )

    @property
    def grouped(self) -> bool:
        """Whether experts are chosen among the best groups only."""
        return self.topk_method != "greedy" and (self.n_group or 1) > 1

    @property
    def group_score(self) -> str:
        return "max"  # group_limited_greedy: a group's best expert

    @property
    def num_key_value_heads(self) -> int:
        """One KV head, the latent, which every query head attends to."""
        return 1

    @property
    def head_dim(self) -> int:
        """The features RoPE turns (transformers' head_dim)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The width of the cached key (and value): the normalized latent and the rotated
        rope part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_values_are_keys(self) -> bool:
        """The cached latent is the key and the value alike: stored once."""
        return True

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
        scale = self.qk_head_dim**-0.5
        params = self.rope_parameters
        mscale_all_dim = params.get("mscale_all_dim")
        if params["rope_type"] != "default" and mscale_all_dim:
            # As RotaryEmbedding reads YaRN's factor (the context ratio where none is given).
            original = params.get("original_max_position_embeddings")
            factor = params.get("factor") or self.max_position_embeddings / original
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def temperature(self) -> tuple[float, int]:
        """Llama 4's query temperature (Mistral 4, Mistral Large 3): beta (0: none) and
        the positions its steps count, the YaRN original context where no length of its
        own is given (a GGUF's attention.temperature_length)."""
        params = self.rope_parameters
        beta = params.get("llama_4_scaling_beta") or 0.0
        length = params.get(TEMPERATURE_LENGTH) or params.get("original_max_position_embeddings")
        return beta, length or self.max_position_embeddings

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "n_routed_experts" not in config and "num_experts" in config:
            config = {**config, "n_routed_experts": config["num_experts"]}
        return args_from_config(cls, config, nullable=("q_lora_rank", "n_shared_experts"))


class Attention(nn.Module):
    """Multi-head latent attention over a cache of latents: the queries are absorbed into
    the latent space, and the outputs expanded from it, through kv_b_proj's weight."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads = layer, args.num_attention_heads
        self.nope, self.rope, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.kv_lora_rank = args.kv_lora_rank
        self.interleaved = args.rope_interleave
        self.scale = args.softmax_scale
        self.temperature = args.temperature
        heads, qk, bias = self.n_heads, args.qk_head_dim, args.attention_bias
        self.q_lora_rank = args.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(args.hidden_size, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, args.latent_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            args.hidden_size, args.kv_lora_rank + self.rope, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.latent_norm_eps)
        # Never called: its weight's key and value rows absorb the queries and expand the
        # outputs (the loader gives it floats, dequantizing a GGUF's blocks and keeping a
        # half-precision folder's weight out of blocks: read_as_floats).
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.kv_b_proj.read_as_floats = True
        self.o_proj = nn.Linear(heads * self.v_dim, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        heads, rank = self.n_heads, self.kv_lora_rank
        # The queries' normalized low-rank latent, where they have one (DSA's indexer reads it)
        q_resid = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
        # [B, T, H*(nope+rope)] -> [B, H, T, nope+rope]
        q = q.view(batch, tokens, heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, self.rope], dim=-1)
        k_rope = self.rope_key(k_rope)
        # [H*(nope+v), rank] -> [H, nope+v, rank]: each head's key rows, then value rows
        w_k, w_v = self.kv_b_proj.weight.view(heads, -1, rank).split([self.nope, self.v_dim], 1)
        # q_nope . (W_k latent) == (W_k^T q_nope) . latent: [B, H, T, nope] -> [B, H, T, rank]
        q_latent = q_nope @ w_k
        # [B, T, rope] -> [B, 1, T, rope]: one rotated key part shared by every head
        q_rope, k_rope = self.rotate(q_rope, frame), self.rotate(k_rope[:, None], frame)
        q = torch.cat((q_latent, q_rope), dim=-1)
        beta, length = self.temperature
        if beta:
            q = q * query_temperature(frame.positions, beta, length).to(q.dtype)
        # [B, T, rank] -> [B, 1, T, rank + rope]: the one KV head, key and value alike
        k = torch.cat((self.kv_a_layernorm(latent)[:, None], k_rope), dim=-1)
        out = self.attend(q, k, frame, cache, x, q_resid)
        # [B, T, H*(rank+rope+...)] -> [B, H, T, rank]: the value is the latent part
        out = out.view(batch, tokens, heads, -1)[..., :rank].transpose(1, 2)
        # each head's output through its value rows: [B, H, T, rank] -> [B, T, H*v]
        out = (out @ w_v.transpose(1, 2)).transpose(1, 2)
        return self.o_proj(self.gated_output(out.reshape(batch, tokens, heads * self.v_dim), x))

    def gated_output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, T, H*v] as o_proj takes them: as they are, here; a
        family that gates them by the layer's input x (Hunyuan V4) says how."""
        return out

    def rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        """The keys' shared rope part [B, T, rope] before RoPE: as it is, here; a family
        that normalizes it first (Dots 3 Note) says how."""
        return k_rope

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        frame: Frame,
        cache: KVCache | None,
        x: torch.Tensor,
        q_resid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every query head q [B, H, T, rank + rope] over the one latent head k [B, 1, T,
        rank + rope], its values too: [B, T, H*(rank + rope)]. `x` (the layer's input) and
        `q_resid` (the queries' latent) are for a family that chooses the keys first
        (DeepSeek-V3.2's indexer)."""
        return attend_scaled(q, k, k, self.layer, frame, cache, self.scale)

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        """RoPE on the rope parts [B, H, T, rope]: adjacent pairs, or with
        rope_interleave false, x[i] with x[i + rope / 2]."""
        return rotate_pairs(x, frame) if self.interleaved else frame.rotate(x)


class Router(nn.Module):
    """The experts of each token and their weights, from logits computed in f32 (as
    transformers keeps the router in f32)."""

    masked = float("-inf")  # the choice score of an expert outside the kept groups

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        a = self.args
        logits = F.linear(x.float(), self.weight.float())
        weights, indices = route_grouped(
            logits,
            a.num_experts_per_tok,
            scoring=a.scoring_func,
            bias=self.selection_bias(),
            n_group=a.n_group if a.grouped else 1,
            topk_group=a.topk_group or 1,
            group_score=a.group_score,
            normalize=a.norm_topk_prob,
            scale=a.routed_scaling_factor,
            masked=self.masked,
        )
        return weights.to(x.dtype), indices

    def selection_bias(self) -> torch.Tensor | None:
        """What is added to the scores to choose experts (DeepSeek-V3's correction)."""
        return None


class MoE(nn.Module):
    """Routed experts plus the shared experts every token goes through."""

    router = Router

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = self.router(args)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.n_routed_experts)
        )
        shared = args.n_shared_experts
        self.shared_experts = MLP(args, args.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.gate(x2)
        out = mix_experts(x2, weights, indices, self.experts).view(x.shape)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Layer(DecoderLayer):
    """A pre-norm block whose feed-forward is dense in the first layers, else experts."""

    moe = MoE

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, self.moe if args.sparse(layer) else mlp)


class Model(CausalLM):
    attention = Attention
    layer = Layer

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, self.attention, GatedMLP, self.layer)

"""A.X K2 (SK Telecom's skt/A.X-K2 and A.X-K2-Light, AXK2ForCausalLM): DeepSeek-V3.2's
model (multi-head latent attention over the keys a lightning indexer chooses, sigmoid
experts with a shared one; deepseek_v32.py) with three changes:

- the queries and a per-head output gate come from one projection (the Hub's q_b_proj)
  of the queries' latent, normalized and as it is, side by side: the heads' outputs are
  multiplied by the gate's sigmoid before o_proj;
- the norm before attention, and the norm before each expert layer's feed-forward, is
  gated: RMSNorm's output y times sigmoid(W_up silu(W_down y)), a low rank of
  gated_norm_rank;
- experts are chosen among groups only where n_group is set (A.X-K2-Light has none),
  those outside the kept groups scoring 0 (not minus infinity) in the choice.
The dense layers are those mlp_layer_types names, or the first first_k_dense_replace
(default 1).

Reference: transformers/models/axk2/modular_axk2.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models import axk1, deepseek_v3, deepseek_v32
from llmrun.models.base import Frame, RMSNorm, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(deepseek_v32.ModelArgs):
    # AXK2Config's defaults where they differ from DeepSeek-V3.2's.
    intermediate_size: int = 5120
    moe_intermediate_size: int = 512
    n_routed_experts: int = 128
    kv_lora_rank: int = 128
    q_lora_rank: int | None = 384
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    max_position_embeddings: int = 131072
    index_n_heads: int = 16
    gated_norm_rank: int = 16
    n_group: int | None = None
    topk_group: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # transformers turns the main attention's RoPE in adjacent pairs whatever
        # rope_interleave says; a null n_group means no groups, as it does for AXK2Config.
        config = {k: v for k, v in config.items() if k != "rope_interleave"}
        config = axk1.with_mlp_layer_types(config)
        return args_from_config(cls, config, nullable=("n_group", "topk_group"))


class GatedRMSNorm(nn.Module):
    """RMSNorm's output y times sigmoid(W_up silu(W_down y)), the gate in f32."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.W_down = nn.Linear(args.hidden_size, args.gated_norm_rank, bias=False)
        self.W_up = nn.Linear(args.gated_norm_rank, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.W_up(F.silu(self.W_down(y))).float())).to(y.dtype)


class Router(deepseek_v3.Router):
    """DeepSeek-V3's router, the experts outside the kept groups scoring 0 to be chosen
    (AXK2TopkRouter, "to match the reference implementation"), not minus infinity."""

    masked = 0.0


class MoE(deepseek_v3.MoE):
    router = Router


class Attention(deepseek_v32.Attention):
    """DeepSeek-V3.2's attention with its queries and output gate from one projection."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        # Each head's query rows, then its gate's, of [normalized latent, latent].
        width = self.n_heads * (args.qk_head_dim + self.v_dim)
        self.q_b_proj = nn.Linear(2 * args.q_lora_rank, width, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        """deepseek_v2.Attention.forward with the queries and the gate of q_b_proj."""
        batch, tokens, _ = x.shape
        heads, rank = self.n_heads, self.kv_lora_rank
        compressed = self.q_a_proj(x)
        q_resid = self.q_a_layernorm(compressed)  # the indexer reads it
        both = self.q_b_proj(torch.cat((q_resid, compressed), dim=-1))
        # [B, T, H*(nope+rope+v)] -> [B, T, H, nope+rope] queries and [B, T, H, v] gates
        q, gate = both.view(batch, tokens, heads, -1).split(
            [self.nope + self.rope, self.v_dim], dim=-1
        )
        q_nope, q_rope = q.transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, self.rope], dim=-1)
        # [H*(nope+v), rank] -> [H, nope+v, rank]: each head's key rows, then value rows
        w_k, w_v = self.kv_b_proj.weight.view(heads, -1, rank).split([self.nope, self.v_dim], 1)
        q_latent = q_nope @ w_k  # [B, H, T, rank]: absorbed (deepseek_v2.Attention)
        q_rope, k_rope = self.rotate(q_rope, frame), self.rotate(k_rope[:, None], frame)
        q = torch.cat((q_latent, q_rope), dim=-1)
        # [B, T, rank] -> [B, 1, T, rank + rope]: the one KV head, key and value alike
        k = torch.cat((self.kv_a_layernorm(latent)[:, None], k_rope), dim=-1)
        out = self.attend(q, k, frame, cache, x, q_resid)
        # [B, T, H*(rank+...)] -> [B, H, T, rank], each head through its value rows
        out = out.view(batch, tokens, heads, -1)[..., :rank].transpose(1, 2)
        out = (out @ w_v.transpose(1, 2)).transpose(1, 2)  # [B, T, H, v]
        out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.o_proj(out.reshape(batch, tokens, heads * self.v_dim))


class Layer(deepseek_v3.Layer):
    """DeepSeek-V3's layer with the gated norm before attention, and before the
    feed-forward of an expert layer."""

    moe = MoE

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.input_layernorm = GatedRMSNorm(args)
        if args.sparse(layer):
            self.post_attention_layernorm = GatedRMSNorm(args)


class Model(deepseek_v32.Model):
    attention = Attention
    layer = Layer

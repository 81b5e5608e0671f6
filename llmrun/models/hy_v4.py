"""Hunyuan V4 (HF hy_v4, tencent/Hy4; llama.cpp's GGUF arch "hy_v4"): GLM-5's model
(multi-head latent attention over a cached latent, DeepSeek sparse attention whose
"shared" layers reuse the keys the last "full" indexer layer chose, sigmoid-scored
experts behind leading dense layers) with these differences:

- each head's attention output is gated, sigmoid(gate_proj(x)) per feature, before
  o_proj, and every head has a learned sink logit in its softmax (as gpt-oss);
- the indexer turns its heads' *last* qk_rope_head_dim features (adjacent pairs), and
  normalizes its key with rms_norm_eps;
- the routed experts clamp their SwiGLU inputs at swiglu_limit, DeepSeek-V4's; the
  shared and dense ones do not. A limit of 0 or less means none, as HYV4Config documents
  and llama.cpp runs it (transformers' experts clamp at it all the same);
- the residual is hc_mult streams, DeepSeek-V4's hyper-connections without the mix of
  the streams: before each sublayer pre (a sigmoid of a learned mix of the flattened,
  RMS-normed streams) collapses them into its input; after it the output is added to
  each stream, scaled by post (hc_magnitude times a sigmoid, plus hc_eps); DeepSeek-V4's
  hc_head collapses them before the final norm.

Default indexer_types (transformers'): layer 0 and every fourth layer from layer 1 full.
HY V4 VL's language model (hy_v4_vl_text) is this model with its own defaults, the
latents normalized at rms_norm_eps, and M-RoPE, which turns text as plain RoPE.
The KV cache is DeepSeek-V3.2's: the latent, its rope part and the indexer's key.
The Hub's checkpoints end with multi-token-prediction layers (mtp_layers), which
transformers ignores, and so does llmrun.

Reference: transformers/models/hy_v4/modeling_hy_v4.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v3, deepseek_v4, deepseek_v32
from llmrun.models.base import cached_keys_values, rotate_pairs
from llmrun.models.cache import KVCache
from llmrun.models.deepseek_v32 import IndexedFrame
from llmrun.models.gpt_oss import sink_attention

# HYV4VLTextConfig's defaults where they differ from HYV4Config's.
VL_TEXT_DEFAULTS = dict(
    hidden_size=6144,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=78,
    num_attention_heads=64,
    q_lora_rank=2048,
    index_n_heads=32,
)
VL_TEXT_MODEL_TYPE = "hy_v4_vl_text"


@dataclass
class ModelArgs(deepseek_v32.ModelArgs):
    # HYV4Config's defaults where they differ from DeepSeek-V3.2's.
    hidden_size: int = 2816
    num_hidden_layers: int = 34
    num_attention_heads: int = 32
    vocab_size: int = 120832
    intermediate_size: int = 6912
    moe_intermediate_size: int = 768
    routed_scaling_factor: float = 2.827
    n_group: int | None = 1
    topk_group: int | None = 1
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    index_n_heads: int = 16
    hc_mult: int = 4
    hc_magnitude: float = 2.0
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:  # transformers ignores first_k_dense_replace here
            self.mlp_layer_types = ["dense"] * min(1, layers) + ["sparse"] * max(layers - 1, 0)
        if self.indexer_types is None:
            self.indexer_types = [
                "full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)
            ]
        super().__post_init__()

    @property
    def indexer_rope_pairs(self) -> bool:
        return True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """HY V4's config, or the language model's of HY V4 VL (hy_v4_vl_text: its
        defaults, and the latents normalized at rms_norm_eps rather than 1e-6; its
        M-RoPE turns a text token's features as plain RoPE, each section's position the
        same)."""
        if config.get("model_type") == VL_TEXT_MODEL_TYPE:
            config = {**VL_TEXT_DEFAULTS, **config}
            config["latent_norm_eps"] = config.get("rms_norm_eps", cls.rms_norm_eps)
        return super().from_config(config)


class Indexer(deepseek_v32.Indexer):
    """DeepSeek-V3.2's lightning indexer with RoPE on each head's last features and its
    key's LayerNorm at rms_norm_eps."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.k_norm.eps = args.rms_norm_eps

    def rotate(self, x: torch.Tensor, frame: IndexedFrame) -> torch.Tensor:
        """Adjacent-pair RoPE on the last qk_rope_head_dim features of x [B, H, T, D]."""
        nope = x.shape[-1] - frame.cos.shape[-1]
        return torch.cat((x[..., :nope], rotate_pairs(x[..., nope:], frame)), dim=-1)


class Attention(deepseek_v32.Attention):
    """Sparse MLA with a sink logit per head and the heads' outputs gated by the input."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        if self.indexer is not None:
            self.indexer = Indexer(args)
        heads = args.num_attention_heads
        self.gate_proj = nn.Linear(args.hidden_size, heads * args.v_head_dim, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))

    def attend_all(
        self, q: torch.Tensor, k: torch.Tensor, frame: IndexedFrame, cache: KVCache | None
    ) -> torch.Tensor:
        # Stored as the cache keeps them where sink_attention takes ops.attend_one.
        keys, _ = cached_keys_values(k, k, self.layer, frame, cache, q.shape[2])
        return self.attend_chosen(q, keys, frame.mask)

    def attend_chosen(
        self, q: torch.Tensor, k: torch.Tensor, chosen: torch.Tensor | None
    ) -> torch.Tensor:
        return sink_attention(q, k, k, chosen, self.scale, self.sinks)

    def gated_output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out * torch.sigmoid(self.gate_proj(x))


class MoE(deepseek_v3.MoE):
    """DeepSeek-V3's experts, the routed ones with DeepSeek-V4's clamped SwiGLU."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        if args.swiglu_limit > 0:
            self.experts = nn.ModuleList(
                deepseek_v4.Expert(args) for _ in range(args.n_routed_experts)
            )


class HyperConnection(nn.Module):
    """The mix around a sublayer: from the hc_mult streams [B, T, n, D] (flattened,
    RMS-normed), pre [B, T, n] (collapses them to the sublayer's input) and post [B, T,
    n] (scales its output onto each stream)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        n = self.n = args.hc_mult
        self.hc_eps, self.eps, self.magnitude = args.hc_eps, args.rms_norm_eps, args.hc_magnitude
        self.fn = nn.Parameter(torch.empty(2 * n, n * args.hidden_size))
        self.base = nn.Parameter(torch.empty(2 * n))
        self.scale = nn.Parameter(torch.empty(2))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """post [B, T, n] (f32) and the collapsed input [B, T, D]."""
        flat = deepseek_v4.unweighted_rms_norm(streams.flatten(2).float(), self.eps)
        pre, post = F.linear(flat, self.fn.float()).split(self.n, dim=-1)
        pre_b, post_b = self.base.float().split(self.n)
        pre_s, post_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.hc_eps
        post = self.magnitude * torch.sigmoid(post * post_s + post_b) + self.hc_eps
        collapsed = (pre[..., None] * streams.float()).sum(dim=2)
        return post, collapsed.to(streams.dtype)


def spread(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """The streams [B, T, n, D] after a sublayer: its output [B, T, D] times post [B, T,
    n] added to each, in f32 (as transformers adds them)."""
    added = post[..., None] * out.float()[..., None, :] + streams.float()
    return added.to(streams.dtype)


class Layer(deepseek_v3.Layer):
    """A pre-norm block whose sublayers read and write the streams through their
    hyper-connections."""

    moe = MoE

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)

    def forward(
        self, streams: torch.Tensor, frame: IndexedFrame, cache: KVCache | None
    ) -> torch.Tensor:
        post, x = self.attn_hc(streams)
        streams = spread(streams, self.self_attn(self.input_layernorm(x), frame, cache), post)
        post, x = self.ffn_hc(streams)
        return spread(streams, self.mlp(self.post_attention_layernorm(x)), post)


class Model(deepseek_v32.Model):
    """embed -> hc_mult streams -> layers -> hc_head -> norm -> lm_head, with
    transformers' module names."""

    attention = Attention
    layer = Layer
    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.model.hc_head = deepseek_v4.HyperHead(args)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (or [B, 1, vocab]: last_only, or `last` [B], each
        row's last real token) of input_ids [B, T] at positions [B, T]."""
        if static is not None:
            raise UnsupportedError("Hunyuan V4 has no static decode step (CUDA graphs)")
        x = self.embed(input_ids)
        frame = self.frame(positions, cache, x.dtype, last)
        # [B, T, D] -> [B, T, n, D]: every stream starts as the embedding
        x = x[:, :, None].expand(-1, -1, self.args.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            x = layer(x, frame, cache)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(self.model.hc_head(x))).float()

"""Mistral Large 4 (HF mistral_large4; its language model mistral_large4_text): GLM-5's
model (multi-head latent attention over a cached latent, DeepSeek sparse attention whose
"shared" layers reuse the keys the last "full" indexer layer chose, adjacent-pair RoPE)
with Mistral 4's softmax router (llmrun.models.mistral4) and these differences:

- the queries come from the hidden state (q_proj, no low-rank latent), and so do the
  indexer's: a LayerNorm of it (q_input_norm), then wq_b;
- softmax scaling: every query head h at position p, the main attention's and the
  indexer's, is multiplied by scale[h] * log(p + 1) + bias[h], learned per layer;
- LeRoPE: YaRN's inverse frequencies times exp(alpha), alpha learned (rotary_emb.alpha);
- NoPE layers (no_rope_layers 0, by default every fourth): no RoPE in the layer or its
  indexer, each head's key part without position qk_nope + qk_rope wide;
- KV sharing (kv_source_layers): a layer may attend to the latents of an earlier layer
  instead of computing its own (no kv_a_proj_with_mqa); it keeps its own kv_b_proj,
  queries and indexer. transformers hands a sharing layer the latents of the last
  earlier source layer of its kind (RoPE or NoPE), so a config that names another is
  refused;
- the logits are soft-capped, final_logit_softcapping * tanh(logits / it).

The KV cache is DeepSeek-V3.2's, every layer's own: the latent, its rope part (zeros in
a NoPE layer) and the indexer's key. A sharing layer caches the latents it read beside its
own indexer's key: exact, but the memory of the layers it shares is not saved. The Hub's
checkpoints hold a multi-token-prediction head (mtp_dspark), which transformers ignores,
and so does llmrun.

Reference: transformers/models/mistral_large4/modeling_mistral_large4.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2, deepseek_v32, glm_moe_dsa, mistral4
from llmrun.models.base import RotaryEmbedding, args_from_config
from llmrun.models.cache import KVCache

MODEL_TYPE, TEXT_MODEL_TYPE = "mistral_large4", "mistral_large4_text"
# MistralLarge4TextConfig's rope_parameters where a config.json has none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 2048.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 1.0,
}
# transformers builds the indexer's q_input_norm as nn.LayerNorm(hidden_size, eps=1e-6).
QUERY_NORM_EPS = 1e-6


@dataclass
class ModelArgs(glm_moe_dsa.ModelArgs):
    # MistralLarge4TextConfig's defaults where they differ from GLM-5's.
    vocab_size: int = 204800
    hidden_size: int = 6144
    intermediate_size: int = 24576
    moe_intermediate_size: int = 6144
    num_hidden_layers: int = 72
    num_attention_heads: int = 64
    n_routed_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True  # always, in transformers
    topk_method: str = MODEL_TYPE  # no such config field: one router, Mistral 4's
    scoring_func: str = "softmax"
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 64
    v_head_dim: int = 128
    max_position_embeddings: int = 1048576
    first_k_dense_replace: int = 1
    final_logit_softcapping: float | None = 30.0
    # Per layer: 1 turns RoPE, 0 is NoPE (default: every no_rope_layer_interval-th NoPE).
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    # Per layer, the layer whose latents it attends to (default: its own).
    kv_source_layers: list[int] | None = None

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.no_rope_layers is None:
            interval = self.no_rope_layer_interval
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
        if len(self.no_rope_layers) < layers:
            raise ModelFormatError(
                f"no_rope_layers lists {len(self.no_rope_layers)} layers, but "
                f"num_hidden_layers is {layers}"
            )
        if self.kv_source_layers is None:
            self.kv_source_layers = list(range(layers))
        self.check_sharing()
        super().__post_init__()

    def check_sharing(self) -> None:
        """Refuse kv_source_layers that transformers refuses, or whose sharing layers it
        would hand other latents than their sources' (see the module docstring)."""
        sources, layers = self.kv_source_layers, self.num_hidden_layers
        if len(sources) != layers:
            raise ModelFormatError(
                f"kv_source_layers lists {len(sources)} layers, but num_hidden_layers is {layers}"
            )
        for layer, source in enumerate(sources):
            if not (isinstance(source, int) and 0 <= source <= layer and sources[source] == source):
                raise ModelFormatError(
                    f"kv_source_layers: layer {layer} shares the latents of {source!r}, not an "
                    "earlier layer that computes its own"
                )
            if source == layer:
                continue
            kind = self.uses_rope(layer)
            between = [s for s in range(source + 1, layer) if self.read_later(s)]
            if self.uses_rope(source) != kind or any(self.uses_rope(s) == kind for s in between):
                raise ModelFormatError(
                    f"kv_source_layers: layer {layer} shares the latents of layer {source}, "
                    f"but transformers hands it those of the last earlier source layer "
                    f"{'with' if kind else 'without'} RoPE"
                )

    def check_queries(self) -> None:
        """The indexer reads the hidden state: nothing to refuse."""

    check_routing = mistral4.ModelArgs.check_routing
    grouped = mistral4.ModelArgs.grouped
    group_score = mistral4.ModelArgs.group_score

    def uses_rope(self, layer: int) -> bool:
        return bool(self.no_rope_layers[layer])

    def read_later(self, layer: int) -> bool:
        """Whether a later layer attends to `layer`'s latents."""
        return layer in self.kv_source_layers[layer + 1 :]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """A mistral_large4_text config (the text_config of a mistral_large4 one)."""
        config = {k: v for k, v in config.items() if k not in ("rope_interleave", "head_dim")}
        # No queries' latent (transformers' config has no q_lora_rank); one router, whose
        # top-k weights are always renormalized.
        config.update(
            q_lora_rank=None, topk_method=MODEL_TYPE, scoring_func="softmax", norm_topk_prob=True
        )
        if "n_routed_experts" not in config:
            config["n_routed_experts"] = config.get("num_local_experts", config.get("num_experts"))
        if not (config.get("rope_parameters") or config.get("rope_scaling")):
            config["rope_parameters"] = DEFAULT_ROPE
        # transformers normalizes the latents with rms_norm_eps.
        config["latent_norm_eps"] = config.get("rms_norm_eps") or cls.rms_norm_eps
        return args_from_config(
            cls, config, nullable=("q_lora_rank", "n_shared_experts", "final_logit_softcapping")
        )


class SoftmaxScaling(nn.Module):
    """Each head's factor on its queries: scale[h] * log(p + 1) + bias[h] at position p."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(heads))
        self.bias = nn.Parameter(torch.empty(heads))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The factors [B, T, H] at positions [B, T], in `dtype` (as transformers
        computes them: in the queries' dtype)."""
        log_positions = (positions + 1).float().log().to(dtype)[..., None]
        return self.scale.to(dtype) * log_positions + self.bias.to(dtype)


class LearnedRotaryEmbedding(RotaryEmbedding):
    """LeRoPE: the inverse frequencies times exp(alpha)."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        super().__init__(params, head_dim, max_position_embeddings)
        if self.long_inv_freq is not None:
            raise UnsupportedError("Mistral Large 4 with LongRoPE is not supported")
        self.alpha = nn.Parameter(torch.zeros(self.rotary_dim // 2))

    def _angles(
        self, positions: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * (self.inv_freq * self.alpha.float().exp())
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos, torch.cat((-sin, sin), dim=-1)  # signs folded in, as RotaryEmbedding's


class Indexer(deepseek_v32.Indexer):
    """GLM-5's indexer whose queries come from the normalized hidden state, scaled by
    position; without RoPE in a NoPE layer."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, args.hidden_size)
        self.use_rope = args.uses_rope(layer)
        self.q_input_norm = nn.LayerNorm(args.hidden_size, eps=QUERY_NORM_EPS)
        self.softmax_scaling = SoftmaxScaling(self.n_heads)

    def queries(self, x: torch.Tensor, frame: deepseek_v32.IndexedFrame) -> torch.Tensor:
        """The indexer's queries [B, T, H, D] of the hidden state x [B, T, hidden]."""
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, T, H, D], scaled per head, then [B, H, T, D] to rotate
        q = self.wq_b(self.q_input_norm(x)).view(batch, tokens, self.n_heads, self.head_dim)
        q = q * self.softmax_scaling(frame.positions, q.dtype)[..., None]
        return self.rotate(q.transpose(1, 2), frame).transpose(1, 2)

    def rotate(self, x: torch.Tensor, frame: deepseek_v32.IndexedFrame) -> torch.Tensor:
        return super().rotate(x, frame) if self.use_rope else x


@dataclass
class SharingFrame(deepseek_v32.IndexedFrame):
    """An IndexedFrame that carries this forward's new latents [B, 1, T, rank + rope] of
    the layers that later ones share, by layer."""

    latents: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class Attention(deepseek_v32.Attention):
    """Sparse MLA with softmax scaling, NoPE layers and shared latents."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        heads, rank = self.n_heads, self.kv_lora_rank
        self.use_rope = args.uses_rope(layer)
        self.rope_width = args.qk_rope_head_dim  # of the cached rope part, every layer's
        self.source, self.read_later = args.kv_source_layers[layer], args.read_later(layer)
        if not self.use_rope:  # the whole key without position
            self.nope, self.rope = args.qk_head_dim, 0
            self.kv_b_proj = nn.Linear(rank, heads * (self.nope + self.v_dim), bias=False)
            self.kv_b_proj.read_as_floats = True  # read, not multiplied by (deepseek_v2)
            self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, rank, bias=args.attention_bias)
        if self.source != layer:  # the latents are another layer's
            self.kv_a_proj_with_mqa = self.kv_a_layernorm = None
        self.softmax_scaling = SoftmaxScaling(heads)

    def make_indexer(self, args: ModelArgs, layer: int) -> Indexer:
        return Indexer(args, layer)

    def forward(self, x: torch.Tensor, frame: SharingFrame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        heads, rank = self.n_heads, self.kv_lora_rank
        # [B, T, H*(nope+rope)] -> [B, H, T, nope+rope]
        q = self.q_proj(x).view(batch, tokens, heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        # [H*(nope+v), rank] -> [H, nope+v, rank]: each head's key rows, then value rows
        w_k, w_v = self.kv_b_proj.weight.view(heads, -1, rank).split([self.nope, self.v_dim], 1)
        q_latent = q_nope @ w_k  # [B, H, T, rank]: absorbed (deepseek_v2.Attention)
        if self.use_rope:
            q = torch.cat((q_latent, self.rotate(q_rope, frame)), dim=-1)
        else:
            q = F.pad(q_latent, (0, self.rope_width))
        # [B, T, H] -> [B, H, T, 1]
        q = q * self.softmax_scaling(frame.positions, q.dtype).transpose(1, 2)[..., None]
        if self.source != self.layer:
            k = frame.latents[self.source]
        else:
            latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, self.rope], dim=-1)
            latent = self.kv_a_layernorm(latent)[:, None]  # [B, 1, T, rank]
            if self.use_rope:
                k = torch.cat((latent, self.rotate(k_rope[:, None], frame)), dim=-1)
            else:
                k = F.pad(latent, (0, self.rope_width))
            if self.read_later:
                frame.latents[self.layer] = k
        # the indexer's queries come from the hidden state (its q_resid)
        out = self.attend(q, k, frame, cache, x, x)
        # [B, T, H*(rank+...)] -> [B, H, T, rank], each head through its value rows
        out = out.view(batch, tokens, heads, -1)[..., :rank].transpose(1, 2)
        out = (out @ w_v.transpose(1, 2)).transpose(1, 2)
        return self.o_proj(out.reshape(batch, tokens, heads * self.v_dim))


class Model(deepseek_v32.Model):
    """embed -> layers (DeepSeek-V2's, with Mistral 4's router) -> norm -> lm_head ->
    soft-cap, with transformers' text model names."""

    attention = Attention
    layer = deepseek_v2.Layer  # experts routed without a selection bias
    # Kept in f32 whatever the compute dtype, as transformers keeps them: exp(alpha) of a
    # bf16 alpha would turn a far position's angles by radians.
    float32_weights = ("model.rotary_emb.alpha",)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.model.rotary_emb = LearnedRotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """CausalLM.forward's float32 logits, soft-capped."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static, images)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> SharingFrame:
        frame = super().frame(positions, cache, dtype, last)
        return SharingFrame(**{f.name: getattr(frame, f.name) for f in dataclasses.fields(frame)})

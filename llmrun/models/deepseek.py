"""DeepSeek V1's mixture of experts (deepseek-moe-16b-base/-chat; the Hub's
DeepseekForCausalLM, model_type "deepseek", which transformers does not have; llama.cpp's
GGUF arch "deepseek"): what Ling 1 computes (llmrun.models.bailing_moe) under Llama's
names: grouped-query attention without biases, RoPE on whole heads, halves turned;
first_k_dense_replace dense SwiGLU layers, then the top num_experts_per_tok softmax
scores' experts, renormalized (+1e-20) where norm_topk_prob and a token takes more than
one, plus n_shared_experts experts' width of shared SwiGLU.

Refused where the published code computes what this does not: experts in every
moe_layer_freq-th layer only (moe_layer_freq other than 1), its own RoPE scalings
(rope_scaling), scores other than softmax, attention biases (attention_bias: q, k, v and
the output projection's), no experts.

DeepSeek-OCR 2's text model (transformers' DeepseekOcr2TextModel: DeepSeek V2's experts,
Llama's attention) computes the same: its mlp_layer_types names the dense layers, which
must come first; a routed_scaling_factor other than 1 is refused. Unlimited-OCR's text
model too, whose reference sliding window (reference_window) lets a token decoded past the
window's see its prompt and the last reference_window positions only (transformers'
UnlimitedOcrDynamicReferenceSlidingWindowLayer keeps just those keys).

Reference: modeling_deepseek.py of deepseek-ai/deepseek-moe-16b-base.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import UnsupportedError
from llmrun.models import bailing_moe
from llmrun.models.base import Frame, key_positions, reference_window_mask
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(bailing_moe.ModelArgs):
    # DeepseekConfig's defaults where they differ.
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    # Unlimited-OCR's reference sliding window (llmrun.loading.vl_text gives it): a
    # decoded token past the window's sees its prompt and the last reference_window
    # positions only. None: full attention.
    reference_window: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        for name, value, allowed in (
            ("moe_layer_freq", config.get("moe_layer_freq", 1), 1),
            ("scoring_func", config.get("scoring_func", "softmax"), "softmax"),
            ("topk_method", config.get("topk_method", "greedy"), "greedy"),
            ("attention_bias", config.get("attention_bias", False), False),
        ):
            if value != allowed:
                raise UnsupportedError(
                    f"DeepSeek V1 with {name} {value!r} is not supported ({allowed!r})"
                )
        if config.get("rope_scaling"):
            raise UnsupportedError(
                "DeepSeek V1 with rope_scaling is not supported (the published code scales "
                "RoPE its own way)"
            )
        if not config.get("n_routed_experts") or not config.get("num_experts_per_tok"):
            raise UnsupportedError(
                "DeepSeek V1 without n_routed_experts and num_experts_per_tok (a dense model) "
                "is not supported"
            )
        if config.get("routed_scaling_factor", 1.0) != 1.0:
            raise UnsupportedError(
                f"DeepSeek V1 with routed_scaling_factor {config['routed_scaling_factor']} "
                "is not supported (1.0)"
            )
        kinds = config.get("mlp_layer_types")
        if kinds is not None:
            dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
            if kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
                raise UnsupportedError(
                    f"mlp_layer_types {kinds!r}: llmrun runs dense layers first, then sparse"
                )
            config = {**config, "first_k_dense_replace": dense}
        # DeepseekConfig's defaults: no shared experts, no dense layers, no renormalization.
        config = {"n_shared_experts": None, "first_k_dense_replace": 0, **config}
        config.setdefault("norm_topk_prob", False)
        return super().from_config({**config, "use_bias": False})


class Model(bailing_moe.Model):
    """Ling 1's model, under this family's name; with a reference_window, its attention
    follows the cache's prompt_ends (each row's prompt length, which the generation loop
    and serve's scheduler give), as transformers' UnlimitedOcr caches and masks do."""

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame:
        frame = super().frame(positions, cache, dtype, last)
        window, ends = self.args.reference_window, getattr(cache, "prompt_ends", None)
        if window is not None and ends is not None:
            keys = key_positions(positions, frame.length, cache)
            mask = reference_window_mask(positions, keys, ends, window)
            if mask is not None:
                frame.mask = mask
        return frame

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        cache = super().new_cache(batch, max_seq_len, dtype, device)
        cache.reference_window = self.args.reference_window
        return cache

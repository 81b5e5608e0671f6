"""GLM-4.5 MoE (GLM-4.5, GLM-4.5-Air, GLM-4.6; Upstage Solar Open; llama.cpp's
"glm4moe" GGUFs): Qwen3's attention (q/k/v biases where attention_bias, per-head q/k
RMSNorms only where use_qk_norm, o_proj without bias) with RoPE on the first
partial_rotary_factor (0.5 where a config leaves it out) of each head, halves rotated
(not GLM-4's adjacent pairs); first_k_dense_replace dense layers, then DeepSeek-V3's
experts: sigmoid scores, chosen by score + e_score_correction_bias among the
topk_group best of n_group groups, weighted by the unbiased scores (renormalized with
norm_topk_prob) times routed_scaling_factor, plus shared experts.

Also the language model of GLM-4.5V, whose prompts with images turn by M-RoPE
(llmrun.models.mrope; rope_parameters' mrope_section, in blocks over the halves).

The Hub's checkpoints hold num_nextn_predict_layers multi-token-prediction layers past
num_hidden_layers; transformers ignores them, and so does llmrun.

Reference: transformers/models/glm4_moe/modeling_glm4_moe.py,
models/glm4v_moe/modeling_glm4v_moe.py (Glm4vMoeTextRotaryEmbedding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v3, mrope, qwen3
from llmrun.models.base import GatedMLP, args_from_config

PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig's default
SCORING = "sigmoid"


@dataclass
class ModelArgs:
    # Glm4MoeConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 10944  # the dense layers'
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        experts, groups = self.n_routed_experts, self.n_group
        if groups < 1 or experts % groups:
            raise ModelFormatError(f"{experts} experts do not split into n_group {groups} groups")
        if experts // groups < 2:
            # dots.llm1 and MiniCPM5-MoE take these args too: the message names no family
            raise UnsupportedError(
                f"expert groups of one expert ({experts} experts in n_group {groups}) are not "
                "supported (a group scores its best two)"
            )
        if not 0 < self.topk_group <= groups:
            raise ModelFormatError(f"topk_group is {self.topk_group}, but n_group is {groups}")
        reachable = experts // groups * self.topk_group
        if not 0 < self.num_experts_per_tok <= reachable:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but a token can reach "
                f"{reachable} of the {experts} experts (n_routed_experts, n_group, topk_group)"
            )

    # What deepseek_v3's router reads: sigmoid scores, groups scored by their best two.
    scoring_func = SCORING
    group_score = "top2"
    # The rotated share of a head where a config gives none.
    default_partial_rotary_factor = PARTIAL_ROTARY_FACTOR

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config = {**config, "n_routed_experts": config["num_local_experts"]}
        args = args_from_config(cls, config)
        args.rope_parameters.setdefault("partial_rotary_factor", cls.default_partial_rotary_factor)
        return args


class Attention(qwen3.Attention):
    """Qwen3's attention, its q/k norms only where use_qk_norm, and no bias on o_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        if not args.use_qk_norm:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()


class Model(mrope.MRopeLM):
    interleaved = False  # the sections in blocks over the halves

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, deepseek_v3.Layer)

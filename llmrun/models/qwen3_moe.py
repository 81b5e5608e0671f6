"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 (an RMSNorm on each query and
key head) with a mixture-of-experts feed-forward, the top-k of many small experts; also
the language model of Qwen3-VL-MoE, whose prompts with images turn by interleaved M-RoPE
and take the images' deepstack features (llmrun.models.mrope).

Reference: transformers/models/qwen3_moe/modeling_qwen3_moe.py. Parameter names are
the Hub's per-expert checkpoint keys (`mlp.experts.N.gate_proj`, ...): one module per
expert, as Mixtral's (llmrun.models.mixtral).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import mrope
from llmrun.models.base import TopKExperts, args_from_config, check_top_k
from llmrun.models.qwen2_moe import MLP, DecoderLayer
from llmrun.models.qwen3 import Attention


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 6144  # the dense layers' (mlp_only_layers)
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_sliding_window:
            raise UnsupportedError("Qwen3-MoE with use_sliding_window=true is not supported")
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "num_experts" not in config and "num_local_experts" in config:
            # transformers 5 writes the Hub's num_experts under its alias.
            config = {**config, "num_experts": config["num_local_experts"]}
        return args_from_config(cls, config)

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class SparseMoeBlock(TopKExperts):
    """The top-k experts of the router's softmax, renormalized if norm_topk_prob."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(
            args,
            args.num_experts,
            lambda: MLP(args, args.moe_intermediate_size),
            args.norm_topk_prob,
        )


class Model(mrope.MRopeLM):
    # Qwen3VLMoeTextRotaryEmbedding interleaves the sections whatever the config says.
    interleaved = True

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)

"""Baichuan and Baichuan 2 (Baichuan Inc., 7B and 13B; llama.cpp's "baichuan" GGUFs):
Llama without grouped KV heads whose checkpoints hold the queries, keys and values in one
W_pack matrix (the loader splits it, llmrun/loading/baichuan.py). The 7B models turn
queries and keys by RoPE; the 13B ones have no RoPE but ALiBi's bias in attention
(base.Alibi, the slopes of BLOOM's, a maximum bias of 8). The config does not say which:
each size ships its own modeling code, and llmrun tells them apart as llama.cpp does, by
the layer count (32: RoPE, 40: ALiBi), refusing any other. Baichuan 2's NormHead
normalizes the output matrix's rows, which the loader does once (see its note).

Reference: modeling_baichuan.py of baichuan-inc/Baichuan2-7B-Chat and Baichuan2-13B-Chat
(remote code; transformers has no Baichuan): the 7B is transformers' LlamaForCausalLM of
the split weights, the 13B that with ALiBi instead of RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import llama
from llmrun.models.base import (
    Alibi,
    CausalLM,
    Frame,
    GatedMLP,
    alibi_slopes,
    args_from_config,
    attend_biased,
)
from llmrun.models.cache import KVCache

# Layer counts -> position encoding, as llama.cpp's llama_model_baichuan reads a file
# (32: LLM_TYPE_7B, RoPE; 40: LLM_TYPE_13B, ALiBi of maximum bias 8).
POSITIONS = {32: "rope", 40: "alibi"}


@dataclass
class ModelArgs(llama.ModelArgs):
    # BaichuanConfig's maximum length where the config gives no max_position_embeddings
    # (the 13B's config.json has only model_max_length).
    model_max_length: int | None = None
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        positions = POSITIONS.get(self.num_hidden_layers)
        if positions is None:
            raise UnsupportedError(
                f"a Baichuan model of {self.num_hidden_layers} layers: its config does not say "
                "whether it has RoPE or ALiBi, and llmrun, as llama.cpp, knows Baichuan's of 32 "
                "layers (7B, RoPE) and of 40 (13B, ALiBi)"
            )
        self.alibi = positions == "alibi"

    def alibi_slopes(self) -> torch.Tensor:
        return alibi_slopes(self.num_attention_heads)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        if config.get("max_position_embeddings") is None and config.get("model_max_length"):
            config["max_position_embeddings"] = config["model_max_length"]
        return args_from_config(cls, config)


class AlibiAttention(llama.Attention):
    """Llama's attention without RoPE, biased by ALiBi (the 13B's)."""

    def rotate(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return x

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        return attend_biased(q, k, v, self.layer, frame, cache, self.head_dim**-0.5)


class AlibiModel(Alibi, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, AlibiAttention, GatedMLP)


def Model(args: ModelArgs) -> nn.Module:  # noqa: N802 (the registry's constructor name)
    """The 13B's ALiBi model, or the 7B's, Llama's (and the native decode step it takes)."""
    return AlibiModel(args) if args.alibi else llama.Model(args)

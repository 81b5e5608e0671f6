"""InternLM2 and InternLM2.5 (Shanghai AI Laboratory, chat 1.8B, 7B and 20B; llama.cpp's
"internlm2" GGUFs): Llama's math under other names. The checkpoints name the modules
tok_embeddings, attention.wqkv (queries, keys and values in one matrix, grouped by KV
head), attention.wo, feed_forward.w1/w3/w2, attention_norm, ffn_norm and output; the
loader renames them to Llama's and splits wqkv (llmrun/loading/internlm2.py). The
config's `bias` (true by default) puts biases on wqkv and wo: Llama's attention_bias.

RoPE scaling "dynamic" (NTK, in InternLM2.5's and InternLM3's configs) changes the RoPE
base only once a sequence outgrows max_position_embeddings, and then per forward call, so
that keys cached before keep the old base. Within max_position_embeddings it is plain
RoPE, which the model runs; a position past it is refused (ContextOverflowError) rather
than computed as some other model. llama.cpp's converter writes no scaling for it: its
GGUFs are plain RoPE at every position.

Reference: modeling_internlm2.py of internlm/internlm2-chat-7b (remote code; transformers
has no InternLM2), which computes transformers' LlamaForCausalLM of the split weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ContextOverflowError, UnsupportedError
from llmrun.models import llama
from llmrun.models.base import args_from_config

DEFAULT_ROPE_THETA = 10000.0


@dataclass
class ModelArgs(llama.ModelArgs):
    # InternLM2Config's defaults where they differ from Llama's.
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    # The first position where dynamic NTK scaling would change the RoPE base (None: the
    # config has none); from_config sets it.
    ntk_from: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        if "bias" in config:
            config["attention_bias"] = config.pop("bias")
        else:
            config.setdefault("attention_bias", True)  # InternLM2Config's default
        return with_plain_rope(cls, config)


def with_plain_rope(cls: type, config: dict[str, Any]) -> Any:
    """`cls` (a ModelArgs with `ntk_from`) of `config`, dynamic NTK scaling read as plain
    RoPE up to max_position_embeddings (see the module's note)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "dynamic":
        return args_from_config(cls, config)
    if params.get("alpha"):
        raise UnsupportedError(
            "RoPE scaling 'dynamic' with an alpha (NTK-alpha) is not InternLM's; llmrun "
            "runs InternLM's dynamic NTK scaling only"
        )
    plain = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
    plain["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)),
    }
    args = args_from_config(cls, plain)
    args.ntk_from = args.max_position_embeddings
    return args


class Model(llama.Model):
    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        limit = self.args.ntk_from
        # A CUDA graph being captured cannot read a position back (static decode).
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if limit is not None and not capturing and int(positions.max()) >= limit:
            raise ContextOverflowError(
                f"position {int(positions.max())} is past max_position_embeddings ({limit}), "
                "where the model's dynamic NTK RoPE scaling would change its RoPE base; llmrun "
                f"runs this model within {limit} positions (--ctx-size {limit} at most)"
            )
        return self.embed(input_ids)

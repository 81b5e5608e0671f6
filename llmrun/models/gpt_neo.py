"""GPT-Neo (GPTNeoForCausalLM: EleutherAI/gpt-neo-125m, 1.3B, 2.7B and their fine-tunes):
GPT-2's block, learned absolute positions, LayerNorms and biased GELU feed-forward
c_proj(gelu_new(c_fc(x))), with separate unbiased q, k, v projections and a biased
out_proj, attention scores NOT scaled by 1/sqrt(head width), and layers that alternate
(attention_types) between global attention and local attention to the last window_size
positions.

The checkpoints name the modules transformer.wte, wpe, h.N.attn.attention.*, ln_f (nn.Linear
matrices, not GPT-2's Conv1D); llmrun/loading/gpt_neo.py renames them to llmrun's.

Reference: transformers/models/gpt_neo/modeling_gpt_neo.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models import gpt2, gpt_neo_config
from llmrun.models.base import (
    CausalLM,
    Frame,
    args_from_config,
    attend_scaled,
    layer_frames,
    sliding_windows,
)
from llmrun.models.cache import KVCache

# GPTNeoConfig.attribute_map: the checkpoints' field names -> the usual ones.
CONFIG_ALIASES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}


@dataclass
class ModelArgs:
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    vocab_size: int = 50257
    max_position_embeddings: int = 2048
    attention_types: list | None = None
    window_size: int = gpt_neo_config.DEFAULT_WINDOW
    intermediate_size: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = self.intermediate_size or 4 * self.hidden_size
        self.layer_types = gpt_neo_config.layer_types(self.attention_types, self.num_hidden_layers)

    def layer_windows(self) -> list[int | None]:
        """Each layer's window: window_size for local layers, None for global ones."""
        return sliding_windows(self.layer_types, self.window_size)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config:
                config.setdefault(name, config.pop(alias))
        return args_from_config(cls, config)


class Attention(nn.Module):
    """Unbiased q, k, v; scores unscaled; over its layer type's frame; biased out_proj."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.layer_type = args.layer_types[layer]
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        frame = frames[self.layer_type]
        return self.out_proj(attend_scaled(q, k, v, self.layer, frame, cache, 1.0))


class Model(CausalLM):
    embed_at = gpt2.Model.embed_at  # the token embeddings plus their positions'

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, gpt2.MLP, gpt2.DecoderLayer, body=gpt2.Body)

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type: global layers see every earlier position, local ones
        the last window_size (in a cache that keeps only those: its plan)."""
        return layer_frames(
            positions, cache, dtype, self.args.window_size, self.model.rotary_emb, last=last
        )

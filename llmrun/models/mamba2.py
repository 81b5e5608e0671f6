"""Mamba-2 (Mamba2ForCausalLM: the Mamba-2 language models, Mamba-Codestral; llama.cpp's
"mamba2" GGUFs): a stack of x + mixer(rmsnorm(x)) layers, every mixer Mamba-2 (the
convolution, the SSD recurrence over heads with n_groups of B and C, and the gated RMSNorm
over n_groups groups of features: granitemoehybrid.Mamba2Mixer), no attention and no
feed-forward. The cache holds no keys or values, only each layer's state
(llmrun.models.recurrent).

Reference: transformers/models/mamba2/modeling_mamba2.py. Parameter names are its keys
with model. for backbone. (llmrun/loading/mamba2.py renames).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import nemotron_h
from llmrun.models.base import CausalLM, Frame, Hybrid, RMSNorm, args_from_config
from llmrun.models.cache import KVCache
from llmrun.models.granitemoehybrid import Mamba2Shape, _float


@dataclass
class ModelArgs:
    hidden_size: int = 4096
    num_hidden_layers: int = 64
    vocab_size: int = 32768
    num_heads: int = 128
    head_dim: int = 64  # of a Mamba-2 head (there is no attention)
    state_size: int = 128
    expand: int = 2
    n_groups: int = 8
    conv_kernel: int = 4
    use_bias: bool = False  # in_proj's and out_proj's
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # unused: no attention

    # The KV cache's shape (Hybrid.new_cache): no layer has keys or values.
    attention_layers: ClassVar[tuple[int, ...]] = ()
    num_key_value_heads: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise UnsupportedError(
                f"Mamba-2 hidden_act {self.hidden_act!r} is not supported (supported: silu)"
            )
        if self.num_heads * self.head_dim != self.expand * self.hidden_size:
            raise ModelFormatError(
                f"Mamba-2 heads do not fit: {self.num_heads} heads of {self.head_dim} in an "
                f"inner size of {self.expand * self.hidden_size} (expand * hidden_size)"
            )
        if self.num_heads % self.n_groups:
            raise ModelFormatError(
                f"Mamba-2's {self.num_heads} heads do not split into {self.n_groups} groups "
                "(n_groups)"
            )
        self.time_step_limit = tuple(_float(v) for v in self.time_step_limit)
        self.layers_block_type = ["mamba"] * self.num_hidden_layers  # nemotron_h's layers

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            self.hidden_size, self.num_heads, self.head_dim, self.n_groups, self.state_size,
            self.conv_kernel, self.use_conv_bias, self.use_bias, self.layer_norm_epsilon,
            self.time_step_limit,
        )  # fmt: skip

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each layer's state of one sequence (Mamba2Shape.state_shapes)."""
        return dict.fromkeys(range(self.num_hidden_layers), self.mamba_shape().state_shapes())

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: none."""
        return []


class Body(nn.Module):
    """The embedding, the layers (Nemotron-H's x + mixer(norm(x)), every mixer Mamba-2)
    and the final norm, under their Hugging Face names (embeddings, norm_f)."""

    def __init__(
        self, args: ModelArgs, attention: None, mlp: None, layer: type, norm: None
    ) -> None:
        """`attention`, `mlp`, `norm`: None (CausalLM's arguments; Mamba-2 has none)."""
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm_f = RMSNorm(args.hidden_size, args.layer_norm_epsilon)

    @property
    def embed_tokens(self) -> nn.Module:
        """The embedding, under the name CausalLM and the loader read."""
        return self.embeddings

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.norm_f


class WithoutAttention(CausalLM):
    """A CausalLM none of whose layers attend: its frames carry the positions alone (no
    mask, no RoPE tables)."""

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        return Frame(positions, start, length, None, None, None)


class Model(Hybrid, WithoutAttention):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, None, None, nemotron_h.DecoderLayer, body=Body)

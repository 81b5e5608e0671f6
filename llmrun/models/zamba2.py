"""Zyphra Zamba2 (Zamba2-1.2B, 2.7B, 7B; Zamba2ForCausalLM): a stack of Mamba-2 layers,
each x + mamba(norm(x)), some of them "hybrid": before its Mamba-2 mixer such a layer
runs a shared transformer block on the concatenation [x, the token embeddings] and
adds linear(block output) to the mixer's input (not to the residual).

The shared blocks (num_mem_blocks of them, taken in turn by the hybrid layers) are an
RMSNorm over 2 * hidden_size, attention of heads 2 * hidden_size / num_attention_heads
wide scored by (head_dim / 2)^-0.5 (RoPE where use_mem_rope), then RMSNorm and a gated
MLP (gelu by default), with no residual inside. Each hybrid layer adds its own low-rank
adapters to the block's gate_up_proj (and, with use_shared_attention_adapter, to q, k
and v): adapter lists indexed by the hybrid layer's rank, nn.Identity where another
block owns the slot. Each hybrid layer keeps its own keys and values; every layer
keeps a Mamba-2 state (granitemoehybrid.Mamba2Mixer, its convolution always biased, its
gated norm's eps 1e-5, time steps clamped below at time_step_min as transformers'
chunked scan clamps them; its one-token step does not clamp, where this model does).

Reference: transformers/models/zamba2/modeling_zamba2.py. Parameter names are its keys;
a shared block is registered once, at the first hybrid layer that runs it (as
save_pretrained writes it; llmrun/loading/zamba2.py drops the Hub's copies at the others).
Zamba (v1) has this layout with Mamba-1 layers: llmrun/models/zamba.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    Hybrid,
    RMSNorm,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend_scaled,
    head_logits,
)
from llmrun.models.cache import KVCache
from llmrun.models.granitemoehybrid import Mamba2Mixer, Mamba2Shape

MAMBA, HYBRID = "mamba", "hybrid"
# config.json's layer kinds (transformers 5's and the Hub's older names) -> ours.
LAYER_KINDS = {"linear_attention": MAMBA, "mamba": MAMBA, "hybrid": HYBRID}
GATED_NORM_EPS = 1e-5  # Zamba2RMSNormGated's, whatever the config says
LONG_CONTEXT_POSITIONS = 16384  # Zamba2Config's max_position_embeddings with use_long_context


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each layer's kind ("mamba" or "hybrid") from config.json's layers_block_type (or
    layer_types), or Zamba2Config's default 54-layer pattern where it lists none."""
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if kinds is None:
        kinds = (
            [MAMBA] + ([MAMBA] * 5 + [HYBRID]) * 7 + [MAMBA] * 4 + [HYBRID]
            + [MAMBA] * 3 + [HYBRID] + [MAMBA] * 2
        )  # fmt: skip
    unknown = sorted({str(k) for k in kinds if k not in LAYER_KINDS})
    if unknown:
        raise UnsupportedError(
            f"Zamba2 layer types {unknown} are not supported (supported: {', '.join(LAYER_KINDS)})"
        )
    return [LAYER_KINDS[k] for k in kinds]


@dataclass
class ModelArgs:
    hidden_size: int = 2560
    vocab_size: int = 32000
    layers_block_type: list[str] | None = None
    intermediate_size: int | None = None  # None: 4 * hidden_size
    hidden_act: str = "gelu"
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    use_mem_rope: bool = False
    use_long_context: bool = False
    max_position_embeddings: int = 4096
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_ngroups: int = 1
    n_mamba_heads: int = 8
    time_step_min: float = 0.001
    add_bias_linear: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers_block_type = layer_kinds({"layers_block_type": self.layers_block_type})
        self.intermediate_size = self.intermediate_size or 4 * self.hidden_size
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.act = activation(self.hidden_act)
        if self.use_long_context:
            self.max_position_embeddings = LONG_CONTEXT_POSITIONS
        width = 2 * self.hidden_size  # the attention's input: [x, embeddings]
        if width % self.num_attention_heads:
            raise ModelFormatError(
                f"Zamba2's attention width {width} (2 * hidden_size) does not split into "
                f"{self.num_attention_heads} heads"
            )
        if (
            self.use_shared_attention_adapter
            and self.num_key_value_heads != self.num_attention_heads
        ):
            raise ModelFormatError(
                "Zamba2's key and value adapters need as many key/value heads as heads "
                f"({self.num_key_value_heads} and {self.num_attention_heads})"
            )
        inner = self.mamba_expand * self.hidden_size
        if inner % self.n_mamba_heads or self.n_mamba_heads % self.mamba_ngroups:
            raise ModelFormatError(
                f"Zamba2's {self.n_mamba_heads} Mamba-2 heads do not fit an inner size of "
                f"{inner} (mamba_expand * hidden_size) in {self.mamba_ngroups} groups"
            )
        if self.num_mem_blocks < 1:
            raise ModelFormatError(
                f"num_mem_blocks is {self.num_mem_blocks}; Zamba2 needs 1 or more"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("layers_block_type") is None and config.get("layer_types") is not None:
            config = {**config, "layers_block_type": config["layer_types"]}
        return args_from_config(cls, config)

    @property
    def num_hidden_layers(self) -> int:
        """The layer pattern's length (Zamba2Model builds its layers from it)."""
        return len(self.layers_block_type)

    @property
    def head_dim(self) -> int:
        return 2 * self.hidden_size // self.num_attention_heads

    @property
    def attention_layers(self) -> list[int]:
        """The hybrid layers' indices: each keeps its own keys and values, in order."""
        return [i for i, kind in enumerate(self.layers_block_type) if kind == HYBRID]

    def mamba_shape(self) -> Mamba2Shape:
        inner = self.mamba_expand * self.hidden_size
        return Mamba2Shape(
            self.hidden_size, self.n_mamba_heads, inner // self.n_mamba_heads,
            self.mamba_ngroups, self.mamba_d_state, self.mamba_d_conv, True,
            self.add_bias_linear, GATED_NORM_EPS, (self.time_step_min, float("inf")),
        )  # fmt: skip

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Every layer's Mamba-2 state of one sequence (Mamba2Shape.state_shapes)."""
        return dict.fromkeys(range(self.num_hidden_layers), self.mamba_shape().state_shapes())

    def layer_windows(self) -> list[None]:
        """One entry per KV cache layer: the hybrid layers, all full."""
        return [None] * len(self.attention_layers)


def _adapters(args: ModelArgs, block: int, width: int, out: int) -> nn.ModuleList:
    """One low-rank adapter (width -> adapter_rank -> out) per hybrid layer that runs
    `block`, at its rank among the hybrid layers; nn.Identity in the other slots."""
    hybrids = len(args.attention_layers)
    return nn.ModuleList(
        nn.Sequential(
            nn.Linear(width, args.adapter_rank, bias=False),
            nn.Linear(args.adapter_rank, out, bias=False),
        )
        if i % args.num_mem_blocks == block
        else nn.Identity()
        for i in range(hybrids)
    )


class Attention(nn.Module):
    """Attention over [x, embeddings] (2 * hidden_size wide), heads scored by
    (head_dim / 2)^-0.5, with the hybrid layer's adapters on q, k and v."""

    def __init__(self, args: ModelArgs, block: int) -> None:
        super().__init__()
        width, self.head_dim = 2 * args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.rope = args.use_mem_rope
        self.scale = (self.head_dim / 2) ** -0.5
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        if args.use_shared_attention_adapter:
            self.linear_q_adapter_list = _adapters(args, block, width, width)
            self.linear_k_adapter_list = _adapters(args, block, width, width)
            self.linear_v_adapter_list = _adapters(args, block, width, width)

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, rank: int
    ) -> torch.Tensor:
        """`rank`: the hybrid layer's among them, its KV cache layer and its adapters'."""
        batch, tokens, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "linear_q_adapter_list"):
            q = q + self.linear_q_adapter_list[rank](x)
            k = k + self.linear_k_adapter_list[rank](x)
            v = v + self.linear_v_adapter_list[rank](x)
        # [B, T, H*D] -> [B, H, T, D]
        q = q.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend_scaled(q, k, v, rank, frame, cache, self.scale))


class MLP(nn.Module):
    """down_proj(act(gate) * up), gate and up from gate_up_proj plus the hybrid layer's
    adapter."""

    def __init__(self, args: ModelArgs, block: int) -> None:
        super().__init__()
        width, bias = 2 * args.intermediate_size, args.add_bias_linear
        self.act = args.act
        self.gate_up_proj = nn.Linear(args.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=bias)
        self.gate_up_proj_adapter_list = _adapters(args, block, args.hidden_size, width)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[rank](x)).chunk(2, -1)
        return self.down_proj(self.act(gate) * up)


class SharedTransformer(nn.Module):
    """feed_forward(pre_ff_layernorm(self_attn(input_layernorm([x, embeddings])))):
    no residual inside."""

    def __init__(self, args: ModelArgs, block: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(2 * args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, block)
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = MLP(args, block)

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, rank: int
    ) -> torch.Tensor:
        """`rank`: the calling hybrid layer's among them."""
        h = self.input_layernorm(torch.cat((x, frame.embeddings), dim=-1))
        h = self.self_attn(h, frame, cache, rank)
        return self.feed_forward(self.pre_ff_layernorm(h), rank)


class MambaLayer(nn.Module):
    """x + mamba(input_layernorm(x + added)): `added`, a hybrid layer's block output;
    `mixer`, the layer's Mamba-2 (Zamba's: Mamba-1) mixer."""

    def __init__(self, args: ModelArgs, mixer: nn.Module) -> None:
        super().__init__()
        self.mamba = mixer
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        frame: Frame,
        cache: KVCache | None,
        added: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x if added is None else x + added)
        return x + self.mamba(h, frame, cache)


class HybridLayer(nn.Module):
    """The shared block's output through `linear`, added to the Mamba-2 layer's input."""

    def __init__(self, args: ModelArgs, layer: int, block: SharedTransformer, first: bool) -> None:
        """`first`: whether this is the first hybrid layer to run `block`, which then
        registers it (the others hold it unregistered: one copy of its weights)."""
        super().__init__()
        self.rank = args.attention_layers.index(layer)
        self.linear = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.mamba_decoder = MambaLayer(args, Mamba2Mixer(args.mamba_shape(), layer))
        if first:
            self.shared_transformer = block
        self.block = (block,)  # a tuple: not a submodule, so not a second set of weights

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        block = self.block[0](x, frame, cache, self.rank)
        return self.mamba_decoder(x, frame, cache, self.linear(block))


class Body(nn.Module):
    """The embedding, the layers (each shared block built once and handed to its hybrid
    layers in turn), the final norm under its Hugging Face name (final_layernorm) and the
    RoPE tables of the attention's heads."""

    def __init__(
        self, args: ModelArgs, attention: None, mlp: None, layer: None, norm: None
    ) -> None:
        """`attention`, `mlp`, `layer`, `norm`: None (CausalLM's arguments)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        blocks = [SharedTransformer(args, b) for b in range(args.num_mem_blocks)]
        layers: list[nn.Module] = []
        for i, kind in enumerate(args.layers_block_type):
            if kind == MAMBA:
                layers.append(MambaLayer(args, Mamba2Mixer(args.mamba_shape(), i)))
                continue
            rank = args.attention_layers.index(i)
            block = rank % args.num_mem_blocks
            layers.append(HybridLayer(args, i, blocks[block], first=rank == block))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
            args.head_dim,
            args.max_position_embeddings,
        )

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.final_layernorm


class Model(Hybrid, CausalLM):
    body_type: type[nn.Module] = Body  # Zamba's (llmrun/models/zamba.py) is its own

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, None, None, None, body=self.body_type)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (CausalLM.forward's); the frame carries the token
        embeddings, the shared blocks' second input."""
        x = self.embed(input_ids)
        frame = self.frame(positions, cache, x.dtype, last)
        frame.embeddings = x
        return head_logits(self, x, frame, cache, last_only, last).float()

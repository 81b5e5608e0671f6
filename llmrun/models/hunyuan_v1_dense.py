"""Hunyuan dense (Tencent Hunyuan 0.5B to 7B; llama.cpp's "hunyuan-dense" GGUFs): Llama
with an RMSNorm over each query and key head applied after RoPE (query_layernorm,
key_layernorm), and NTK-alpha RoPE: rope_type "dynamic" with an `alpha` stretches the
base once, to rope_theta * alpha^(head_dim / (head_dim - 2)), whatever the length.

HunYuan-VL's (HunyuanOCR's) language model is this one; a forward with its images turns by
XD-RoPE (rope_parameters' mrope_section, one size per axis): a head's rotated pairs cut
into runs of `size` pairs, run i turned by axis i's position, both halves of a pair by the
same axis. The last three axes take an image token's column, row and image index, the
others its place (llmrun.hunyuan_vl_images); text turns by its place on every axis, plain
RoPE. That is Tencent's own code (its HunYuan-VL modeling file and training code repeat
the list, `xdrope_section * 2`, before splitting the cos/sin of the whole head), vLLM's
XDRotaryEmbedding (written by the HunYuan team) and llama.cpp's M-RoPE; transformers 5.25
doubles each size instead (`section * 2`), which turns a pair's two halves by different
axes, so the tests compare against transformers with Tencent's split restored.

Reference: transformers/models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py;
transformers/models/hunyuan_vl/modeling_hunyuan_vl.py (HunYuanVLRotaryEmbedding,
HunYuanVLModel.get_rope_index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ModelFormatError
from llmrun.models import llama
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend,
    head_logits,
)
from llmrun.models.cache import KVCache
from llmrun.models.mrope import MRopeImages


@dataclass
class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, ntk_alpha_as_base(config))


def ntk_alpha_as_base(config: dict[str, Any]) -> dict[str, Any]:
    """The config with NTK-alpha RoPE (rope_type "dynamic" and an alpha) written as the
    plain RoPE of the stretched base it is; any other config as it is."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    alpha = params.get("alpha")
    if kind != "dynamic" or not alpha:
        return config
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": theta * alpha ** (dim / (dim - 2))}
    if params.get("mrope_section"):
        rope["mrope_section"] = params["mrope_section"]
    plain = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")}
    return {**plain, "rope_parameters": rope}


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.query_layernorm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # Normalized after the rotation, each head on its own.
        q = self.query_layernorm(frame.rotate(q))
        k = self.key_layernorm(frame.rotate(k))
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


def xd_rope_angles(
    rotary: RotaryEmbedding, rope: torch.Tensor, sections: Sequence[int], capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [B, T, rotary_dim] (as RotaryEmbedding gives them) of the
    positions rope [4, B, T] (place, column, row, image index): the pairs of run i
    (sections[i] pairs, both halves) turned by axis i, the last three axes by column, row
    and image index, any before them by the place (the module's docstring)."""
    if len(sections) < 3 or 2 * sum(sections) != rotary.rotary_dim:
        raise ModelFormatError(
            f"mrope_section {list(sections)} does not cut a head's {rotary.rotary_dim} "
            "features into three or more XD-RoPE axes"
        )
    turned = [rotary(rope[row], capacity) for row in range(4)]
    rows = torch.tensor([0] * (len(sections) - 3) + [1, 2, 3])
    row_of_pair = torch.repeat_interleave(rows, torch.tensor(list(sections)))
    row_of = torch.cat([row_of_pair, row_of_pair]).to(rope.device)
    out = []
    for part in (0, 1):  # cos, sin
        stacked = torch.stack([t[part] for t in turned])  # [4, B, T, rotary_dim]
        out.append(stacked.gather(0, row_of.expand(1, *stacked.shape[1:]))[0])
    return out[0], out[1]


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: MRopeImages | None = None,
    ) -> torch.Tensor:
        """CausalLM.forward; `images` (HunYuan-VL's, one row): the image tokens in place of
        their placeholders, the forward turned by XD-RoPE at their positions."""
        if images is None:
            return super().forward(input_ids, positions, cache, last_only, last, static)
        sections = self.args.rope_parameters.get("mrope_section")
        if not sections:
            raise ModelFormatError("images for a language model without XD-RoPE sections")
        x = images.place(self.embed(input_ids.masked_fill(images.groups >= 0, 0)))
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        capacity = cache.max_seq_len if cache is not None else None
        rope = images.rope.to(positions.device)[:, None]  # [4, 1, T]
        cos, sin = xd_rope_angles(self.model.rotary_emb, rope, sections, capacity)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        frame = dataclasses.replace(
            frame, cos=cos[:, None].to(x.dtype), sin=sin[:, None].to(x.dtype)
        )
        return head_logits(self, x, frame, cache, last_only, last).float()

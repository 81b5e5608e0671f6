"""ERNIE 4.5 VL's language model (baidu/ERNIE-4.5-VL-28B-A3B-PT and -Thinking,
Ernie4_5_VLMoeTextModel): ERNIE 4.5's attention (RoPE on adjacent pairs) with experts
apart by modality: in its "sparse" layers (mlp_layer_types) a text router and experts for
text tokens, a vision router and (narrower) experts for the image tokens and the
<|IMAGE_START|>/<|IMAGE_END|> around them, ERNIE 4.5 MoE's routing for each (softmax, a
per-expert bias for the choice, the chosen weights renormalized), shared experts on every
token. A prompt's images and the text after them turn by 3D RoPE: of the pairs of a head's
first mrope_section[0] + [1] ones, the even by the height position and the odd by the
width, the last mrope_section[2] by the time, each at its own frequency; text alone turns
as plain RoPE. Decoded tokens are text (transformers' generate routes them so).

Reference: transformers/models/ernie4_5_vl_moe/modular_ernie4_5_vl_moe.py
(Ernie4_5_VLMoeTextRotaryEmbedding, Ernie4_5_VLMoeMoeBlock, Ernie4_5_VLMoeTextModel).
Parameter names are the Hub checkpoints' (mlp.gate.weight [hidden, experts] for text,
.weight_1 for vision; mlp.moe_statics.e_score_correction_bias, one row each; the text
experts, then the vision ones, as mlp.experts.N), which transformers splits when it loads
them and save_pretrained writes back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import ernie4_5, mrope
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    head_logits,
    mix_experts,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(ernie4_5.ModelArgs):
    # Ernie4_5_VLMoeTextConfig's defaults (no head_dim of its own: hidden / heads).
    head_dim: int | None = None
    moe_intermediate_size: list[int] = field(default_factory=lambda: [1536, 512])
    moe_num_experts: int = 64
    moe_k: int = 6
    moe_num_shared_experts: int = 2
    moe_norm_min: float = 1e-12
    mlp_layer_types: list[str] | None = None
    # The ids that route to the vision experts beside the image tokens (the outer config's
    # image_start_token_id and image_end_token_id).
    vision_marker_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (self.num_hidden_layers - 1)
        if len(self.mlp_layer_types) != self.num_hidden_layers or not set(self.mlp_layer_types) <= {
            "dense",
            "sparse",
        }:
            raise ModelFormatError(
                f"mlp_layer_types {self.mlp_layer_types!r}: not dense or sparse for each of "
                f"the {self.num_hidden_layers} layers"
            )
        if isinstance(self.moe_intermediate_size, int):
            self.moe_intermediate_size = [self.moe_intermediate_size] * 2
        if len(self.moe_intermediate_size) != 2:
            raise ModelFormatError(
                f"moe_intermediate_size {self.moe_intermediate_size!r}: not the text and the "
                "vision experts' widths"
            )
        sections = self.rope_parameters.get("mrope_section", [22, 22, 20])
        if len(sections) != 3 or sections[0] != sections[1] or sum(sections) != self.head_dim // 2:
            raise ModelFormatError(
                f"ERNIE 4.5 VL's mrope_section {sections!r} is not a height and a width section "
                f"as long as each other and a time section, of the {self.head_dim // 2} rotated "
                "pairs of a head"
            )
        self.rope_parameters["mrope_section"] = list(sections)


class Gate(nn.Module):
    """The routers' matrices, [hidden, experts] as the checkpoints hold them: the text
    experts' (weight) and the vision experts' (weight_1)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, experts))
        self.weight_1 = nn.Parameter(torch.empty(hidden, experts))


class Statics(nn.Module):
    """The routers' per-expert selection biases [2, experts]: text's, then vision's."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(2, experts))


class MoeBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.norm_min = (
            args.moe_num_experts,
            args.moe_k,
            args.moe_norm_min,
        )
        self.gate = Gate(args.hidden_size, args.moe_num_experts)
        self.moe_statics = Statics(args.moe_num_experts)
        # The experts have no biases, whatever use_bias says (the shared ones follow it).
        widths = [w for w in args.moe_intermediate_size for _ in range(args.moe_num_experts)]
        self.experts = nn.ModuleList(
            GatedMLP(dataclasses.replace(args, intermediate_size=w, use_bias=False)) for w in widths
        )
        shared = args.moe_intermediate_size[0] * args.moe_num_shared_experts
        self.shared_experts = (
            GatedMLP(dataclasses.replace(args, intermediate_size=shared)) if shared else None
        )

    def routed(self, x: torch.Tensor, modality: int) -> torch.Tensor:
        """x [N, D] through the text (modality 0) or the vision (1) router and experts."""
        weight = self.gate.weight if modality == 0 else self.gate.weight_1
        probs = torch.softmax(x.float() @ weight.float(), dim=-1, dtype=torch.float32)
        bias = self.moe_statics.e_score_correction_bias[modality].float()
        indices = torch.topk(probs + bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        first = modality * self.n_experts
        experts = self.experts[first : first + self.n_experts]
        return mix_experts(x, weights.to(x.dtype), indices, experts)

    def forward(self, x: torch.Tensor, vision: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, D]; `vision` [B, T]: the tokens for the vision experts (None: none)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [B, T, D] -> [N, D]
        if vision is None:
            out = self.routed(flat, 0)
        else:
            rows = vision.reshape(-1)
            out = torch.empty_like(flat)
            out[~rows] = self.routed(flat[~rows], 0)
            out[rows] = self.routed(flat[rows], 1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


@dataclass
class ModalFrame(Frame):
    """A Frame with the tokens [B, T] that go to the vision experts."""

    vision: torch.Tensor | None = None


class Layer(nn.Module):
    """ERNIE 4.5's pre-norm layer, its MLP the modality experts where mlp_layer_types
    says sparse."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.sparse = args.mlp_layer_types[layer] == "sparse"
        self.mlp = MoeBlock(args) if self.sparse else mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        normed = self.post_attention_layernorm(x)
        if self.sparse:
            return x + self.mlp(normed, getattr(frame, "vision", None))
        return x + self.mlp(normed)


def angles(
    rotary: RotaryEmbedding, rope: torch.Tensor, sections: list[int], capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [B, T, rotary_dim] (as RotaryEmbedding gives them, pair i
    at i and i + rotary_dim / 2) of the positions rope [3, B, T] (time, height, width):
    pair i < sections[0] + sections[1] turned by the height if even, the width if odd, the
    others by the time (Ernie4_5_VLMoeTextRotaryEmbedding's pre-rotated frequencies)."""
    half = rotary.rotary_dim // 2
    spatial = sections[0] + sections[1]
    pair = torch.arange(half)
    axis = torch.where(pair < spatial, 1 + pair % 2, torch.zeros_like(pair))
    axis = torch.cat([axis, axis]).to(rope.device)
    turned = [rotary(rope[a], capacity) for a in range(3)]
    out = []
    for part in (0, 1):  # cos, sin
        stacked = torch.stack([t[part] for t in turned])  # [3, B, T, rotary_dim]
        out.append(stacked.gather(0, axis.expand(1, *stacked.shape[1:]))[0])
    return out[0], out[1]


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, ernie4_5.Attention, GatedMLP, Layer)
        self.vision_markers = tuple(args.vision_marker_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: mrope.MRopeImages | None = None,
    ) -> torch.Tensor:
        """CausalLM.forward; `images` (one row) in place of their placeholders, which with
        the text after them turn by 3D RoPE. The image tokens and, in a prompt (more than
        one token a row), the image markers go to the vision experts."""
        vision = None
        if images is not None or input_ids.shape[1] > 1:
            markers = torch.tensor(self.vision_markers, dtype=input_ids.dtype)
            vision = torch.isin(input_ids, markers.to(input_ids.device))
            if images is not None:
                vision = vision | (images.groups >= 0).to(vision.device)[None]
        rope = (
            mrope.rope_positions(positions, cache, images) if mrope.shifted(cache, images) else None
        )
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed_at(input_ids, positions)
        if images is not None:
            x = images.place(x)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        if rope is not None:
            rotary = self.model.rotary_emb
            capacity = cache.max_seq_len if cache is not None else None
            if images is None:  # text after images: every axis at the same shifted position
                cos, sin = rotary(rope[0], capacity)
            else:
                sections = self.args.rope_parameters["mrope_section"]
                cos, sin = angles(rotary, rope, sections, capacity)
            # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
            frame = dataclasses.replace(
                frame, cos=cos[:, None].to(x.dtype), sin=sin[:, None].to(x.dtype)
            )
        if vision is not None and bool(vision.any()):
            fields = {f.name: getattr(frame, f.name) for f in dataclasses.fields(frame)}
            frame = ModalFrame(**fields, vision=vision)
        return head_logits(self, x, frame, cache, last_only, last).float()

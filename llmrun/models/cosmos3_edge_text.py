"""Cosmos3 Edge's language model (nvidia/Cosmos3-Edge, Cosmos3EdgeTextModel): Llama's
attention and RMSNorms with an ungated MLP, down(relu(up(x))^2) (CLIP's two projections,
no biases: Nemotron's), turned by Qwen3-VL's interleaved M-RoPE. Text alone turns as
plain RoPE (every section of a text token's position is the same); a prompt's images and
the text after them turn by their (time, height, width) positions (llmrun.models.mrope).

Reference: transformers/models/cosmos3_edge/modular_cosmos3_edge.py (Cosmos3EdgeTextModel,
Cosmos3EdgeTextMLP; Cosmos3EdgeTextRotaryEmbedding is Qwen3VLTextRotaryEmbedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import ModelFormatError
from llmrun.models import llama, mrope, nemotron
from llmrun.models.base import CausalLM, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(llama.ModelArgs):
    hidden_act: str = nemotron.RELU2
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        sections = self.rope_parameters.get("mrope_section")
        if not sections or len(sections) != 3 or sum(sections) != self.head_dim // 2:
            raise ModelFormatError(
                f"Cosmos3 Edge's rope_parameters.mrope_section {sections!r} is not three "
                f"sections of the {self.head_dim // 2} rotated pairs of a head"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, llama.Attention, nemotron.MLP)

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
        the text after them turn by interleaved M-RoPE."""
        rope = (
            mrope.rope_positions(positions, cache, images) if mrope.shifted(cache, images) else None
        )
        if rope is None:
            return super().forward(input_ids, positions, cache, last_only, last, static, images)
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        if images is not None:
            x = images.place(x)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        return mrope.forward(self, x, frame, rope, cache, images, True, last_only, last)

"""PaddleOCR-VL's language model (PaddleOCRTextModel; llama.cpp's "paddleocr" GGUFs):
ERNIE 4.5's layers and defaults, but RoPE on the halves of each head (Llama's, where
ERNIE 4.5 turns adjacent pairs), and prompts with images turn by M-RoPE (llmrun.models.
mrope; rope_parameters' mrope_section, in blocks over the halves, as Qwen2-VL's).

Reference: transformers/models/paddleocr_vl/modeling_paddleocr_vl.py (PaddleOCRTextModel,
PaddleOCRRotaryEmbedding, PaddleOCRAttention).
"""

from __future__ import annotations

import torch

from llmrun.models import ernie4_5, llama, mrope
from llmrun.models.base import CausalLM, GatedMLP
from llmrun.models.cache import KVCache

ModelArgs = ernie4_5.ModelArgs


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, llama.Attention, GatedMLP)

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
        """CausalLM.forward; `images`: the image tokens (one row) in place of their
        placeholders, which with the text after them turn by M-RoPE."""
        sections = self.args.rope_parameters.get("mrope_section")
        shifted = sections and mrope.shifted(cache, images)
        rope = mrope.rope_positions(positions, cache, images) if shifted else None
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
        return mrope.forward(self, x, frame, rope, cache, images, False, last_only, last)

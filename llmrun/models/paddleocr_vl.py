"""PaddleOCR-VL's language model (PaddleOCRTextModel; llama.cpp's "paddleocr" GGUFs):
ERNIE 4.5's layers and defaults, but RoPE on the halves of each head (Llama's, where
ERNIE 4.5 turns adjacent pairs), and prompts with images turn by M-RoPE (llmrun.models.
mrope; rope_parameters' mrope_section, in blocks over the halves, as Qwen2-VL's).

Reference: transformers/models/paddleocr_vl/modeling_paddleocr_vl.py (PaddleOCRTextModel,
PaddleOCRRotaryEmbedding, PaddleOCRAttention).
"""

from __future__ import annotations

from llmrun.models import ernie4_5, llama, mrope
from llmrun.models.base import GatedMLP

ModelArgs = ernie4_5.ModelArgs


class Model(mrope.MRopeLM):
    interleaved = False  # the sections in blocks over the halves, as Qwen2-VL's

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, llama.Attention, GatedMLP)

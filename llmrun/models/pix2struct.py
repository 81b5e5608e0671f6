"""Pix2Struct's text decoder (Pix2StructTextModel, the decoder of google/pix2struct-*):
T5's decoder (llmrun.models.t5: RMS norms, unscaled attention with the first layer's
causal relative-position bias for every layer, cross-attention to the image's patch
states, a gated feed-forward), an untied output head by default and no output scaling.

The image encoder (llmrun.models.pix2struct_vision) runs as a vision family's encoder
(llmrun.pix2struct_images); `encode` takes its states as the source and `decoding(encoded)`
is the decoder bound to them, which llmrun.text_to_text drives as it drives T5's. The
checkpoints' names (decoder.layer.N.self_attention.attention.query, ...) are renamed to
T5's at the loader edge (llmrun.loading.pix2struct).

Reference: transformers/models/pix2struct/modeling_pix2struct.py (Pix2StructTextModel,
Pix2StructTextBlock, Pix2StructTextAttention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmrun.errors import UsageError
from llmrun.models import t5

ModelArgs = t5.ModelArgs


class Model(nn.Module):
    """T5's decoder, its embedding (`shared`) and head, under T5's names."""

    text_to_text = True  # generated through llmrun.text_to_text, not the batching scheduler

    _buckets = t5.Model._buckets
    cross_cache = t5.Model.cross_cache
    decoding = t5.Model.decoding
    new_cache = t5.Model.new_cache

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.decoder = t5.Stack(args, args.num_decoder_layers, decoder=True)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def encode(self, input_ids: torch.Tensor, images: Any = None) -> torch.Tensor:
        """The source [1, patches, d_model]: the one image's patch states (`input_ids` holds
        its placeholder, llmrun.pix2struct_images)."""
        if images is None or len(images.embeds) != 1:
            raise UsageError("Pix2Struct reads one image: give it one (--image)")
        return images.embeds[0][None].to(self.lm_head.weight)  # its device, dtype

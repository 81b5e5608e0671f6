"""GOT-OCR 2.0's image encoder: square images [N, 3, S, S] -> their tokens
[N, (S / 64)^2, text hidden].

SAM's ViT-B with its neck (llmrun.models.deepseek_ocr2_vision.Sam: windowed attention with
decomposed relative positions, global in a few layers), whose two stride-2 convolutions
(HF's multi_modal_projector.conv_upsampler1 and 2) widen the grid's features to twice the
neck's and then to the language model's width; each cell of the 16x-downsampled grid, row
after row, projected linearly, is one token.

Reference: transformers/models/got_ocr2/modeling_got_ocr2.py (GotOcr2VisionEncoder,
GotOcr2MultiModalProjector, GotOcr2Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models.deepseek_ocr2_vision import Sam, SamArgs


@dataclass
class EncoderArgs:
    sam: SamArgs  # its downsample_channels: twice the neck's, then text_hidden_size
    text_hidden_size: int


class ImageEncoder(nn.Module):
    """SAM with the widening convolutions, and the linear projector."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.sam = Sam(args.sam)
        self.projector = nn.Linear(args.text_hidden_size, args.text_hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, S, S] -> their tokens [N, (S / 64)^2, text hidden]."""
        return self.projector(self.sam(pixels).flatten(2).transpose(1, 2))

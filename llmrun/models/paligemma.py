"""PaliGemma 2's language model: Gemma 2 whose prompt (the image tokens, BOS, the prefix
text and its "\\n") attends both ways while the answer attends causally, the prefix-LM of
transformers' PaliGemmaModel (token_type_ids 0 over the prompt, generated tokens 1). Its
positions count from 1 there (position_ids + 1) and from 0 here: RoPE sees only their
differences, which are the same.

Reference: transformers/models/paligemma/modeling_paligemma.py.
"""

from __future__ import annotations

from llmrun.models import gemma2
from llmrun.models.base import Frame
from llmrun.models.gemma3 import ImageTokens

ModelArgs = gemma2.ModelArgs


class Model(gemma2.Model):
    """Gemma 2 with PaliGemma's prefix attention, with HF's module names. `images`: the
    prompt's embeddings (its image tokens', its text's from embed():
    llmrun.paligemma_images) in place of its tokens, all of them one group seen both ways
    (one row)."""

    def unmask(self, images: ImageTokens, frames: dict[str, Frame]) -> dict[str, Frame]:
        # The prompt sees itself whole on sliding layers too: transformers' sliding mask
        # or the prompt's block, not and.
        return images.unmask(frames, None)

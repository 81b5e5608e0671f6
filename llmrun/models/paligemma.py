"""PaliGemma 2's language model: Gemma 2 whose prompt (the image tokens, BOS, the prefix
text and its "\\n") attends both ways while the answer attends causally, the prefix-LM of
transformers' PaliGemmaModel (token_type_ids 0 over the prompt, generated tokens 1). Its
positions count from 1 there (position_ids + 1) and from 0 here: RoPE sees only their
differences, which are the same.

Reference: transformers/models/paligemma/modeling_paligemma.py.
"""

from __future__ import annotations

import torch

from llmrun.models import gemma2
from llmrun.models.base import head_logits
from llmrun.models.cache import KVCache
from llmrun.models.gemma3 import ImageTokens

ModelArgs = gemma2.ModelArgs


class Model(gemma2.Model):
    """Gemma 2 with PaliGemma's prefix attention, with HF's module names."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        images: ImageTokens | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T]; [B, 1,
        vocab] with last_only or `last`. `images`: the prompt's embeddings (its image
        tokens', its text's from embed(): llmrun.paligemma_images) in place of its tokens,
        all of them one group seen both ways (one row)."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed(input_ids)
        frames = self.frames(positions, cache, x.dtype, last)
        if images is not None:
            x = images.place(x)
            # The prompt sees itself whole on sliding layers too: transformers' sliding
            # mask or the prompt's block, not and.
            frames = images.unmask(frames, None)
        logits = head_logits(self, x, frames, cache, last_only, last)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, hidden] of input_ids [B, T], scaled by sqrt(hidden)
        rounded to the compute dtype, as transformers does (an image's are not scaled)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)

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

from llmrun.errors import ModelFormatError
from llmrun.models import llama, mrope, nemotron
from llmrun.models.base import args_from_config


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


class Model(mrope.MRopeLM):
    interleaved = True  # Qwen3-VL's sections

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, llama.Attention, nemotron.MLP)

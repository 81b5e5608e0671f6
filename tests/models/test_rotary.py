"""RoPE's cos/sin (llmrun.models.base.RotaryEmbedding): a decoding sequence's next
position is read from a table of positions computed at once, which must hold exactly
the values the position computed on its own gets, across the table's ends, for every
kind of RoPE, and follow the module's buffers when they change."""

import pytest
import torch

from llmrun.models import base
from llmrun.models.base import RotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "partial": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_a_decoded_position_gets_what_it_gets_on_its_own(kind):
    rope = RotaryEmbedding(ROPES[kind], 128, 32768)
    span = base.ROPE_TABLE
    for p in [0, 1, span - 1, span, span + 1, 3 * span + 7, 5, 20000]:  # ends, and back
        positions = torch.tensor([[p]])
        cos, sin = rope(positions)
        expected_cos, expected_sin = rope._angles(positions)
        assert cos.shape == expected_cos.shape == (1, 1, rope.rotary_dim)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
        prompt_cos, _ = rope._angles(torch.arange(p + 1)[None])
        assert torch.equal(cos[0, 0], prompt_cos[0, p])  # as a prompt's last position


def test_the_table_follows_the_module_to_another_dtype():
    rope = RotaryEmbedding(ROPES["default"], 64, 4096)
    rope(torch.tensor([[3]]))
    rope.to(torch.bfloat16)
    cos, _ = rope(torch.tensor([[3]]))
    assert torch.equal(cos, rope._angles(torch.tensor([[3]]))[0])

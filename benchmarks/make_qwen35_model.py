"""Write a random-weight Qwen3.5-shaped hybrid as a Q8_0 GGUF, for timing the Gated
DeltaNet layers against llama.cpp on the same file.

hidden 1024, 24 layers (three Gated DeltaNet layers to each gated-attention one), 8
query heads of 256 and 2 KV heads with a quarter of each rotated, DeltaNet heads of 128
(16 key, 16 value), a short convolution of 4, FFN 3584: the layer stack of a model of
about 0.7B weights. The vocabulary is the bundled stories260K's 512 tokens (the file is
written by the tests' GGUF writer, tests/models/test_qwen3_5.py), so the output matrix
is small: the figures time the layers, not a 248k-row head.

    PYTHONPATH=. python benchmarks/make_qwen35_model.py [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

SHAPE = dict(
    vocab_size=512,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args()
    import test_qwen3_5
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE)).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "qwen35-shaped-Q8_0.gguf"
    test_qwen3_5.write_qwen35_gguf(path, model, GGMLQuantizationType.Q8_0)
    print(path)


if __name__ == "__main__":
    main()

"""llama.cpp itself answers about images with the Qwen3-VL files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_qwen3_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Qwen3VLForConditionalGeneration
(tests/qwen3_vl_helpers.py: interleaved M-RoPE, one deepstack layer), with an mmproj GGUF
laid out as llama.cpp's converter writes it. This is the llama.cpp half: the model's
folder goes through llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj
--outtype f32), whose tower must equal the tests' mmproj's tensor for tensor; the text
GGUF is written by the tests' gguf-py writer (arch qwen3vl; the converter's text path
does not know stories260K's pre-tokenizer). `DIR/llama-server -m model.gguf --mmproj
mmproj.gguf` (f32 KV cache, no flash attention) answers /completion with the image as
multimodal_data (llama_cpp_qwen_vision.compare). Images are sent at sizes that are
multiples of 32 with at least 65536 pixels (the Hub processor's least, which llmrun
gives an mmproj) and at most 4096 tokens (llama.cpp's most), so that neither resizes them
(llama.cpp's bicubic is not Pillow's). Per image: the 8 greedy tokens of each engine, how
many agree, and the largest difference of the chosen tokens' log-probabilities. Results
go to --out (benchmarks/out/llama_cpp_qwen3_vision.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_cpp_qwen_vision import compare_family  # noqa: E402
from llama_server_compare import arguments  # noqa: E402
from qwen3_vl_helpers import (  # noqa: E402
    save_qwen3_vl_dir,
    tiny_qwen3_vl,
    write_qwen3_mmproj,
    write_qwen3_text_gguf,
)

OUT = ROOT / "benchmarks" / "out"
# (height, width, seed): 64, 80 and 108 merged tokens.
IMAGES = [(256, 256, 1), (256, 320, 2), (288, 384, 3)]


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_qwen3_vision.json")
    from llmrun.loading.qwen3_vl_vision import from_mmproj

    work = OUT / "qwen3_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_qwen3_vl()
    folder = save_qwen3_vl_dir(model, work / "hf")
    tests_mmproj = write_qwen3_mmproj(model, work / "mmproj-tests.gguf")
    text = write_qwen3_text_gguf(model, work / "model.gguf")
    results = compare_family(args, folder, tests_mmproj, text, from_mmproj, IMAGES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

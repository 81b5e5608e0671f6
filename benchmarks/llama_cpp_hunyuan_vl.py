"""llama.cpp itself answers about images with the HunYuan-VL (HunyuanOCR) files the image
tests use, as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_hunyuan_vl.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random HunYuanVLForConditionalGeneration
(tests/hunyuan_vl_helpers.py), loading the mmproj that llama.cpp's converter writes. This
is the llama.cpp half: the model's folder goes through llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32); the text GGUF is written by the
tests' gguf-py writer (arch hunyuan_vl). `DIR/llama-server -m model.gguf --mmproj
mmproj.gguf` (f32 KV cache, no flash attention) answers /completion with the image as
multimodal_data; mtmd puts the image start and end tokens around the image's tokens
itself, which is the chat template's layout. Images are sent at sizes that are multiples
of 32 within both engines' pixel limits, so that neither resizes them. Two variants of
the model's XD-RoPE sections: the tests' [1, 3, 2, 2] and [2, 3, 3, 0]. Both engines give
each section's rotated pairs (both halves) to its axis, as Tencent's own code does
(llmrun.models.hunyuan_v1_dense's docstring); measured (2026-12-06): 8/8 greedy tokens
agree in every case, log-probabilities within 6e-3. (Before llmrun left transformers
5.25's split, which gives a pair's halves to different axes, 0 to 5 of 8 agreed.) Per
variant and image:
the 8 greedy tokens of each engine, how many agree, and the largest difference of the
chosen tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_hunyuan_vl.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from hunyuan_vl_helpers import (  # noqa: E402
    END,
    PAD,
    START,
    save_hunyuan_vl_dir,
    tiny_hunyuan_vl,
    write_text_gguf,
)
from llama_cpp_qwen_vision import TOKENS, compare  # noqa: E402
from llama_server_compare import LlamaServer, arguments, convert, describe  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
# (height, width, seed): 2x3, 3x3 and 5x7 merged patches (10, 14 and 42 tokens).
IMAGES = [(64, 96, 1), (96, 96, 2), (160, 224, 3)]
VARIANTS = {"four-axis": [1, 3, 2, 2], "empty-fourth": [2, 3, 3, 0]}


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_hunyuan_vl.json")
    from llmrun import api

    results = []
    for variant, sections in VARIANTS.items():
        work = OUT / "hunyuan_vl" / variant
        work.mkdir(parents=True, exist_ok=True)
        model = tiny_hunyuan_vl(sections=sections)
        folder = save_hunyuan_vl_dir(model, work / "hf")
        options = ("--mmproj", "--outtype", "f32")
        mmproj = convert(args.converter, folder, work / "mmproj.gguf", *options)
        text = write_text_gguf(model, work / "model.gguf")
        engine = api.load(str(text), device="cpu", mmproj=mmproj)
        with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
            for height, width, seed in IMAGES:
                image = picture(height, width, seed)
                record = compare(engine, server, image, START + PAD + END)
                record.update(variant=variant, image=f"{width}x{height}")
                results.append(record)
                print(f"{variant} {width}x{height}: {describe(record, TOKENS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

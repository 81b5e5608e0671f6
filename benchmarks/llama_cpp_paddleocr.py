"""llama.cpp itself answers about images with the PaddleOCR-VL files the image tests use,
as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_paddleocr.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random PaddleOCRVLForConditionalGeneration
(tests/paddleocr_vl_helpers.py), with an mmproj GGUF laid out as llama.cpp's converter
writes it. This is the llama.cpp half: the model's folder (its vision_config naming
PaddleOCRVisionModel, as the Hub's does, for the converter to find it) goes through
llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj --outtype f32), whose tower
must equal the tests' mmproj's tensor for tensor; the text GGUF is written by the tests'
gguf-py writer (arch paddleocr). `DIR/llama-server -m model.gguf --mmproj mmproj.gguf`
(f32 KV cache, no flash attention) answers /completion with the image as
multimodal_data; mtmd puts <|IMAGE_START|> and <|IMAGE_END|> around the image's tokens
itself, which is the chat template's layout. Images are sent at sizes that are multiples
of 28 within both engines' pixel limits (the tests' 4 to 60 merged tokens), so that
neither resizes them (llama.cpp's bicubic is not Pillow's). Per image: the 8 greedy tokens
of each engine, how many agree, and the largest difference of the chosen tokens'
log-probabilities. Results go to --out (benchmarks/out/llama_cpp_paddleocr.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_cpp_qwen_vision import compare_family  # noqa: E402
from llama_server_compare import arguments  # noqa: E402
from paddleocr_vl_helpers import (  # noqa: E402
    save_paddleocr_vl_dir,
    tiny_paddleocr_vl,
    write_mmproj,
    write_text_gguf,
)

OUT = ROOT / "benchmarks" / "out"
PLACE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
# (height, width, seed): 12, 36 and 40 merged tokens.
IMAGES = [(112, 84, 1), (168, 168, 2), (140, 224, 3)]


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_paddleocr.json")
    from llmrun.loading.paddleocr_vl_vision import from_mmproj

    work = OUT / "paddleocr"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_paddleocr_vl()
    folder = save_paddleocr_vl_dir(model, work / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["architectures"] = ["PaddleOCRVisionModel"]
    (folder / "config.json").write_text(json.dumps(config))
    tests_mmproj = write_mmproj(model, work / "mmproj-tests.gguf")
    text = write_text_gguf(model, work / "model.gguf")
    results = compare_family(args, folder, tests_mmproj, text, from_mmproj, IMAGES, PLACE)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

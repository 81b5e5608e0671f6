"""llama.cpp itself answers about images with the EXAONE 4.5 files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_exaone4_5.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Exaone4_5_ForConditionalGeneration
(tests/exaone4_5_helpers.py), loading the mmproj that llama.cpp's converter writes. This
is the llama.cpp half: the model's folder goes through llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32); the text GGUF is the tests' (arch
exaone4, ending with a multi-token-prediction layer, which both engines skip).
`DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash attention)
answers /completion with the image as multimodal_data; mtmd puts <vision> and </vision>
around the image's tokens itself, so the chat template's <vision><|image_pad|></vision>
is replaced by the server's media marker. Images are sent at sizes that are multiples of
28 within both engines' pixel limits, so that neither resizes them; two of them span
several of the tower's 112-pixel windows. Measured (2026-12-06): 8/8 greedy tokens agree
on each of the 3 images, the same prompt lengths, log-probabilities within 1.5e-3. Per
image: the 8 greedy tokens of each engine, how many agree, and the largest difference of
the chosen tokens' log-probabilities.
Results go to --out (benchmarks/out/llama_cpp_exaone4_5.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from exaone4_5_helpers import save_exaone4_5_dir, tiny_exaone4_5, write_text_gguf  # noqa: E402
from llama_cpp_qwen_vision import TOKENS, compare  # noqa: E402
from llama_server_compare import LlamaServer, arguments, convert, describe  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<vision><|image_pad|></vision>"
# (height, width, seed): 2x3, 5x6 (four windows) and 6x8 (four windows) merged patches.
IMAGES = [(56, 84, 1), (140, 168, 2), (168, 224, 3)]


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_exaone4_5.json")
    from llmrun import api

    work = OUT / "exaone4_5"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_exaone4_5()
    folder = save_exaone4_5_dir(model, work / "hf")
    mmproj = convert(args.converter, folder, work / "mmproj.gguf", "--mmproj", "--outtype", "f32")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for height, width, seed in IMAGES:
            record = compare(engine, server, picture(height, width, seed), PLACE)
            record.update(image=f"{width}x{height}")
            results.append(record)
            print(f"{width}x{height}: {describe(record, TOKENS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

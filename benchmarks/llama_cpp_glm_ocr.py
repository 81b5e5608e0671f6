"""llama.cpp itself answers about images with the GLM-OCR files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_glm_ocr.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random GlmOcrForConditionalGeneration
(tests/glm4v_helpers.py tiny_glm4v(kind="GlmOcr")), with an mmproj GGUF laid out as
llama.cpp's converter writes it. This is the llama.cpp half, as
benchmarks/llama_cpp_glm4v_vision.py's: the model's folder goes through llama.cpp's own
converter (SRC/convert_hf_to_gguf.py --mmproj --outtype f32, conversion/qwen3vl.py
Glm4VVisionModel: projector glm4v, per-head attn_q_norm / attn_k_norm, no learned
positions), whose tower must equal the tests' mmproj's tensor for tensor; the text GGUF is
written by the tests' gguf-py writer (arch glm4 with rope sections, an MTP layer last as
conversion/glm.py GlmOCRModel keeps it; the converter's text path does not know
stories260K's pre-tokenizer). `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32
KV cache, no flash attention) answers /completion with the image as multimodal_data.
Images are sent at sizes that are multiples of 28, so that neither engine resizes them.
Per image: the 8 greedy tokens of each engine, how many agree, and the largest difference
of the chosen tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_glm_ocr.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from glm4v_helpers import save_glm4v_dir, tiny_glm4v, write_mmproj, write_text_gguf  # noqa: E402
from llama_cpp_qwen_vision import compare_family  # noqa: E402
from llama_server_compare import arguments  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<|begin_of_image|><|image|><|end_of_image|>"
# (height, width, seed): 64, 96 and 140 merged tokens.
IMAGES = [(224, 224, 1), (224, 336, 2), (280, 392, 3)]


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_glm_ocr.json")
    from llmrun.loading.glm4v_vision import from_mmproj

    work = OUT / "glm_ocr"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_glm4v(kind="GlmOcr")
    folder = save_glm4v_dir(model, work / "hf")
    tests_mmproj = write_mmproj(model, work / "mmproj-tests.gguf")
    text = write_text_gguf(model, work / "model.gguf", mtp=True)
    results = compare_family(args, folder, tests_mmproj, text, from_mmproj, IMAGES, PLACE)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

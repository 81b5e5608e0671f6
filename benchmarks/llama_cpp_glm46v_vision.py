"""llama.cpp itself answers about images with the GLM-4.6V (glm46v) files the image tests
use, as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_glm46v_vision.py --llama-cpp DIR --converter SRC [--out FILE]

tests/models/test_glm46v_vision.py holds llmrun to transformers on a tiny random
Glm46VForConditionalGeneration (GLM-4.1V's text). llama.cpp's converter refuses that
architecture (checked first here, recorded as `refused`); with config.json's
`architectures` set to Glm4vForConditionalGeneration it converts the folder as GLM-4.1V's
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32), whose tower must equal the tests'
mmproj's tensor for tensor. The text GGUF is the tests' (benchmarks/llama_cpp_glm4v_vision.py
says why); llama-server answers as there (llama_cpp_qwen_vision.compare_family). Per image:
the 8 greedy tokens of each engine, how many agree, and the largest difference of the
chosen tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_glm46v_vision.json).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from glm4v_helpers import save_glm4v_dir, tiny_glm4v, write_mmproj, write_text_gguf  # noqa: E402
from llama_cpp_qwen_vision import compare_family  # noqa: E402
from llama_server_compare import arguments, convert  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<|begin_of_image|><|image|><|end_of_image|>"
# (height, width, seed): 64, 96 and 140 merged tokens.
IMAGES = [(224, 224, 1), (224, 336, 2), (280, 392, 3)]


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_glm46v_vision.json")
    from llmrun.loading.glm4v_vision import from_mmproj

    work = OUT / "glm46v_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_glm4v(kind="Glm46V")
    folder = save_glm4v_dir(model, work / "hf")
    try:
        convert(args.converter, folder, work / "refused.gguf", "--mmproj", "--outtype", "f32")
        refused = False
    except subprocess.CalledProcessError:
        refused = True
    print(f"the converter refuses Glm46VForConditionalGeneration: {refused}")
    as_glm4v = work / "hf-as-glm4v"
    shutil.rmtree(as_glm4v, ignore_errors=True)
    shutil.copytree(folder, as_glm4v)
    config = json.loads((as_glm4v / "config.json").read_text())
    config["architectures"] = ["Glm4vForConditionalGeneration"]
    (as_glm4v / "config.json").write_text(json.dumps(config))
    tests_mmproj = write_mmproj(model, work / "mmproj-tests.gguf")
    text = write_text_gguf(model, work / "model.gguf")
    results = compare_family(args, as_glm4v, tests_mmproj, text, from_mmproj, IMAGES, PLACE)
    for record in results:
        record["refused"] = refused
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

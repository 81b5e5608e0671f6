"""llama.cpp itself answers about images with the GLM-4.1V files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_glm4v_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Glm4vForConditionalGeneration
(tests/glm4v_helpers.py), with an mmproj GGUF laid out as llama.cpp's converter writes it.
This is the llama.cpp half: the model's folder goes through llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32), whose tower must equal the tests'
mmproj's tensor for tensor; the text GGUF is written by the tests' gguf-py writer (arch
glm4 with rope sections, the rotated q/k rows reordered as the converter does; the
converter's text path does not know stories260K's pre-tokenizer). `DIR/llama-server -m
model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash attention) answers /completion
with the image as multimodal_data (llama_cpp_qwen_vision.compare); mtmd puts
<|begin_of_image|> and <|end_of_image|> around the image's tokens itself, the chat
template's layout. Images are sent at sizes that are multiples of 28 within both engines'
pixel limits (llama.cpp's 8 to 4096 tokens), so that neither resizes them (llama.cpp's
bicubic is not Pillow's). Per image: the 8 greedy tokens of each engine, how many agree,
and the largest difference of the chosen tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_glm4v_vision.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from glm4v_helpers import save_glm4v_dir, tiny_glm4v, write_mmproj, write_text_gguf  # noqa: E402
from llama_cpp_qwen_vision import EXACT, TOKENS, compare  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<|begin_of_image|><|image|><|end_of_image|>"
# (height, width, seed): 64, 96 and 140 merged tokens.
IMAGES = [(224, 224, 1), (224, 336, 2), (280, 392, 3)]


def same_tower(ours: Path, converted: Path) -> bool:
    """Whether the converter's mmproj and the tests' give llmrun the same tower."""
    from llmrun.loading.glm4v_vision import from_mmproj

    a = from_mmproj(ours, 64).encoder.state_dict()
    b = from_mmproj(converted, 64).encoder.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_glm4v_vision.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "glm4v_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_glm4v()
    folder = save_glm4v_dir(model, work / "hf")
    mmproj = work / "mmproj.gguf"
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    subprocess.run(
        [*converter, "--mmproj", "--outtype", "f32", "--outfile", str(mmproj)],
        check=True,
        capture_output=True,
    )
    agrees = same_tower(write_mmproj(model, work / "mmproj-tests.gguf"), mmproj)
    print(f"the converter's mmproj gives the tests' tower: {agrees}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    server = Server(
        args.llama_cpp / "llama-server",
        text,
        work / "server.log",
        ("--mmproj", str(mmproj), *EXACT),
    )
    results = []
    try:
        # The server's own media marker (random unless LLAMA_MEDIA_MARKER pins it).
        url = f"http://127.0.0.1:{server.port}/props"
        with urllib.request.urlopen(url, timeout=10) as response:
            marker = json.loads(response.read())["media_marker"]
        for height, width, seed in IMAGES:
            record = compare(engine, server, marker, picture(height, width, seed), PLACE)
            record.update(image=f"{width}x{height}", converter=agrees)
            results.append(record)
            diff = record["max_abs_logprob_diff"]
            print(
                f"{width}x{height}: {record['tokens_agreeing']}/{TOKENS} greedy tokens agree, "
                f"|logprob diff| {diff if diff is None else f'{diff:.2e}'}, prompt tokens "
                f"{record['prompt_tokens_llmrun']} / {record['prompt_tokens_llama_cpp']}"
            )
    finally:
        server.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

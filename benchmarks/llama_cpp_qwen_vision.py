"""llama.cpp itself answers about images with the Qwen2.5-VL and Qwen2-VL files the image
tests use, as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_qwen_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on tiny random Qwen2_5_VLForConditionalGeneration
and Qwen2VLForConditionalGeneration models (tests/qwen2_vl_helpers.py), with an mmproj
GGUF laid out as llama.cpp's converter writes it. This is the llama.cpp half: the model's
folder goes through llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj
--outtype f32), whose tower must equal the tests' mmproj's tensor for tensor; the text
GGUF is written by the tests' gguf-py writer (arch qwen2vl). `DIR/llama-server -m
model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash attention) answers /completion
with the image as multimodal_data; mtmd puts <|vision_start|> and <|vision_end|> around
the image's tokens itself, which is the chat template's layout. Images are sent at sizes
that are multiples of 28 within both engines' pixel limits (llama.cpp's 8 to 4096
tokens), so that neither resizes them (llama.cpp's bicubic is not Pillow's). Per family
and image: the 8 greedy tokens of each engine, how many agree, and the largest difference
of the chosen tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_qwen_vision.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    describe,
    greedy_completion,
    llmrun_greedy,
    same_tower,
)
from qwen2_vl_helpers import (  # noqa: E402
    save_qwen_vl_dir,
    tiny_qwen_vl,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
PLACE = "<|vision_start|><|image_pad|><|vision_end|>"
TOKENS = 8
# (height, width, seed): 12, 36 and 40 merged tokens, one to four windows of Qwen2.5-VL's.
IMAGES = [(112, 84, 1), (168, 168, 2), (140, 224, 3)]


def compare(engine, server: LlamaServer, image: bytes, place: str = PLACE) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image and QUESTION; `place`: the
    chat template's image place, which the server's media marker replaces."""
    from llmrun.images import open_image

    text = engine.prompt_text(QUESTION, images=1)
    answer = greedy_completion(server, text.replace(place, server.media_marker), [image], TOKENS)
    ids, images = engine.image_prompt(text, [open_image(image)])
    return dict(
        **agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def compare_family(
    args: argparse.Namespace,
    folder: Path,
    tests_mmproj: Path,
    text: Path,
    from_mmproj,
    images: list[tuple[int, int, int]],
    place: str = PLACE,
    server_args: tuple[str, ...] = (),
    **labels: str,
) -> list[dict]:
    """llama.cpp's converter on the model's `folder` (an F32 mmproj beside it), whether it
    gives llmrun the tower of the tests' `tests_mmproj` (`from_mmproj`: the family's
    loader), then both engines' greedy tokens on the text GGUF `text` with it for each of
    `images` ((height, width, seed)), llama-server given `server_args` too; `labels` lead
    each record."""
    from llmrun import api

    work = folder.parent
    mmproj = convert(args.converter, folder, work / "mmproj.gguf", "--mmproj", "--outtype", "f32")
    agrees = same_tower(from_mmproj, tests_mmproj, mmproj)
    name = " ".join(labels.values())
    print(f"{name}{': ' if name else ''}the converter's mmproj gives the tests' tower: {agrees}")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    log = work / "server.log"
    with LlamaServer(args.llama_cpp, text, log, *server_args, mmproj=mmproj) as server:
        for height, width, seed in images:
            record = compare(engine, server, picture(height, width, seed), place)
            record.update(**labels, image=f"{width}x{height}", converter=agrees)
            results.append(record)
            print(f"{name} {width}x{height}: {describe(record, TOKENS)}".lstrip())
    return results


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_qwen_vision.json")
    from llmrun.loading.qwen2_vl_vision import from_mmproj

    results = []
    for family in ("qwen2_5_vl", "qwen2_vl"):
        work = OUT / "qwen_vision" / family
        work.mkdir(parents=True, exist_ok=True)
        model = tiny_qwen_vl(family)
        folder = save_qwen_vl_dir(model, work / "hf")
        tests_mmproj = write_mmproj(model, work / "mmproj-tests.gguf")
        text = write_text_gguf(model, work / "model.gguf")
        results += compare_family(
            args, folder, tests_mmproj, text, from_mmproj, IMAGES, family=family
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

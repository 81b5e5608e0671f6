"""llama.cpp itself answers about images with the Step 3.7 files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_step3p7.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Step3p7ForConditionalGeneration
(tests/step3p7_helpers.py). This is the llama.cpp half: its folder (config.json in
StepFun's names) goes through llama.cpp's own converter (SRC/convert_hf_to_gguf.py, the
text GGUF and the --mmproj, f32), run as the tests run it (tests/step3p7_helpers.py
CONVERT_TINY: its Step3-VL-10B shape assertions off, config.json read as it is), then
`DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash attention)
answers /completion with the image as multimodal_data and llmrun runs the same two files.
mtmd writes the crops' and the global view's markers itself, so the chat template's
<im_patch> is replaced by the server's media marker. Images: 112x112 (the global view as it
is: neither engine resizes it), 50x60 (upscaled to the view: llmrun resizes the uint8
pixels as transformers does, llama.cpp bilinearly on normalized floats), 150x130 (one
504-pixel local crop, smaller than the window: transformers stretches the image's 150x130
to it, mtmd pads it with black to 504x504) and 600x560 (one whole 504-pixel window, resized
from the image). Per image: the 8 greedy tokens of each engine, how many
agree, the largest difference of the chosen tokens' log-probabilities, and both prompt
lengths; then the same with llmrun resizing as llama.cpp does (mtmd's pixels bilinear on
floats, not antialiased, not rounded to uint8; clip.cpp's position table bilinear and
antialiased, transformers' not), which isolates the engines' other arithmetic.
Measured (2026-12-06, llama.cpp of llama-cpp-python 0.3.36): with transformers' resizing
8, 1, 0 and 7 of 8 greedy tokens agree; with llama.cpp's, 8, 8, 0 (the black padding) and
8 of 8, log-probabilities within 6e-4 where no crop is resized and 5e-2 on 600x560; equal
prompt lengths (35, 35, 118, 118) throughout.
Results go to --out (benchmarks/out/llama_cpp_step3p7.json).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch.nn.functional as F  # noqa: E402
from llama_cpp_qwen_vision import TOKENS, compare  # noqa: E402
from llama_server_compare import LlamaServer, arguments, describe  # noqa: E402
from muse_glimmer_helpers import run_converter  # noqa: E402
from step3p7_helpers import CONVERT_TINY, HUB_TEXT, save_folder, tiny_model  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<im_patch>"
IMAGES = [(112, 112, 1), (60, 50, 2), (130, 150, 3), (560, 600, 4)]  # height, width, seed


def resized_as_mtmd(pixels, width: int, height: int):
    """mtmd_image_preprocessor_step3vl's resize: bilinear on floats, no antialiasing."""
    if tuple(pixels.shape[2:]) == (height, width):
        return pixels
    return F.interpolate(pixels.float(), size=(height, width), mode="bilinear")


def positions_as_clip(table, side: int, rows: int, columns: int):
    """clip.cpp's resize_position_embeddings: bilinear, antialiased."""
    if (rows, columns) == (side, side):
        return table
    grid = table.view(1, side, side, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(rows, columns), mode="bilinear", antialias=True)
    return grid.permute(0, 2, 3, 1).reshape(rows * columns, -1)


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_step3p7.json")
    from llmrun import api, step3p7_images
    from llmrun.models import step3p7_vision

    work = OUT / "step3p7"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    folder = save_folder(tiny_model(), work / "hf")
    config = json.loads((folder / "config.json").read_text())
    config.update(text_config=HUB_TEXT, understand_projector_stride=2)
    (folder / "config.json").write_text(json.dumps(config))
    text, mmproj = work / "text.gguf", work / "mmproj.gguf"
    outputs = {text: "--outtype f32", mmproj: "--outtype f32 --mmproj"}
    run_converter(folder, outputs, args.converter / "convert_hf_to_gguf.py", CONVERT_TINY)
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for resizing in ("transformers'", "mtmd's"):
            if resizing == "mtmd's":
                step3p7_images._resized = resized_as_mtmd
                step3p7_vision.positions = positions_as_clip
            for height, width, seed in IMAGES:
                record = compare(engine, server, picture(height, width, seed), PLACE)
                record.update(image=f"{width}x{height}", llmrun_resizing=resizing)
                results.append(record)
                print(f"{width}x{height}, {resizing} resizing: {describe(record, TOKENS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

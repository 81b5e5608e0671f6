"""llama.cpp's converter and llama-server against llmrun on the tiny Janus-Pro model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_janus.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random JanusForConditionalGeneration
(tests/janus_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here, first, llama.cpp's own converter (SRC/convert_hf_to_gguf.py
--mmproj, its default F16) turns the model's folder into an mmproj GGUF: its metadata and
tensors are compared with write_mmproj's, name by name, bit for bit, and llmrun loads it.
Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with the image as multimodal_data, and llmrun gets the
same prompt: llama.cpp (mtmd.cpp) puts an image's tokens in place of its marker with
nothing around them, where JanusProcessor writes <begin_of_image> before and
<end_of_image> after, so the text sent to llama-server carries them around its marker
here. Per image: the greedy tokens of each engine (8, or up to an end token), how many
agree, the largest difference of the chosen tokens' log-probabilities. Five images are
32x32, the tower's size, which neither engine resizes or pads; two are not square, which
clip.cpp resizes with its sides rounded up and no min_size (mtmd-image.cpp img_tool::resize,
PAD_CEIL) where JanusImageProcessor rounds to nearest, raised to min_size: those are compared
again with clip.cpp's sizes put into llmrun's preprocessing. Results go to --out
(benchmarks/out/llama_cpp_janus.json).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from janus_helpers import (  # noqa: E402
    IMAGE_SIZE,
    save_janus_dir,
    tiny_janus,
    write_mmproj,
    write_text_gguf,
)
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    converter_agreement,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in the picture?"
IMAGE, IMAGE_START, IMAGE_END = "<image_placeholder>", "<begin_of_image>", "<end_of_image>"
TOKENS = 8
# (height, width, seed): five of the tower's size, two it resizes and pads (JanusImageProcessor
# with Pillow's bicubic filter; clip.cpp with its own, so their pixels differ slightly).
IMAGES = [*((IMAGE_SIZE, IMAGE_SIZE, seed) for seed in range(1, 6)), (20, 45, 6), (50, 27, 7)]


def compare(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = engine.render([{"role": "user", "content": content}])
    around = f"{IMAGE_START}{server.media_marker}{IMAGE_END}"
    answer = greedy_completion(server, text.replace(IMAGE, around), [data], TOKENS)
    ids, images = engine.image_prompt(text, [open_image(data)])
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer)
    record.update(
        image=f"{height}x{width} seed {seed}",
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )
    return record


def clip_cpp_pixels(image, vision):
    """janus_images.pixel_values with clip.cpp's sizes: each side scaled and rounded up,
    within the tower's square, no min_size."""
    from PIL import Image

    from llmrun.images import normalized

    side = vision.image_size
    scale = min(side / image.width, side / image.height)
    width = min(math.ceil(image.width * scale), side)
    height = min(math.ceil(image.height * scale), side)
    resized = image.resize((width, height), Image.Resampling.BICUBIC)
    square = Image.new("RGB", (side, side), vision.background)
    square.paste(resized, ((side - width) // 2, (side - height) // 2))
    return normalized(square, vision.mean, vision.std)


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_janus.json")
    from llmrun import api, janus_images

    work = OUT / "janus"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_janus()
    folder = save_janus_dir(model, work / "hf")
    converted = convert(args.converter, folder, work / "mmproj-converter.gguf", "--mmproj")
    layout = converter_agreement(converted, write_mmproj(model, work / "mmproj.gguf"))
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)  # llmrun reads the converter's
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=converted) as server:
        for height, width, seed in IMAGES:
            record = compare(engine, server, height, width, seed)
            results.append(record)
            print(f"{record['image']:>16}: {describe(record, TOKENS)}")
        janus_images.pixel_values = clip_cpp_pixels
        for height, width, seed in IMAGES:
            if height != width:
                record = compare(engine, server, height, width, seed)
                record["image"] += ", clip.cpp's sizes"
                results.append(record)
                print(f"{record['image']:>16}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(dict(converter=layout, greedy=results), indent=1))


if __name__ == "__main__":
    main()

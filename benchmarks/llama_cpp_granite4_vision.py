"""llama.cpp's converter and llama-server against llmrun on the tiny Granite 4 Vision model
the image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_granite4_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Granite4VisionForConditionalGeneration
(tests/granite4_vision_helpers.py), reading a text GGUF and an mmproj that the tests lay out
themselves (write_text_gguf, write_mmproj). Here, first, llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32, on the folder with the Hub's tower names)
turns the folder into an mmproj: its metadata and tensors are compared with write_mmproj's,
name by name, bit for bit, and llmrun loads it. Then `DIR/llama-server -m model.gguf
--mmproj mmproj.gguf` (f32 KV cache, no flash attention) answers /completion with the image
as multimodal_data and llmrun gets the same prompt. Per image: the greedy tokens of each
engine (8, or up to an end token), how many agree, the largest difference of the chosen
tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_granite4_vision.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from granite4_vision_helpers import (  # noqa: E402
    save_granite4_vision_dir,
    tiny_granite4_vision,
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
    hub_tower_names,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in the picture?"
IMAGE = "<image>"  # the chat template's image place
TOKENS = 8
# (height, width, seed): one pinpoint each (64x64, 64x32, 32x64) and the tower's square.
IMAGES = [(50, 90, 1), (100, 40, 2), (30, 70, 3), (32, 32, 4), (64, 64, 5)]


def compare(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = engine.render([{"role": "user", "content": content}])
    # mtmd.cpp puts a newline after an image's tokens itself, where the template writes one,
    # and tokenizes the text after it on its own: this SentencePiece vocabulary then puts a
    # space before that text, which llmrun's prompt is given too.
    marked = text.replace(IMAGE + "\n", server.media_marker)
    answer = greedy_completion(server, marked, [data], TOKENS)
    ids, images = engine.image_prompt(text.replace(IMAGE + "\n", IMAGE + "\n "), [open_image(data)])
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer)
    record.update(
        image=f"{height}x{width} seed {seed}",
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )
    return record


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_granite4_vision.json")
    from llmrun import api

    work = OUT / "granite4_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_granite4_vision()
    folder = save_granite4_vision_dir(model, work / "hf")
    hub_tower_names(folder, "model.vision_tower.")
    flags = ("--mmproj", "--outtype", "f32")
    converted = convert(args.converter, folder, work / "mmproj-converter.gguf", *flags)
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
    args.out.write_text(json.dumps(dict(converter=layout, greedy=results), indent=1))


if __name__ == "__main__":
    main()

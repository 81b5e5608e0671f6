"""llama.cpp itself answers about images with the Gemma 3 files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Gemma3ForConditionalGeneration
(tests/vision_helpers.py). This is the llama.cpp half: the model's folder, saved with
the Hub's key names, goes through llama.cpp's own converter (SRC/convert_hf_to_gguf.py
--mmproj, which forces the input projection to F16) for the mmproj GGUF; the text GGUF
is written by the tests' gguf-py writer (the converter's Gemma 3 text path needs a
SentencePiece tokenizer.model, which stories260K's vocabulary lacks). `DIR/llama-server
-m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash attention) answers /completion
with the image as multimodal_data; llmrun gets the same tokens: llama.cpp's image chunk
is <start_of_image>, the soft tokens, <end_of_image> with no newlines around it (tools/
mtmd/mtmd.cpp), where transformers' processor adds "\\n\\n" on both sides. Per image:
the 8 greedy tokens of each engine, how many agree, and the largest difference of the
chosen tokens' log-probabilities. Images of the encoder's size (64) are not resized by
either; others go through llama.cpp's own bilinear resize, which is not Pillow's.
Results go to --out (benchmarks/out/llama_cpp_vision.json).
"""

from __future__ import annotations

import io
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
    hub_tower_names,
    llmrun_greedy,
)
from PIL import Image  # noqa: E402
from vision_helpers import (  # noqa: E402
    picture,
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
    write_text_gguf,
)

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed) of each image; 64x64 is the encoder's own size.
IMAGES = [(64, 64, 1), (64, 64, 2), (64, 64, 3), (48, 80, 4), (200, 300, 5)]


def llmrun_ids(engine, marker_text: str) -> tuple[list[int], int]:
    """llama.cpp's layout of the prompt: the text before the image marker, <start_of_image>,
    the soft tokens, <end_of_image>, the rest; and where the soft tokens begin."""
    from llmrun.multimodal import IMAGE_END, IMAGE_SOFT, IMAGE_START

    before, after = marker_text.split("<__media__>")
    tokenizer = engine.tokenizer
    head = tokenizer.encode(before + IMAGE_START)
    soft = [tokenizer.token_id(IMAGE_SOFT)] * engine.vision.tokens_per_image
    tail = tokenizer.encode(IMAGE_END + after, add_bos=False)
    return head + soft + tail, len(head)


def resized(data: bytes, size: int) -> bytes:
    """The image resized to size x size as llmrun does it (Pillow, bilinear), as PNG."""
    from llmrun.images import open_image

    buffer = io.BytesIO()
    open_image(data).resize((size, size), Image.Resampling.BILINEAR).save(buffer, "PNG")
    return buffer.getvalue()


def cases() -> list[tuple[str, bytes, bytes]]:
    """(name, image, the image llama.cpp gets) for each of IMAGES: one not of the
    encoder's size goes as it is and, the same pixels for both, as Pillow resized it."""
    out = []
    for height, width, seed in IMAGES:
        data = picture(height, width, seed)
        out.append((f"{width}x{height}", data, data))
        if (height, width) != (64, 64):
            out.append((f"{width}x{height} resized", data, resized(data, 64)))
    return out


def compare(engine, server: LlamaServer, prompt: str, name: str, data: bytes, sent: bytes):
    """Greedy tokens of llmrun on the image `data` and of llama.cpp on `sent`."""
    from llmrun.images import open_image
    from llmrun.multimodal import PromptImages, encode

    marked = prompt.replace("<__media__>", server.media_marker)
    answer = greedy_completion(server, marked, [sent], TOKENS)
    ids, start = llmrun_ids(engine, prompt)
    images = PromptImages(encode(engine.vision, [open_image(data)]), [start])
    return dict(
        image=name,
        **agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_vision.json")
    from llmrun import api

    work = OUT / "vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma3_vl()
    folder = save_gemma3_vl_dir(model, work / "hf")
    hub_tower_names(folder, "vision_tower.")
    mmproj = convert(args.converter, folder, work / "mmproj.gguf", "--mmproj", "--outtype", "f32")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    prompt = f"<start_of_turn>user\n<__media__>{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for name, data, sent in cases():
            record = compare(engine, server, prompt, name, data, sent)
            results.append(record)
            print(f"{name:>16}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

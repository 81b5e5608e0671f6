"""llama.cpp's converter and llama-server against llmrun on the tiny Llama 4 model the image
tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_llama4_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Llama4ForConditionalGeneration
(tests/llama4_vision_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here the tower has 3 layers (the converter maps the adapter's fc2 only
below its block count): llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj
--outtype f32) turns the folder into an mmproj GGUF, compared with write_mmproj's name by
name, bit for bit. (Its gguf-py maps each layer's post_attention_layernorm to Gemma 4's
attn_post_norm, a name clip.cpp runs as another norm, where write_mmproj writes the ln2
clip.cpp reads; llama-server gets write_mmproj's, and the converter's file changes its
replies.) llmrun's logits for an
image prompt on the tests' text GGUF (arch llama4) and mmproj are compared with
transformers'.

Then `DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with each image as multimodal_data, and llmrun gets the
same chat prompt. They prepare images differently (llmrun follows transformers): llama.cpp
slices into at most 3x3 tiles as llava-uhd does, resizes with its own filter, writes no
tile separators and no <|image|> before the whole image's tokens, and its pixel shuffle
leaves each tile's tokens column by column. Per image: the 8 greedy tokens of each engine,
how many agree, and the prompt lengths. For images of one tile's size (which neither
resizes), llmrun is also given llama.cpp's layout (float32 pixels, no <|image|>, the tile's
tokens column by column), which isolates those differences; and a text-only prompt checks
that both run the text GGUF alike. Results go to --out
(benchmarks/out/llama_cpp_llama4_vision.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from llmrun import llama4_images

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama4_vision_helpers import (  # noqa: E402
    TILE,
    model_inputs,
    save_llama4_dir,
    tiny_llama4,
    write_mmproj,
    write_text_gguf,
)
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreeing,
    arguments,
    convert,
    converter_agreement,
    greedy_completion,
    image_logits_difference,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed): one tile exactly, smaller than a tile, then tiled ones.
IMAGES = [(84, 84, 1), (84, 84, 7), (60, 50, 2), (84, 168, 3), (200, 90, 4), (300, 300, 5)]


def llama_cpp_layout(engine, text: str, image) -> tuple[list[int], object]:
    """The prompt of a one-tile image (TILE pixels a side) as llama.cpp lays it out: float32
    pixels, <|image_start|>, the tile's tokens column by column, <|image_end|>."""
    from llmrun.images import normalized
    from llmrun.multimodal import PromptImages

    vision = engine.vision
    with torch.no_grad():
        tokens = vision.encoder(normalized(image, vision.mean, vision.std)[None])[0]
    side = round(len(tokens) ** 0.5)
    tokens = tokens.view(side, side, -1).transpose(0, 1).reshape(len(tokens), -1)
    start, patch, end = (llama4_images.START, llama4_images.PATCH, llama4_images.END)
    ids = engine.tokenizer.encode(text.replace("<|image|>", start + patch * len(tokens) + end))
    return ids, PromptImages([tokens], [ids.index(engine.tokenizer.token_id(patch))])


def compare(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    text = engine.prompt_text(QUESTION, images=1)
    prompt = text.replace("<|image|>", server.media_marker)
    answer = greedy_completion(server, prompt, [data], TOKENS, n_probs=0)
    theirs = answer["tokens"]
    ids, images = engine.image_prompt(text, [open_image(data)])
    ours, _ = llmrun_greedy(engine, ids, TOKENS, images)
    record = dict(
        image=f"{width}x{height} seed {seed}",
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agreeing(ours, theirs),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )
    if height == width == TILE:
        ids, images = llama_cpp_layout(engine, text, open_image(data))
        record["tokens_agreeing_in_llama_cpp_layout"] = agreeing(
            llmrun_greedy(engine, ids, TOKENS, images)[0], theirs
        )
    return record


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_llama4_vision.json")
    from llmrun import api
    from llmrun.images import open_image

    image = open_image(picture(200, 300, 6))  # for the logits against transformers'
    work = OUT / "llama4_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_llama4(vision_layers=3)
    folder = save_llama4_dir(model, work / "hf")
    converted = work / "mmproj-converter.gguf"
    convert(args.converter, folder, converted, "--mmproj", "--outtype", "f32")
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    layout = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "text.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    difference = image_logits_difference(model, engine, model_inputs, image, QUESTION)
    print(f"llmrun vs transformers, max |logit diff|: {difference:.2e}")
    results = []
    log = work / "server.log"
    with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=mmproj) as server:
        story = engine.prompt_text("Tell me a story.")
        ours, _ = llmrun_greedy(engine, engine.tokenizer.encode(story), TOKENS)
        text_only = agreeing(
            ours, greedy_completion(server, story, (), TOKENS, n_probs=0)["tokens"]
        )
        print(f"text only: {text_only}/{TOKENS} greedy tokens agree")
        for height, width, seed in IMAGES:
            record = compare(engine, server, height, width, seed)
            results.append(record)
            reordered = record.get("tokens_agreeing_in_llama_cpp_layout")
            print(
                f"{record['image']:>20}: {record['tokens_agreeing']}/{TOKENS} greedy tokens "
                f"agree, prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_cpp']}"
                + ("" if reordered is None else f"; in llama.cpp's layout {reordered}/{TOKENS}")
            )
    summary = dict(converter=layout, logits=difference, text_only=text_only, greedy=results)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

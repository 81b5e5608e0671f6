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

import argparse
import base64
import json
import subprocess
import sys
import urllib.request
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
from llama_cpp_pixtral import converter_agreement  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed): one tile exactly, smaller than a tile, then tiled ones.
IMAGES = [(84, 84, 1), (84, 84, 7), (60, 50, 2), (84, 168, 3), (200, 90, 4), (300, 300, 5)]


def greedy(engine, ids: list[int], images=None) -> list[int]:
    from llmrun.sampling import SamplingParams

    stream = engine.generate(ids, SamplingParams(temperature=0.0), TOKENS, images=images)
    return [r.token for r in stream if r.token is not None]


def agreeing(ours: list[int], theirs: list[int]) -> int:
    """How many greedy tokens agree from the start (an EOS llmrun stops at counts)."""
    pairs = zip(ours, theirs, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))


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


def completion(server, prompt, images: list[bytes] = ()) -> dict:
    if images:
        prompt = {
            "prompt_string": prompt,
            "multimodal_data": [base64.b64encode(data).decode() for data in images],
        }
    body = {"prompt": prompt, "n_predict": TOKENS, "temperature": 0, "top_k": 1}
    return server._post("/completion", {**body, "return_tokens": True, "cache_prompt": False})


def compare(engine, server, marker: str, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    text = engine.prompt_text(QUESTION, images=1)
    answer = completion(server, text.replace("<|image|>", marker), [data])
    theirs = answer["tokens"]
    ids, images = engine.image_prompt(text, [open_image(data)])
    ours = greedy(engine, ids, images)
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
            greedy(engine, ids, images), theirs
        )
    return record


def logit_difference(model, engine) -> float:
    """The largest |logit difference| of transformers and llmrun on the GGUFs (`engine`)
    for a prompt with a 200x300 image."""
    from llmrun.images import open_image

    image = open_image(picture(200, 300, 6))
    ids, images = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])
    tokens = images.tokens(0, len(ids), torch.device("cpu"))
    inputs = model_inputs(engine.vision, ids, [image])
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            cache=engine.model.new_cache(1, len(ids), torch.float32, "cpu"),
            images=tokens,
        )[0]
    return (ours - expected).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_llama4_vision.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "llama4_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_llama4(vision_layers=3)
    folder = save_llama4_dir(model, work / "hf")
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    converted = work / "mmproj-converter.gguf"
    subprocess.run(
        [*converter, "--mmproj", "--outtype", "f32", "--outfile", str(converted)], check=True
    )
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    agreement = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(agreement)}")
    text = write_text_gguf(model, work / "text.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    difference = logit_difference(model, engine)
    print(f"llmrun vs transformers, max |logit diff|: {difference:.2e}")
    server = Server(
        args.llama_cpp / "llama-server",
        text,
        work / "server.log",
        ("--mmproj", str(mmproj), "-c", "2048", *EXACT),
    )
    results = []
    try:
        # The server's own media marker (random unless LLAMA_MEDIA_MARKER pins it).
        url = f"http://127.0.0.1:{server.port}/props"
        with urllib.request.urlopen(url, timeout=10) as response:
            marker = json.loads(response.read())["media_marker"]
        story = engine.prompt_text("Tell me a story.")
        text_only = agreeing(
            greedy(engine, engine.tokenizer.encode(story)), completion(server, story)["tokens"]
        )
        print(f"text only: {text_only}/{TOKENS} greedy tokens agree")
        for height, width, seed in IMAGES:
            record = compare(engine, server, marker, height, width, seed)
            results.append(record)
            layout = record.get("tokens_agreeing_in_llama_cpp_layout")
            print(
                f"{record['image']:>20}: {record['tokens_agreeing']}/{TOKENS} greedy tokens "
                f"agree, prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_cpp']}"
                + ("" if layout is None else f"; in llama.cpp's layout {layout}/{TOKENS}")
            )
    finally:
        server.close()
    summary = dict(converter=agreement, logits=difference, text_only=text_only, greedy=results)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

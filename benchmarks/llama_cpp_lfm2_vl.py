"""llama.cpp's converter and llama-server against llmrun on the tiny LFM2-VL model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_lfm2_vl.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Lfm2VlForConditionalGeneration
(tests/lfm2_vl_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here the model has 3 tower layers (the converter maps the projector's
mm.2 only below its block count) and its folder the Hub's key names
(model.vision_tower.vision_model.*, which the converter expects; transformers 5 saves
model.vision_tower.*): llama.cpp's own converter (SRC/convert_hf_to_gguf.py) turns it
into an mmproj GGUF (--mmproj, its default F16), compared with write_mmproj's name by
name, bit for bit. (This converter refuses the text of Lfm2VlForConditionalGeneration;
the text GGUF is the tests' write_text_gguf, arch lfm2 as tests/models/test_lfm2.py lays
it out.) llmrun's logits for an image prompt on the text GGUF and an F32 mmproj are
compared with transformers'.

Then `DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with each image as multimodal_data, and llmrun gets the
same prompt with the same mmproj. Both take 64 to 256 tokens an image, but llama.cpp
resizes with its own (not antialiased) bilinear filter and slices large images its own
way (mtmd-image.h). Per image: the 8 greedy tokens of each
engine, how many agree, and the prompt lengths. Results go to --out
(benchmarks/out/llama_cpp_lfm2_vl.json).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from lfm2_vl_helpers import (  # noqa: E402
    model_inputs,
    save_lfm2_vl_dir,
    tiny_lfm2_vl,
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
# (height, width, seed): one frame each (256 x 256 is 64 tokens either way), then 2 x 2
# tiles of 512 pixels (256 tokens each) and a thumbnail.
IMAGES = [(256, 256, 1), (256, 384, 2), (40, 64, 3), (500, 300, 4), (800, 800, 5)]


def hub_layout(folder: Path) -> None:
    """Rename the folder's tower weights to the Hub's model.vision_tower.vision_model.*."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tower = "model.vision_tower."
    state = {
        (tower + "vision_model." + k[len(tower) :] if k.startswith(tower) else k): v
        for k, v in load_file(file).items()
    }
    save_file(state, file, metadata={"format": "pt"})


def compare(engine, server, marker: str, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image
    from llmrun.sampling import SamplingParams

    data = picture(height, width, seed)
    text = engine.prompt_text(QUESTION, images=1)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": text.replace("<image>", marker),
                "multimodal_data": [base64.b64encode(data).decode()],
            },
            "n_predict": TOKENS,
            "temperature": 0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
        },
    )
    theirs = answer["tokens"]
    ids, images = engine.image_prompt(text, [open_image(data)])
    stream = engine.generate(ids, SamplingParams(temperature=0.0), TOKENS, images=images)
    ours = [r.token for r in stream if r.token is not None]
    pairs = zip(ours, theirs, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
    return dict(
        image=f"{width}x{height} seed {seed}",
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agree,
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


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
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_lfm2_vl.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "lfm2_vl"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_lfm2_vl(vision_layers=3)
    folder = save_lfm2_vl_dir(model, work / "hf")
    hub_layout(folder)
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    mmproj = work / "mmproj-converter.gguf"
    subprocess.run([*converter, "--mmproj", "--outfile", str(mmproj)], check=True)
    agreement = converter_agreement(mmproj, write_mmproj(model, work / "mmproj.gguf"))
    print(f"converter vs write_mmproj: {json.dumps(agreement)}")
    text = write_text_gguf(model, work / "text.gguf")
    f32 = write_mmproj(model, work / "mmproj-f32.gguf", f16=False)
    difference = logit_difference(model, api.load(str(text), device="cpu", mmproj=f32))
    print(f"llmrun vs transformers, max |logit diff|: {difference:.2e}")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
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
        for height, width, seed in IMAGES:
            record = compare(engine, server, marker, height, width, seed)
            results.append(record)
            print(
                f"{record['image']:>20}: {record['tokens_agreeing']}/{TOKENS} greedy tokens "
                f"agree, prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_cpp']}"
            )
    finally:
        server.close()
    args.out.write_text(
        json.dumps(dict(converter=agreement, logits=difference, greedy=results), indent=1)
    )


if __name__ == "__main__":
    main()

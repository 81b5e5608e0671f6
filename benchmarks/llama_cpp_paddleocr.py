"""llama.cpp itself answers about images with the PaddleOCR-VL files the image tests use,
as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_paddleocr.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random PaddleOCRVLForConditionalGeneration
(tests/paddleocr_vl_helpers.py), with an mmproj GGUF laid out as llama.cpp's converter
writes it. This is the llama.cpp half: the model's folder (its vision_config naming
PaddleOCRVisionModel, as the Hub's does, for the converter to find it) goes through
llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj --outtype f32), whose tower
must equal the tests' mmproj's tensor for tensor; the text GGUF is written by the tests'
gguf-py writer (arch paddleocr). `DIR/llama-server -m model.gguf --mmproj mmproj.gguf`
(f32 KV cache, no flash attention) answers /completion with the image as
multimodal_data; mtmd puts <|IMAGE_START|> and <|IMAGE_END|> around the image's tokens
itself, which is the chat template's layout. Images are sent at sizes that are multiples
of 28 within both engines' pixel limits (the tests' 4 to 60 merged tokens), so that
neither resizes them (llama.cpp's bicubic is not Pillow's). Per image: the 8 greedy tokens
of each engine, how many agree, and the largest difference of the chosen tokens'
log-probabilities. Results go to --out (benchmarks/out/llama_cpp_paddleocr.json).
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from paddleocr_vl_helpers import (  # noqa: E402
    save_paddleocr_vl_dir,
    tiny_paddleocr_vl,
    write_mmproj,
    write_text_gguf,
)
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")
QUESTION = "What is in this picture?"
PLACE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
TOKENS = 8
# (height, width, seed): 12, 36 and 40 merged tokens.
IMAGES = [(112, 84, 1), (168, 168, 2), (140, 224, 3)]


def same_tower(ours: Path, converted: Path) -> bool:
    """Whether the converter's mmproj and the tests' give llmrun the same tower."""
    from llmrun.loading.paddleocr_vl_vision import from_mmproj

    a = from_mmproj(ours, 64).encoder.state_dict()
    b = from_mmproj(converted, 64).encoder.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def compare(engine, server, marker: str, image: bytes, place: str = PLACE) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image and QUESTION; `place`: the
    chat template's image place, which the server's media marker replaces."""
    from llmrun.images import open_image
    from llmrun.sampling import SamplingParams

    text = engine.prompt_text(QUESTION, images=1)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": text.replace(place, marker),
                "multimodal_data": [base64.b64encode(image).decode()],
            },
            "n_predict": TOKENS,
            "temperature": 0,
            "top_k": 1,
            "n_probs": 1,
            "return_tokens": True,
            "cache_prompt": False,
        },
    )
    theirs = answer["tokens"]
    ids, images = engine.image_prompt(text, [open_image(image)])
    stream = engine.generate(
        ids, SamplingParams(temperature=0.0), TOKENS, logprobs=0, images=images
    )
    chosen = [lp for r in stream for lp in r.logprobs]
    ours = [lp.token for lp in chosen]
    pairs = zip(ours, theirs, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
    # The server reports no probability for a token whose text is an incomplete UTF-8
    # character: its entries are matched to the agreeing tokens by id, in order.
    diffs, cursor = [], 0
    for entry in answer["completion_probabilities"]:
        while cursor < agree and ours[cursor] != entry["id"]:
            cursor += 1
        if cursor == agree:
            break
        diffs.append(abs(chosen[cursor].logprob - entry["logprob"]))
        cursor += 1
    return dict(
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agree,
        max_abs_logprob_diff=max(diffs, default=None),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_paddleocr.json")
    args = parser.parse_args()
    from llmrun import api

    results = []
    work = OUT / "paddleocr"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_paddleocr_vl()
    folder = save_paddleocr_vl_dir(model, work / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["architectures"] = ["PaddleOCRVisionModel"]
    (folder / "config.json").write_text(json.dumps(config))
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
    try:
        # The server's own media marker (random unless LLAMA_MEDIA_MARKER pins it).
        url = f"http://127.0.0.1:{server.port}/props"
        with urllib.request.urlopen(url, timeout=10) as response:
            marker = json.loads(response.read())["media_marker"]
        for height, width, seed in IMAGES:
            record = compare(engine, server, marker, picture(height, width, seed))
            record.update(image=f"{width}x{height}", converter=agrees)
            results.append(record)
            diff = record["max_abs_logprob_diff"]
            print(
                f"{width}x{height}: {record['tokens_agreeing']}/{TOKENS} greedy "
                f"tokens agree, |logprob diff| {diff if diff is None else f'{diff:.2e}'}, "
                f"prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_cpp']}"
            )
    finally:
        server.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

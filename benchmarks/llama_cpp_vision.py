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

import argparse
import base64
import io
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import (  # noqa: E402
    picture,
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
    write_text_gguf,
)

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed) of each image; 64x64 is the encoder's own size.
IMAGES = [(64, 64, 1), (64, 64, 2), (64, 64, 3), (48, 80, 4), (200, 300, 5)]


def hub_names(folder: Path) -> None:
    """Rename transformers 5's vision keys (vision_tower.embeddings...) to the Hub's
    (vision_tower.vision_model.embeddings...), the names the converter maps."""
    file = folder / "model.safetensors"
    state = load_file(file)
    prefix = "vision_tower."
    renamed = {
        (prefix + "vision_model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in state.items()
    }
    save_file(renamed, file, metadata={"format": "pt"})


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


def compare(engine, server, prompt: str, marker: str, name: str, data: bytes, sent: bytes):
    """Greedy tokens of llmrun on the image `data` and of llama.cpp on `sent`."""
    from llmrun.images import open_image
    from llmrun.multimodal import PromptImages, encode
    from llmrun.sampling import SamplingParams

    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": prompt.replace("<__media__>", marker),
                "multimodal_data": [base64.b64encode(sent).decode()],
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
    ids, start = llmrun_ids(engine, prompt)
    images = PromptImages(encode(engine.vision, [open_image(data)]), [start])
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
        image=name,
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
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_vision.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma3_vl()
    folder = save_gemma3_vl_dir(model, work / "hf")
    hub_names(folder)
    mmproj = work / "mmproj.gguf"
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    subprocess.run(
        [*converter, "--mmproj", "--outtype", "f32", "--outfile", str(mmproj)],
        check=True,
        capture_output=True,
    )
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    prompt = f"<start_of_turn>user\n<__media__>{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
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
            data = picture(height, width, seed)
            cases = [(f"{width}x{height}", data)]
            if (height, width) != (64, 64):
                # The same pixels for both: llama.cpp gets the image Pillow resized.
                cases.append((f"{width}x{height} resized", resized(data, 64)))
            for name, sent in cases:
                record = compare(engine, server, prompt, marker, name, data, sent)
                results.append(record)
                diff = record["max_abs_logprob_diff"]
                print(
                    f"{name:>16}: {record['tokens_agreeing']}/{TOKENS} greedy tokens agree, "
                    f"|logprob diff| {diff if diff is None else f'{diff:.2e}'}, prompt tokens "
                    f"{record['prompt_tokens_llmrun']} / {record['prompt_tokens_llama_cpp']}"
                )
    finally:
        server.close()
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""llama.cpp's converter and llama-server against llmrun on the tiny Mistral 3 (Pixtral
vision) model the image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_pixtral.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Mistral3ForConditionalGeneration
(tests/pixtral_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here, first, llama.cpp's own converter (SRC/convert_hf_to_gguf.py
--mmproj, its default F16) turns the model's folder into an mmproj GGUF: its metadata and
tensors are compared with write_mmproj's, name by name, bit for bit, and llmrun loads it.
(The tower has 3 layers here: the converter maps mm.2 only where there are 3 or more.)
Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with the image as multimodal_data, and llmrun gets the
same prompt: llama.cpp's image chunk is the rows of image tokens with an [IMG_BREAK]
embedding after each but the last, then the text [IMG_END], which is PixtralProcessor's
layout. Per image: the 8 greedy tokens of each engine, how many agree, the largest
difference of the chosen tokens' log-probabilities. The server reads write_mmproj's file
(today's converter leaves v.token_embd.img_break, which clip.cpp requires, out of an
mmproj made from a Hugging Face folder). Images are 84x84 (3x3 merged patches, llama.cpp's
8-token minimum met), which neither engine resizes. Results go to --out
(benchmarks/out/llama_cpp_pixtral.json).
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from pixtral_helpers import (  # noqa: E402
    save_mistral3_dir,
    tiny_mistral3,
    write_mmproj,
    write_text_gguf,
)
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")
QUESTION = "What is in this picture?"
TOKENS = 8
SEEDS = (1, 2, 3, 4, 5)


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """An mmproj's metadata (but general.*) and its tensors: name -> (type, shape, data)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith(("GGUF.", "general."))
    }
    tensors = {t.name: (t.tensor_type.name, list(t.shape), t.data) for t in reader.tensors}
    return meta, tensors


def converter_agreement(converted: Path, ours: Path) -> dict:
    """Where the converter's mmproj and write_mmproj's differ."""
    meta_a, tensors_a = gguf_contents(converted)
    meta_b, tensors_b = gguf_contents(ours)
    return dict(
        metadata_differing=sorted(
            k for k in meta_a.keys() | meta_b.keys() if meta_a.get(k) != meta_b.get(k)
        ),
        tensors_only_in_converter=sorted(tensors_a.keys() - tensors_b.keys()),
        tensors_only_in_write_mmproj=sorted(tensors_b.keys() - tensors_a.keys()),
        tensors_differing=sorted(
            name
            for name in tensors_a.keys() & tensors_b.keys()
            if tensors_a[name][:2] != tensors_b[name][:2]
            or not np.array_equal(tensors_a[name][2], tensors_b[name][2])
        ),
        tensors_compared=len(tensors_a.keys() & tensors_b.keys()),
    )


def compare(engine, server, marker: str, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one 84x84 image."""
    from llmrun.images import open_image
    from llmrun.sampling import SamplingParams

    data = picture(84, 84, seed)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": f"[INST]{marker}{QUESTION}[/INST]",
                "multimodal_data": [base64.b64encode(data).decode()],
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
    text = engine.prompt_text(QUESTION, images=1)
    ids, images = engine.image_prompt(text, [open_image(data)])
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
        image=f"84x84 seed {seed}",
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
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_pixtral.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "pixtral"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_mistral3(vision_layers=3)
    folder = save_mistral3_dir(model, work / "hf")
    converted = work / "mmproj-converter.gguf"
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    subprocess.run(
        [*converter, "--mmproj", "--outfile", str(converted)], check=True, capture_output=True
    )
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    agreement = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(agreement)}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)  # llmrun reads the converter's
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
        for seed in SEEDS:
            record = compare(engine, server, marker, seed)
            results.append(record)
            diff = record["max_abs_logprob_diff"]
            print(
                f"{record['image']:>16}: {record['tokens_agreeing']}/{TOKENS} greedy tokens "
                f"agree, |logprob diff| {diff if diff is None else f'{diff:.2e}'}, prompt "
                f"tokens {record['prompt_tokens_llmrun']} / {record['prompt_tokens_llama_cpp']}"
            )
    finally:
        server.close()
    args.out.write_text(json.dumps(dict(converter=agreement, greedy=results), indent=1))


if __name__ == "__main__":
    main()

"""llama.cpp itself answers about images with the Gemma 4 files the image tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_gemma4_vision.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Gemma4ForConditionalGeneration
(tests/gemma4_vision_helpers.py). This is the llama.cpp half: the model's folder goes
through llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj --outtype f32) for
the mmproj GGUF; the text GGUF is written by the tests' gguf-py writer (the converter's
Gemma 4 text path needs Gemma 4's own tokenizer, which stories260K's vocabulary is not).
`DIR/llama-server -m model.gguf --mmproj mmproj.gguf --image-max-tokens 280` (f32 KV
cache, no flash attention) answers /completion with the image as multimodal_data; both
lay the image out as <|image>, its soft tokens, <image|>. Each image fills the 280-token
budget exactly (sides multiples of 12 pixels), so neither engine resizes it. The
tests' own mmproj writer (write_mmproj) is checked against the converter's files (F32,
and its default F16): the same tensors, bytes and metadata.

Two models: "vision", the tests' one, whose image tokens see each other both ways on its
sliding layer only (transformers' use_bidirectional_attention "vision", which llmrun
follows), where llama.cpp decodes an image's batch non-causally on every layer
(mtmd_decode_use_non_causal, for all but E2B's and E4B's widths), its global layer too;
and "global-free", the same model with its global layer's attention output zeroed
(o_proj = 0) and a window of 512 (the whole prompt, so that the sliding layer carries the
image to the answer), where the two rules agree. Per image: the 8 greedy tokens of each
engine, how many agree, and the largest difference of the chosen tokens'
log-probabilities (llama.cpp's own arithmetic, its GELU read from an f16 table for one,
moves them by about 1e-3 wherever the image reaches the answer). Results go to --out
(benchmarks/out/llama_cpp_gemma4_vision.json).
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

from gemma4_vision_helpers import (  # noqa: E402
    save_gemma4_vl_dir,
    tiny_gemma4_vl,
    write_mmproj,
    write_text_gguf,
)
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")
BUDGET = ("--image-max-tokens", "280")
QUESTION = "What is in this picture?"
BOS = "<s>"  # stories260K's, as the tests' template writes it
TOKENS = 8
# (height, width, seed): 14x20, 20x14 and 10x28 tokens of 12 pixels, 280 each.
IMAGES = [(168, 240, 1), (240, 168, 2), (120, 336, 3)]
WIDE_WINDOW = 512  # the control's window: the whole prompt, so its last token sees the image


def compare(engine, server, marker: str, data: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on the image `data` and QUESTION."""
    from llmrun.images import open_image
    from llmrun.sampling import SamplingParams

    text = engine.prompt_text(QUESTION, images=1)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                # llama-server adds the BOS the template writes.
                "prompt_string": text.removeprefix(BOS).replace("<|image|>", marker),
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
    ids, images = engine.image_prompt(text, [open_image(data)])
    stream = engine.generate(ids, SamplingParams(temperature=0.0), TOKENS, logprobs=0,
                             images=images)  # fmt: skip
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


def layout_differences(converted: Path, written: Path) -> list[str]:
    """Where the tests' mmproj (write_mmproj) differs from the converter's: tensor names,
    shapes, types and bytes, and metadata but the converter's general.* naming."""
    import gguf
    import numpy as np

    ours, theirs = gguf.GGUFReader(written), gguf.GGUFReader(converted)
    differences = []
    a = {t.name: t for t in theirs.tensors}
    b = {t.name: t for t in ours.tensors}
    differences += [f"tensor {n} only in one" for n in sorted(set(a) ^ set(b))]
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        same = x.tensor_type == y.tensor_type and list(x.shape) == list(y.shape)
        if not (same and np.array_equal(np.asarray(x.data), np.asarray(y.data))):
            differences.append(f"tensor {name} differs")

    def meta(reader) -> dict:
        return {
            f.name: f.contents()
            for f in reader.fields.values()
            if not f.name.startswith(("GGUF.", "general."))
        }

    m, n = meta(theirs), meta(ours)
    differences += [f"metadata {k}" for k in sorted(set(m) | set(n)) if m.get(k) != n.get(k)]
    return differences


def run(name: str, model, args, work: Path) -> list[dict]:
    from llmrun import api

    folder = save_gemma4_vl_dir(model, work / name)
    mmproj = work / f"{name}-mmproj.gguf"
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    subprocess.run(
        [*converter, "--mmproj", "--outtype", "f32", "--outfile", str(mmproj)],
        check=True,
        capture_output=True,
    )
    differences = layout_differences(mmproj, write_mmproj(model, work / f"{name}-test.gguf"))
    f16 = work / f"{name}-mmproj-f16.gguf"  # the converter's default: F16 matrices
    subprocess.run([*converter, "--mmproj", "--outfile", str(f16)], check=True, capture_output=True)
    test_f16 = write_mmproj(model, work / f"{name}-test-f16.gguf", f16=True)
    differences += layout_differences(f16, test_f16)
    verdict = "equal the converter's"
    if differences:
        verdict = "differ from the converter's: " + ", ".join(differences)
    print(f"{name:>11}: the tests' mmproj files (F32, F16) {verdict}")
    text = write_text_gguf(model, work / f"{name}.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    server = Server(
        args.llama_cpp / "llama-server",
        text,
        work / f"{name}-server.log",
        ("--mmproj", str(mmproj), *EXACT, *BUDGET),
    )
    results = []
    try:
        # The server's own media marker (random unless LLAMA_MEDIA_MARKER pins it).
        url = f"http://127.0.0.1:{server.port}/props"
        with urllib.request.urlopen(url, timeout=10) as response:
            marker = json.loads(response.read())["media_marker"]
        for height, width, seed in IMAGES:
            record = {"model": name, "image": f"{width}x{height}"}
            record.update(compare(engine, server, marker, picture(height, width, seed)))
            results.append(record)
            diff = record["max_abs_logprob_diff"]
            print(
                f"{name:>11} {record['image']:>8}: {record['tokens_agreeing']}/{TOKENS} greedy "
                f"tokens agree, |logprob diff| {diff if diff is None else f'{diff:.2e}'}, "
                f"prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_cpp']}"
            )
    finally:
        server.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_gemma4_vision.json")
    args = parser.parse_args()
    work = OUT / "gemma4_vision"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma4_vl()
    results = run("vision", model, args, work)
    text = model.config.text_config
    text.sliding_window = WIDE_WINDOW
    with torch.no_grad():
        for layer, kind in zip(model.model.language_model.layers, text.layer_types, strict=True):
            if kind == "full_attention":
                layer.self_attn.o_proj.weight.zero_()
    results += run("global-free", model, args, work)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

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

import json
import sys
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
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
BUDGET = ("--image-max-tokens", "280")
QUESTION = "What is in this picture?"
BOS = "<s>"  # stories260K's, as the tests' template writes it
TOKENS = 8
# (height, width, seed): 14x20, 20x14 and 10x28 tokens of 12 pixels, 280 each.
IMAGES = [(168, 240, 1), (240, 168, 2), (120, 336, 3)]
WIDE_WINDOW = 512  # the control's window: the whole prompt, so its last token sees the image


def compare(engine, server: LlamaServer, data: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on the image `data` and QUESTION."""
    from llmrun.images import open_image

    text = engine.prompt_text(QUESTION, images=1)
    # llama-server adds the BOS the template writes.
    prompt = text.removeprefix(BOS).replace("<|image|>", server.media_marker)
    answer = greedy_completion(server, prompt, [data], TOKENS)
    ids, images = engine.image_prompt(text, [open_image(data)])
    return dict(
        **agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer),
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
    convert(args.converter, folder, mmproj, "--mmproj", "--outtype", "f32")
    differences = layout_differences(mmproj, write_mmproj(model, work / f"{name}-test.gguf"))
    f16 = work / f"{name}-mmproj-f16.gguf"  # the converter's default: F16 matrices
    convert(args.converter, folder, f16, "--mmproj")
    test_f16 = write_mmproj(model, work / f"{name}-test-f16.gguf", f16=True)
    differences += layout_differences(f16, test_f16)
    verdict = "equal the converter's"
    if differences:
        verdict = "differ from the converter's: " + ", ".join(differences)
    print(f"{name:>11}: the tests' mmproj files (F32, F16) {verdict}")
    text = write_text_gguf(model, work / f"{name}.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    log = work / f"{name}-server.log"
    with LlamaServer(args.llama_cpp, text, log, *BUDGET, mmproj=mmproj) as server:
        for height, width, seed in IMAGES:
            record = {"model": name, "image": f"{width}x{height}"}
            record.update(compare(engine, server, picture(height, width, seed)))
            results.append(record)
            print(f"{name:>11} {record['image']:>8}: {describe(record, TOKENS)}")
    return results


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_gemma4_vision.json")
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

"""llama.cpp's converter and llama-server against llmrun on the tiny LightOnOCR model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_lightonocr.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random LightOnOcrForConditionalGeneration
(tests/lighton_ocr_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here, first, llama.cpp's own converter (SRC/convert_hf_to_gguf.py
--mmproj, its default F16) turns the model's folder into an mmproj GGUF: its metadata and
tensors are compared with write_mmproj's, name by name, bit for bit, and llmrun loads it.
The folder's config.json names the architectures as LightOnOCR-1B-1025's does
(LightOnOCRForConditionalGeneration, text Qwen3ForCausalLM), which the converter knows; its
tower has 3 layers (the converter maps mm.2 only where there are 3 or more).
Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with the image as multimodal_data, and llmrun gets the
same prompt: llama.cpp puts <|im_start|> before an image's tokens and <|im_end|> after
(mtmd.cpp), which LightOnOcrProcessor does not, so llmrun's text carries them around its
<|image_pad|> here. Per image: the greedy tokens of each engine (8, or up to an end
token), how many agree, whether both stop there, the largest difference of the chosen
tokens' log-probabilities. Images are 84x84 (3x3 merged patches), which neither engine
resizes. Results go to --out (benchmarks/out/llama_cpp_lightonocr.json).
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

from lighton_ocr_helpers import (  # noqa: E402
    save_lighton_ocr_dir,
    tiny_lighton_ocr,
    write_mmproj,
    write_text_gguf,
)
from llama_cpp_pixtral import EXACT, converter_agreement  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is written here?"
IMAGE = "<|image_pad|>"
TOKENS = 8
SEEDS = (1, 2, 3, 4, 5)


def compare(engine, server, marker: str, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one 84x84 image."""
    from llmrun.images import open_image
    from llmrun.sampling import SamplingParams

    data = picture(84, 84, seed)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = engine.render([{"role": "user", "content": content}])
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": text.replace(IMAGE, marker),
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
    wrapped = text.replace(IMAGE, f"<|im_start|>{IMAGE}<|im_end|>")
    ids, images = engine.image_prompt(wrapped, [open_image(data)])
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
        # llmrun stops before an end token (EOS, <|im_end|>), which llama.cpp lists last.
        stops_alike=theirs[agree:] in ([], *([t] for t in engine.eos_ids)) and agree == len(ours),
        max_abs_logprob_diff=max(diffs, default=None),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_lightonocr.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "lightonocr"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_lighton_ocr(vision_layers=3)
    folder = save_lighton_ocr_dir(model, work / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LightOnOCRForConditionalGeneration"]
    config["text_config"]["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
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
        ("--mmproj", str(converted), *EXACT),
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
                f"{record['image']:>16}: {record['tokens_agreeing']}/{len(record['llmrun'])} "
                f"greedy tokens agree, stops alike: {record['stops_alike']}, |logprob diff| {diff if diff is None else f'{diff:.2e}'}, prompt "
                f"tokens {record['prompt_tokens_llmrun']} / {record['prompt_tokens_llama_cpp']}"
            )
    finally:
        server.close()
    args.out.write_text(json.dumps(dict(converter=agreement, greedy=results), indent=1))


if __name__ == "__main__":
    main()

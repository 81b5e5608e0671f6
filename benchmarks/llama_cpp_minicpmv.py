"""llama.cpp's converter and llama-server against llmrun on the tiny MiniCPM-V 4.6 model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_minicpmv.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random MiniCPMV4_6ForConditionalGeneration
(tests/minicpmv_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj
--outtype f32) turns the model's folder into an mmproj GGUF, compared with write_mmproj's
name by name, bit for bit.

Then `DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (the tests' text GGUF, f32 KV
cache, no flash attention) answers /completion with the image as multimodal_data, and
llmrun gets the same prompt twice: as transformers writes it (each image led by
<image_id>0</image_id>), and without that lead, as llama.cpp writes it. llama.cpp also
resamples with its own filter, places patches on the position table by floor(70 i / n),
and turns the image tokens of its qwen35 text by M-RoPE (the time and height sections at
the image's first place, the width's along its tokens) where transformers turns them as
text. Per image: the 8 greedy tokens of each, how many agree, and the prompt lengths.
Results go to --out (benchmarks/out/llama_cpp_minicpmv.json).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreeing,
    arguments,
    convert,
    converter_agreement,
    greedy_completion,
    llmrun_greedy,
)
from minicpmv_helpers import (  # noqa: E402
    save_minicpmv_dir,
    tiny_minicpmv,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed): 2x2 slices, 1x2, 1x3, 3x1, not sliced.
IMAGES = [(64, 64, 1), (40, 64, 2), (30, 90, 3), (100, 17, 4), (20, 20, 5)]


def compare(engines: dict, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llama.cpp and of each llmrun engine on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    prompt = f"<|im_start|>user\n{server.media_marker}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    answer = greedy_completion(server, prompt, [data], TOKENS, n_probs=0)
    record = dict(
        image=f"{width}x{height} seed {seed}",
        llama_cpp=answer["tokens"],
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )
    for name, engine in engines.items():
        text = engine.prompt_text(QUESTION, images=1)
        ids, images = engine.image_prompt(text, [open_image(data)])
        ours, _ = llmrun_greedy(engine, ids, TOKENS, images)
        record[name] = ours
        record[f"tokens_agreeing_{name}"] = agreeing(ours, answer["tokens"])
        record[f"prompt_tokens_{name}"] = len(ids)
    return record


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_minicpmv.json")
    from llmrun import api

    work = OUT / "minicpmv"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_minicpmv()
    folder = save_minicpmv_dir(model, work / "hf")
    converted = work / "mmproj-converter-f32.gguf"
    convert(args.converter, folder, converted, "--mmproj", "--outtype", "f32")
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    layout = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "text.gguf")
    transformers_prompt = api.load(str(text), device="cpu", mmproj=mmproj)
    llama_cpp_prompt = dataclasses.replace(
        transformers_prompt, vision=dataclasses.replace(transformers_prompt.vision, image_ids=False)
    )
    engines = {"llmrun": transformers_prompt, "llmrun_without_image_id": llama_cpp_prompt}
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for height, width, seed in IMAGES:
            record = compare(engines, server, height, width, seed)
            results.append(record)
            print(
                f"{record['image']:>16}: greedy tokens agreeing with llama.cpp "
                f"{record['tokens_agreeing_llmrun']}/{TOKENS} (transformers' prompt), "
                f"{record['tokens_agreeing_llmrun_without_image_id']}/{TOKENS} (llama.cpp's); "
                f"prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llmrun_without_image_id']} / "
                f"{record['prompt_tokens_llama_cpp']}"
            )
    args.out.write_text(json.dumps(dict(converter=layout, greedy=results), indent=1))


if __name__ == "__main__":
    main()

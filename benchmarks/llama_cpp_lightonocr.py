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

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from lighton_ocr_helpers import (  # noqa: E402
    save_lighton_ocr_dir,
    tiny_lighton_ocr,
    write_mmproj,
    write_text_gguf,
)
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    converter_agreement,
    greedy_completion,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is written here?"
IMAGE = "<|image_pad|>"
TOKENS = 8
SEEDS = (1, 2, 3, 4, 5)


def compare(engine, server: LlamaServer, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one 84x84 image."""
    from llmrun.images import open_image

    data = picture(84, 84, seed)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = engine.render([{"role": "user", "content": content}])
    answer = greedy_completion(server, text.replace(IMAGE, server.media_marker), [data], TOKENS)
    wrapped = text.replace(IMAGE, f"<|im_start|>{IMAGE}<|im_end|>")
    ids, images = engine.image_prompt(wrapped, [open_image(data)])
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer)
    ours, theirs, agree = record["llmrun"], record["llama_cpp"], record["tokens_agreeing"]
    return dict(
        image=f"84x84 seed {seed}",
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agree,
        # llmrun stops before an end token (EOS, <|im_end|>), which llama.cpp lists last.
        stops_alike=theirs[agree:] in ([], *([t] for t in engine.eos_ids)) and agree == len(ours),
        max_abs_logprob_diff=record["max_abs_logprob_diff"],
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_lightonocr.json")
    from llmrun import api

    work = OUT / "lightonocr"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_lighton_ocr(vision_layers=3)
    folder = save_lighton_ocr_dir(model, work / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LightOnOCRForConditionalGeneration"]
    config["text_config"]["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    converted = convert(args.converter, folder, work / "mmproj-converter.gguf", "--mmproj")
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    layout = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)  # llmrun reads the converter's
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=converted) as server:
        for seed in SEEDS:
            record = compare(engine, server, seed)
            results.append(record)
            diff = record["max_abs_logprob_diff"]
            print(
                f"{record['image']:>16}: {record['tokens_agreeing']}/{len(record['llmrun'])} "
                f"greedy tokens agree, stops alike: {record['stops_alike']}, |logprob diff| "
                f"{diff if diff is None else f'{diff:.2e}'}, prompt "
                f"tokens {record['prompt_tokens_llmrun']} / {record['prompt_tokens_llama_cpp']}"
            )
    args.out.write_text(json.dumps(dict(converter=layout, greedy=results), indent=1))


if __name__ == "__main__":
    main()

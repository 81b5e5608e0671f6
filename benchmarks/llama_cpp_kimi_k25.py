"""llama.cpp's converter and llama-server against llmrun on the tiny Kimi K2.5 model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_kimi_k25.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Kimi_K25ForConditionalGeneration
(tests/kimi_k25_helpers.py) laid out as the Hub's folder, reading the mmproj that
llama.cpp's converter writes from it. Here the converter (SRC/convert_hf_to_gguf.py
--mmproj --outtype f32) writes that mmproj, and `DIR/llama-server -m model.gguf --mmproj
mmproj.gguf` (the text as the tests write it, arch deepseek2; f32 KV cache, no flash
attention) answers /completion with the image as multimodal_data, and llmrun gets the same
prompt: llama.cpp puts <|media_begin|> before an image's tokens and <|media_end|> after
(mtmd.cpp), which the chat template has written around <|media_pad|> already, so llmrun's
text carries them twice too. Per image: the greedy tokens of each engine (8, or up to an
end token), how many agree, whether both stop there, the largest difference of the chosen
tokens' log-probabilities. Images are multiples of 28 pixels within the limits (56x84,
84x84, 112x140, 84x168), which neither engine resizes. Results go to --out
(benchmarks/out/llama_cpp_kimi_k25.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from kimi_k25_helpers import save_kimi_k25_dir, tiny_kimi_k25, write_text_gguf  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    greedy_completion,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
IMAGE = "<|media_pad|>"
TOKENS = 8
IMAGES = ((56, 84, 1), (84, 84, 2), (112, 140, 3), (84, 168, 4))


def compare(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = engine.render([{"role": "user", "content": content}])
    answer = greedy_completion(server, text.replace(IMAGE, server.media_marker), [data], TOKENS)
    wrapped = text.replace(IMAGE, f"<|media_begin|>{IMAGE}<|media_end|>")
    ids, images = engine.image_prompt(wrapped, [open_image(data)])
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer)
    ours, theirs, agree = record["llmrun"], record["llama_cpp"], record["tokens_agreeing"]
    return dict(
        image=f"{height}x{width} seed {seed}",
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agree,
        # llmrun stops before an end token (EOS), which llama.cpp lists last.
        stops_alike=theirs[agree:] in ([], *([t] for t in engine.eos_ids)) and agree == len(ours),
        max_abs_logprob_diff=record["max_abs_logprob_diff"],
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_kimi_k25.json")
    from llmrun import api

    work = OUT / "kimi_k25"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_kimi_k25()
    folder = save_kimi_k25_dir(model, work / "hf")
    converted = convert(
        args.converter, folder, work / "mmproj.gguf", "--mmproj", "--outtype", "f32"
    )
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=converted) as server:
        for height, width, seed in IMAGES:
            record = compare(engine, server, height, width, seed)
            results.append(record)
            diff = record["max_abs_logprob_diff"]
            print(
                f"{record['image']:>18}: {record['tokens_agreeing']}/{len(record['llmrun'])} "
                f"greedy tokens agree, stops alike: {record['stops_alike']}, |logprob diff| "
                f"{diff if diff is None else f'{diff:.2e}'}, prompt "
                f"tokens {record['prompt_tokens_llmrun']} / {record['prompt_tokens_llama_cpp']}"
            )
    args.out.write_text(json.dumps(dict(greedy=results), indent=1))


if __name__ == "__main__":
    main()

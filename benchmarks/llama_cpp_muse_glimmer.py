"""llama.cpp's converter and llama-server against llmrun on the tiny Muse Glimmer model the
tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_muse_glimmer.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random MuseGlimmerForConditionalGeneration
(tests/muse_glimmer_helpers.py) and on the GGUFs llama.cpp's converter writes of its
folder (its vocabulary step told the toy tokenizer is llama-bpe's: run_converter). Here
the converter (SRC/convert_hf_to_gguf.py) writes an F32 text GGUF and an F32 mmproj, which
both engines load: `DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (f32 KV cache, no
flash attention) answers /completion, and llmrun's engine runs the same prompt greedily.

Text: prompts of random token ids (longer than the window of 4), given as ids to both.
Images: the chat template's prompt with the image at llama-server's media marker (mtmd
puts <|image_start|> and <|image_end|> around its tokens, as MuseGlimmerProcessor does), in
sizes of whole 28-pixel tokens so that neither engine resizes them. Per prompt: the greedy
tokens of each engine (8), how many agree from the start, the largest difference of the
agreeing tokens' log-probabilities, both prompts' lengths. Results go to --out
(benchmarks/out/llama_cpp_muse_glimmer.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from muse_glimmer_helpers import (  # noqa: E402
    PATCH,
    run_converter,
    save_muse_glimmer_dir,
    tiny_muse_glimmer,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in the picture?"
TOKENS = 8
TEXT_SEEDS = (1, 2, 3)
# (height, width, seed): 4 x 6, 2 x 3 and 3 x 3 tokens (8 x 12 patches: 2 x 3 windows).
IMAGES = ((112, 168, 1), (56, 84, 2), (84, 84, 3))


def text_record(engine, server: LlamaServer, seed: int) -> dict:
    import torch

    ids = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
    answer = greedy_completion(server, ids, tokens=TOKENS)
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, top=1), answer)
    return dict(
        prompt=f"20 random ids, seed {seed}",
        **record,
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def image_record(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    from llmrun.images import open_image

    data = picture(height, width, seed)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = engine.render([{"role": "user", "content": content}])
    # llama-server adds BOS itself (the converter's add_bos_token): the template's is left out.
    served = text.removeprefix("<s>").replace("<|patch|>", server.media_marker)
    answer = greedy_completion(server, served, [data], TOKENS)
    ids, images = engine.image_prompt(text, [open_image(data)])
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, images, top=1), answer)
    return dict(
        prompt=f"{width}x{height} image, seed {seed}",
        **record,
        image_tokens=ids.count(PATCH),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_muse_glimmer.json")
    from llmrun import api

    work = OUT / "muse_glimmer"
    work.mkdir(parents=True, exist_ok=True)
    folder = save_muse_glimmer_dir(tiny_muse_glimmer(), work / "hf")
    text, mmproj = work / "text-f32.gguf", work / "mmproj-f32.gguf"
    converter = args.converter / "convert_hf_to_gguf.py"
    run_converter(folder, {text: "--outtype f32", mmproj: "--outtype f32 --mmproj"}, converter)
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for seed in TEXT_SEEDS:
            results.append(text_record(engine, server, seed))
        for height, width, seed in IMAGES:
            results.append(image_record(engine, server, height, width, seed))
    for record in results:
        print(f"{record['prompt']:>28}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

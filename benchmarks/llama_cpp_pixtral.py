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

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    converter_agreement,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from pixtral_helpers import (  # noqa: E402
    save_mistral3_dir,
    tiny_mistral3,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
SEEDS = (1, 2, 3, 4, 5)


def compare(engine, server: LlamaServer, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one 84x84 image."""
    from llmrun.images import open_image

    data = picture(84, 84, seed)
    prompt = f"[INST]{server.media_marker}{QUESTION}[/INST]"
    answer = greedy_completion(server, prompt, [data], TOKENS)
    text = engine.prompt_text(QUESTION, images=1)
    ids, images = engine.image_prompt(text, [open_image(data)])
    return dict(
        image=f"84x84 seed {seed}",
        **agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_pixtral.json")
    from llmrun import api

    work = OUT / "pixtral"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_mistral3(vision_layers=3)
    folder = save_mistral3_dir(model, work / "hf")
    converted = convert(args.converter, folder, work / "mmproj-converter.gguf", "--mmproj")
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    layout = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)  # llmrun reads the converter's
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for seed in SEEDS:
            record = compare(engine, server, seed)
            results.append(record)
            print(f"{record['image']:>16}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(dict(converter=layout, greedy=results), indent=1))


if __name__ == "__main__":
    main()

"""llama.cpp's converter and llama-server against llmrun on the tiny LFM2-VL model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_lfm2_vl.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Lfm2VlForConditionalGeneration
(tests/lfm2_vl_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here the model has 3 tower layers (the converter maps the projector's
mm.2 only below its block count) and its folder the Hub's key names
(model.vision_tower.vision_model.*, which the converter expects; transformers 5 saves
model.vision_tower.*): llama.cpp's own converter (SRC/convert_hf_to_gguf.py) turns it
into an mmproj GGUF (--mmproj, its default F16), compared with write_mmproj's name by
name, bit for bit. (This converter refuses the text of Lfm2VlForConditionalGeneration;
the text GGUF is the tests' write_text_gguf, arch lfm2 as tests/models/test_lfm2.py lays
it out.) llmrun's logits for an image prompt on the text GGUF and an F32 mmproj are
compared with transformers'.

Then `DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with each image as multimodal_data, and llmrun gets the
same prompt with the same mmproj. Both take 64 to 256 tokens an image, but llama.cpp
resizes with its own (not antialiased) bilinear filter and slices large images its own
way (mtmd-image.h). Per image: the 8 greedy tokens of each
engine, how many agree, and the prompt lengths. Results go to --out
(benchmarks/out/llama_cpp_lfm2_vl.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from lfm2_vl_helpers import (  # noqa: E402
    model_inputs,
    save_lfm2_vl_dir,
    tiny_lfm2_vl,
    write_mmproj,
    write_text_gguf,
)
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    converter_agreement,
    describe,
    greedy_completion,
    hub_tower_names,
    image_logits_difference,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed): one frame each (256 x 256 is 64 tokens either way), then 2 x 2
# tiles of 512 pixels (256 tokens each) and a thumbnail.
IMAGES = [(256, 256, 1), (256, 384, 2), (40, 64, 3), (500, 300, 4), (800, 800, 5)]


def compare(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    text = engine.prompt_text(QUESTION, images=1)
    prompt = text.replace("<image>", server.media_marker)
    answer = greedy_completion(server, prompt, [data], TOKENS, n_probs=0)
    ids, images = engine.image_prompt(text, [open_image(data)])
    return dict(
        image=f"{width}x{height} seed {seed}",
        **agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_lfm2_vl.json")
    from llmrun import api
    from llmrun.images import open_image

    image = open_image(picture(200, 300, 6))  # for the logits against transformers'
    work = OUT / "lfm2_vl"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_lfm2_vl(vision_layers=3)
    folder = save_lfm2_vl_dir(model, work / "hf")
    hub_tower_names(folder, "model.vision_tower.")
    mmproj = convert(args.converter, folder, work / "mmproj-converter.gguf", "--mmproj")
    layout = converter_agreement(mmproj, write_mmproj(model, work / "mmproj.gguf"))
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "text.gguf")
    f32 = write_mmproj(model, work / "mmproj-f32.gguf", f16=False)
    difference = image_logits_difference(
        model, api.load(str(text), device="cpu", mmproj=f32), model_inputs, image, QUESTION
    )
    print(f"llmrun vs transformers, max |logit diff|: {difference:.2e}")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    log = work / "server.log"
    with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=mmproj) as server:
        for height, width, seed in IMAGES:
            record = compare(engine, server, height, width, seed)
            results.append(record)
            print(f"{record['image']:>20}: {describe(record, TOKENS)}")
    args.out.write_text(
        json.dumps(dict(converter=layout, logits=difference, greedy=results), indent=1)
    )


if __name__ == "__main__":
    main()

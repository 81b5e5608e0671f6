"""llama.cpp's converter and llama-server against llmrun on the tiny SmolVLM model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_smolvlm.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random SmolVLMForConditionalGeneration
(tests/smolvlm_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj). Here llama.cpp's own converter (SRC/convert_hf_to_gguf.py) turns the
model's folder into an mmproj GGUF (--mmproj, its default F16), compared with
write_mmproj's name by name, bit for bit; and into an F32 mmproj and an F32 text GGUF
(arch llama), which llmrun loads: its logits for an image prompt are compared with
transformers'.

Then `DIR/llama-server -m text.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with the image as multimodal_data, and llmrun gets the
same prompt. llama.cpp looks "\\n\\n" up as one token (before the whole image), which
stories260K's vocabulary lacks: the folder here names its unused <row_6_col_6> "\\n\\n"
instead, so that both engines (and transformers) tokenize alike. llama.cpp resamples with
its own Lanczos filter, not Pillow's. Per image: the 8 greedy tokens of each engine, how
many agree, the largest difference of the chosen tokens' log-probabilities, and the
prompt lengths. Results go to --out (benchmarks/out/llama_cpp_smolvlm.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

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
from smolvlm_helpers import (  # noqa: E402
    SMOLVLM_TOKENS,
    reference_inputs,
    save_smolvlm_dir,
    tiny_smolvlm,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed): 64 pixels is the longest edge (2x2 tiles of 32, not resized
# first); the others are resized by each engine's own Lanczos filter.
IMAGES = [(64, 64, 1), (64, 64, 2), (64, 64, 3), (40, 64, 4), (90, 30, 5)]
DOUBLE_NEWLINE_ID = 552  # <row_6_col_6>, which 2x2 tiles never use


def double_newline_token(folder: Path) -> None:
    """Name token DOUBLE_NEWLINE_ID "\\n\\n" (a user-defined token) in the folder's
    tokenizer.json."""
    file = folder / "tokenizer.json"
    tok = json.loads(file.read_text())
    entry = next(t for t in tok["added_tokens"] if t["id"] == DOUBLE_NEWLINE_ID)
    entry.update(content="\n\n", special=False)
    file.write_text(json.dumps(tok))


def compare(engine, server: LlamaServer, seed: int, height: int, width: int) -> dict:
    """Greedy tokens of llmrun and of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    prompt = f"<|im_start|>User:{server.media_marker}{QUESTION}<end_of_utterance>\nAssistant:"
    answer = greedy_completion(server, prompt, [data], TOKENS)
    text = engine.prompt_text(QUESTION, images=1)
    ids, images = engine.image_prompt(text, [open_image(data)])
    return dict(
        image=f"{width}x{height} seed {seed}",
        **agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def converted_logits(model, folder: Path, engine, converted) -> tuple[float, float]:
    """The largest |logit difference| of transformers on the folder and llmrun, on the
    tests' GGUFs (`engine`) and on the converter's text GGUF (`converted`, its own
    tokenizer aside: it takes `engine`'s ids and image embeddings), for a prompt with a
    40x64 image (2x2 tiles)."""
    from llmrun.images import open_image

    image = open_image(picture(40, 64, 6))
    text = engine.prompt_text(QUESTION, images=1)
    reference = reference_inputs(folder, [image], text)
    ids, images = engine.image_prompt(text, [image])
    assert ids == reference["input_ids"][0].tolist(), "the prompt ids differ"
    tokens = images.tokens(0, len(ids), torch.device("cpu"))
    with torch.no_grad():
        expected = model(**reference).logits[0]
        return tuple(
            (
                e.model(torch.tensor([ids]), torch.arange(len(ids))[None], images=tokens)[0]
                - expected
            )
            .abs()
            .max()
            .item()
            for e in (engine, converted)
        )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_smolvlm.json")
    from llmrun import api

    work = OUT / "smolvlm"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_smolvlm()
    folder = save_smolvlm_dir(model, work / "hf")
    double_newline_token(folder)
    mmproj = convert(args.converter, folder, work / "mmproj-converter.gguf", "--mmproj")
    mmproj_f32 = work / "mmproj-converter-f32.gguf"
    convert(args.converter, folder, mmproj_f32, "--mmproj", "--outtype", "f32")
    converted_text = convert(
        args.converter, folder, work / "text-converter.gguf", "--outtype", "f32"
    )
    layout = converter_agreement(mmproj, write_mmproj(model, work / "mmproj.gguf"))
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    # The converter reads stories260K's vocabulary with a space prefix (SmolVLM's own is
    # GPT-2's): the tests' writer gives the text GGUF its tokenizer.
    tokens = tuple(
        "\n\n" if i == DOUBLE_NEWLINE_ID else t for i, t in enumerate(SMOLVLM_TOKENS, 512)
    )
    text = write_text_gguf(model, work / "text.gguf", tokens)
    exact = api.load(str(text), device="cpu", mmproj=mmproj_f32)
    converted = api.load(str(converted_text), device="cpu")
    differences = converted_logits(model, folder, exact, converted)
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ours, theirs = differences
    print(
        f"llmrun vs transformers, max |logit diff|: tests' text GGUF {ours:.2e}, "
        f"converter's {theirs:.2e}"
    )
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for height, width, seed in IMAGES:
            record = compare(engine, server, seed, height, width)
            results.append(record)
            print(f"{record['image']:>16}: {describe(record, TOKENS)}")
    args.out.write_text(
        json.dumps(dict(converter=layout, logits=differences, greedy=results), indent=1)
    )


if __name__ == "__main__":
    main()

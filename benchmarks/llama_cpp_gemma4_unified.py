"""llama.cpp itself answers with the Gemma 4 Unified files the tests use, as llmrun does
(text, an image, a clip, both; not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_gemma4_unified.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Gemma4UnifiedForConditionalGeneration
(tests/gemma4_unified_helpers.py). Here its folder goes through llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --outtype f32, and with --mmproj): the tests' writers
(write_text_gguf, write_mmproj) are compared with the converter's files (tensor names,
shapes, types, bytes; metadata), and llmrun on the converter's files is compared with
transformers (embeddings and logits of an image and a clip in one prompt). The
converter's Gemma4Model reads moe_intermediate_size, which transformers 5.25 does not
save for this model: the folder's config.json gets it as null, as the Hub's has it.

Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf --image-max-tokens 280` (f32 KV
cache, no flash attention) answers /completion for a text prompt, an image (filling the
280-token budget exactly, so that neither engine resizes it), a 16 kHz clip and both;
mtmd lays each out as <|image> or <|audio>, its tokens, <image|> or <audio|>, as the
processor does. Per prompt: the 8 greedy tokens of each engine, how many agree, the
largest difference of the chosen tokens' log-probabilities, and both prompts' sizes.
Results go to --out (benchmarks/out/llama_cpp_gemma4_unified.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from gemma4_unified_helpers import (  # noqa: E402
    AUDIO,
    processor_inputs,
    save_gemma4_unified_dir,
    tiny_gemma4_unified,
    write_mmproj,
)
from gemma4_vision_helpers import IMAGE, write_text_gguf  # noqa: E402
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
from vision_helpers import picture  # noqa: E402
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
BUDGET = ("--image-max-tokens", "280")
QUESTION = "What is in these?"
BOS = "<s>"  # stories260K's, as the tests' template writes it
TOKENS = 8
PICTURE = (168, 240, 1)  # 14x20 tokens of 12 pixels: 280
CLIP = (1.3, 2)  # seconds at 16 kHz, seed


def with_moe_field(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = None
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def parity(model, folder: Path, engine, image: bytes, wav: bytes) -> dict:
    """llmrun on the converter's files against transformers, for the image and the clip
    in one prompt."""
    import torch

    from llmrun import audio
    from llmrun.images import open_image

    pictures, clips = [open_image(image)], [audio.open_audio(wav)]
    text = engine.prompt_text(QUESTION, images=1, audio=1)
    ids, media = engine.media_prompt(text, pictures, clips)
    inputs = processor_inputs(folder, QUESTION, pictures, [clips[0].samples], tokens=280)
    taken = {}

    def keep(module, args, kwargs) -> None:
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = model(**inputs).logits[0]
    finally:
        hook.remove()
    with torch.no_grad():
        got = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=media.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    rows = taken["embeds"][(inputs["input_ids"][0] == IMAGE) | (inputs["input_ids"][0] == AUDIO)]
    return {
        "same_ids": ids == inputs["input_ids"][0].tolist(),
        "embeddings_max_abs_diff": float((torch.cat(media.embeds) - rows).abs().max()),
        "logits_max_abs_diff": float((got - expected).abs().max()),
        "logits_max_abs": float(expected.abs().max()),
    }


def compare(engine, server: LlamaServer, images: list[bytes], wavs: list[bytes]) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for QUESTION after `images` and `wavs`."""
    from llmrun import audio
    from llmrun.images import open_image

    text = engine.prompt_text(QUESTION, images=len(images), audio=len(wavs))
    # llama-server adds the BOS the template writes; mtmd takes the media in order.
    prompt = text.removeprefix(BOS)
    for place in ("<|image|>", "<|audio|>"):
        prompt = prompt.replace(place, server.media_marker)
    answer = greedy_completion(server, prompt, [*images, *wavs], TOKENS)
    pictures = [open_image(data) for data in images]
    clips = [audio.open_audio(data) for data in wavs]
    ids, media = engine.media_prompt(text, pictures, clips)
    return dict(
        **agreement(
            *llmrun_greedy(engine, ids, TOKENS, media if pictures or clips else None), answer
        ),  # fmt: skip
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_gemma4_unified.json")
    from llmrun import api

    work = OUT / "gemma4_unified"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma4_unified()
    folder = save_gemma4_unified_dir(model, work / "hf")
    with_moe_field(folder)
    f32 = ("--outtype", "f32")
    text = convert(args.converter, folder, work / "model.gguf", *f32)
    mmproj = convert(args.converter, folder, work / "mmproj.gguf", "--mmproj", *f32)
    result: dict = {
        "text_gguf_layout": converter_agreement(
            text, write_text_gguf(model, work / "test-model.gguf")
        ),
        "mmproj_layout": converter_agreement(
            mmproj, write_mmproj(model, work / "test-mmproj.gguf")
        ),
        "prompts": [],
    }
    print("the tests' text GGUF against the converter's:", json.dumps(result["text_gguf_layout"]))
    print("the tests' mmproj against the converter's:", json.dumps(result["mmproj_layout"]))
    engine = api.load(str(text), device="cpu", mmproj=mmproj, vision=True, audio=True)
    image = picture(*PICTURE)
    wav = wav_bytes(chirp(CLIP[0], 16000, CLIP[1]), 16000)
    result["llmrun_on_converted"] = parity(model, folder, engine, image, wav)
    print("llmrun on the converter's files:", json.dumps(result["llmrun_on_converted"]))
    cases = {"text": ([], []), "image": ([image], []), "audio": ([], [wav]),
             "image+audio": ([image], [wav])}  # fmt: skip
    log = work / "server.log"
    with LlamaServer(args.llama_cpp, text, log, *BUDGET, mmproj=mmproj) as server:
        for name, (images, wavs) in cases.items():
            record = {"prompt": name, **compare(engine, server, images, wavs)}
            result["prompts"].append(record)
            print(f"{name:>11}: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""llama.cpp itself answers about audio with the Gemma 4 files the audio tests use, as
llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_gemma4_audio.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Gemma4ForConditionalGeneration
with its vision and audio towers (tests/gemma4_audio_helpers.py). Here the model's folder
goes through llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj --outtype
f32): the tests' mmproj writer (write_audio_mmproj) is compared with the converter's file
(tensor names, shapes, types, bytes; clip.* metadata); llmrun loads the converter's file
(and its default F16 one) and its audio embeddings and logits for a 2-second clip are
compared with transformers' (f32). Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache,
no flash attention) answers /completion with each clip as multimodal_data (mtmd puts
<|audio> and <audio|> around the clip's tokens itself, as the processor does; it decodes
Gemma 4's audio causally). The clips are at 16 kHz, so that no resampler differs. Per
clip: the 8 greedy tokens of each engine, how many agree, the largest difference of the
chosen tokens' log-probabilities, and both prompts' sizes.
Results go to --out (benchmarks/out/llama_cpp_gemma4_audio.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from gemma4_audio_helpers import (  # noqa: E402
    AUDIO,
    processor_inputs,
    tiny_gemma4_audio,
    write_audio_mmproj,
)
from gemma4_vision_helpers import save_gemma4_vl_dir, write_text_gguf  # noqa: E402
from llama_cpp_gemma4_vision import layout_differences  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    against_transformers,
    agreement,
    arguments,
    convert,
    describe,
    greedy_completion,
    llmrun_greedy,
)
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What do you hear?"
BOS = "<s>"  # stories260K's, as the tests' template writes it
TOKENS = 8
CLIPS = [(2.0, 1), (1.3, 2), (9.7, 3)]  # (seconds at 16 kHz, seed)


def parity(model, folder: Path, engine) -> dict:
    """llmrun on the converter's mmproj against transformers, for a 2-second clip."""
    from llmrun import audio

    clip = audio.open_audio(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    ids, clips = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
    inputs = processor_inputs(folder, [clip.samples], QUESTION)
    return against_transformers(model, inputs, AUDIO, engine, ids, clips)


def compare(engine, server: LlamaServer, wav: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one clip and QUESTION."""
    from llmrun import audio

    text = engine.prompt_text(QUESTION, audio=1)
    # llama-server adds the BOS the template writes.
    prompt = text.removeprefix(BOS).replace("<|audio|>", server.media_marker)
    answer = greedy_completion(server, prompt, [wav], TOKENS)
    ids, clips = engine.audio_prompt(text, [audio.open_audio(wav)])
    return dict(
        **agreement(*llmrun_greedy(engine, ids, TOKENS, clips), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_gemma4_audio.json")
    from llmrun import api

    work = OUT / "gemma4_audio"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma4_audio()
    folder = save_gemma4_vl_dir(model, work / "hf")
    mmproj = convert(args.converter, folder, work / "mmproj.gguf", "--mmproj", "--outtype", "f32")
    result: dict = {"clips": []}
    result["layout_differences"] = layout_differences(
        mmproj, write_audio_mmproj(model, work / "test-mmproj.gguf")
    )
    print("the tests' mmproj against the converter's:", result["layout_differences"] or "equal")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    result["llmrun_on_converted"] = parity(model, folder, engine)
    print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
    # the converter's default: F16 matrices, F32 convolutions
    f16 = convert(args.converter, folder, work / "mmproj-f16.gguf", "--mmproj")
    on_f16 = api.load(str(text), device="cpu", mmproj=f16, audio=True)
    result["llmrun_on_converted_f16"] = parity(model, folder, on_f16)
    print("llmrun on the converter's F16 mmproj:", json.dumps(result["llmrun_on_converted_f16"]))
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        for seconds, seed in CLIPS:
            record = compare(engine, server, wav_bytes(chirp(seconds, 16000, seed), 16000))
            record.update(seconds=seconds)
            result["clips"].append(record)
            print(f"{seconds} s: {describe(record, TOKENS)}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

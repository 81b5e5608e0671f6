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

import argparse
import base64
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

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
from tokenizer_fuzz import Server  # noqa: E402
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off", "--temp", "0")
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
    taken = {}

    def keep(module, args, kwargs):
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        got = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=clips.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    hook.remove()
    expected_embeds = taken["embeds"][inputs["input_ids"][0] == AUDIO]
    return {
        "same_ids": ids == inputs["input_ids"][0].tolist(),
        "embeddings_max_abs_diff": float((clips.embeds[0] - expected_embeds).abs().max()),
        "logits_max_abs_diff": float((got - expected).abs().max()),
        "logits_max_abs": float(expected.abs().max()),
    }


def compare(engine, server: Server, marker: str, wav: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one clip and QUESTION."""
    from llmrun import audio
    from llmrun.sampling import SamplingParams

    text = engine.prompt_text(QUESTION, audio=1)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                # llama-server adds the BOS the template writes.
                "prompt_string": text.removeprefix(BOS).replace("<|audio|>", marker),
                "multimodal_data": [base64.b64encode(wav).decode()],
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
    ids, clips = engine.audio_prompt(text, [audio.open_audio(wav)])
    stream = engine.generate(ids, SamplingParams(temperature=0.0), TOKENS, logprobs=0, images=clips)
    chosen = [lp for r in stream for lp in r.logprobs]
    ours = [lp.token for lp in chosen]
    pairs = zip(ours, theirs, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
    # As benchmarks/llama_cpp_gemma4_vision.py: the server's probabilities matched to the
    # agreeing tokens by id, in order (it reports none for an incomplete UTF-8 character).
    diffs, cursor = [], 0
    for entry in answer["completion_probabilities"]:
        while cursor < agree and ours[cursor] != entry["id"]:
            cursor += 1
        if cursor == agree:
            break
        diffs.append(abs(chosen[cursor].logprob - entry["logprob"]))
        cursor += 1
    return dict(
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agree,
        max_abs_logprob_diff=max(diffs, default=None),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_gemma4_audio.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "gemma4_audio"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_gemma4_audio()
    folder = save_gemma4_vl_dir(model, work / "hf")
    mmproj = work / "mmproj.gguf"
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(folder)]
    subprocess.run(
        [*converter, "--mmproj", "--outtype", "f32", "--outfile", str(mmproj)],
        check=True,
        capture_output=True,
    )
    result: dict = {"clips": []}
    result["layout_differences"] = layout_differences(
        mmproj, write_audio_mmproj(model, work / "test-mmproj.gguf")
    )
    print("the tests' mmproj against the converter's:", result["layout_differences"] or "equal")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    result["llmrun_on_converted"] = parity(model, folder, engine)
    print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
    f16 = work / "mmproj-f16.gguf"  # the converter's default: F16 matrices, F32 convolutions
    subprocess.run([*converter, "--mmproj", "--outfile", str(f16)], check=True, capture_output=True)
    on_f16 = api.load(str(text), device="cpu", mmproj=f16, audio=True)
    result["llmrun_on_converted_f16"] = parity(model, folder, on_f16)
    print("llmrun on the converter's F16 mmproj:", json.dumps(result["llmrun_on_converted_f16"]))
    server = Server(
        args.llama_cpp / "llama-server",
        text,
        work / "server.log",
        ("--mmproj", str(mmproj), *EXACT),
    )
    try:
        url = f"http://127.0.0.1:{server.port}/props"
        with urllib.request.urlopen(url, timeout=10) as response:
            marker = json.loads(response.read())["media_marker"]
        for seconds, seed in CLIPS:
            record = compare(engine, server, marker, wav_bytes(chirp(seconds, 16000, seed), 16000))
            record.update(seconds=seconds)
            result["clips"].append(record)
            print(
                f"{seconds} s: {record['tokens_agreeing']}/{TOKENS} greedy tokens agree, "
                f"|logprob diff| {record['max_abs_logprob_diff']}; "
                f"prompt tokens {record['prompt_tokens_llmrun']} (llmrun) / "
                f"{record['prompt_tokens_llama_cpp']} (llama.cpp)"
            )
    finally:
        server.close()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""llama.cpp's converter and llama-server against llmrun on the tiny Audio Flamingo 3 the
audio tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_audioflamingo3.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Audio Flamingo 3
(tests/audioflamingo3_helpers.py) and read the GGUFs that llama.cpp's converter writes of
its folder. Here SRC/convert_hf_to_gguf.py writes them again (--outtype f32; the tiny
tokenizer, stories260K's, written as the SentencePiece-style tokenizer.json it is, where
the Hub's is Qwen2's BPE), llmrun loads them, and `DIR/llama-server -m model.gguf --mmproj
mmproj.gguf` (f32 KV cache, no flash attention) answers /completion for a question alone
and on clips of 1, 3 and 30 seconds (the chat template's <sound> as the server's media
marker). llama.cpp gives every clip whole 30-second windows' tokens (750 each, two windows
for a clip of exactly 30 seconds) where the processor counts the clip's own frames, so its
clips' tokens are not the model's and the replies to audio are expected to part; the
question alone checks the text GGUF. Per prompt: the 8 greedy tokens of each engine, how many agree, the largest
difference of their log-probabilities (the chosen tokens' and the 5 best's), and the prompt
sizes. Results go to --out (benchmarks/out/llama_cpp_audioflamingo3.json).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from audioflamingo3_helpers import save_audioflamingo3_dir, tiny_audioflamingo3  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    describe,
    greedy_completion,
    llmrun_greedy,
    max_top_logprob_diff,
)
from qwen3_asr_helpers import converted  # noqa: E402
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<sound>"
QUESTION = "What is said?"
TOKENS, TOP = 8, 5
CLIPS = {
    "none": None,
    "1.0s": wav_bytes(chirp(1.0, 16000, seed=1), 16000),
    "3.0s": wav_bytes(chirp(3.0, 16000, seed=2), 16000),
    "30.0s": wav_bytes(chirp(30.0, 16000, seed=3), 16000),
}


def compare(engine, server: LlamaServer, data: bytes | None) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for QUESTION (on one clip where given), with
    the log-probabilities of the chosen tokens and of the TOP best."""
    from llmrun import audio

    if data is None:
        text = engine.prompt_text(QUESTION)
        ids, clips = engine.tokenizer.encode(text), None
        answer = greedy_completion(server, ids, (), TOKENS, TOP)
    else:
        text = engine.prompt_text(QUESTION, audio=1)
        ids, clips = engine.audio_prompt(text, [audio.open_audio(data)])
        marked = text.replace(PLACE, server.media_marker)
        answer = greedy_completion(server, marked, [data], TOKENS, TOP)
    ours, chosen = llmrun_greedy(engine, ids, TOKENS, clips, TOP)
    return dict(
        **agreement(ours, chosen, answer),
        max_abs_top_logprob_diff=max_top_logprob_diff(chosen, answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_audioflamingo3.json")
    from llmrun import api

    result: dict = {"inputs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_audioflamingo3_dir(tiny_audioflamingo3(), tmp / "hf")
        text, mmproj = converted(args.converter / "convert_hf_to_gguf.py", folder, tmp)
        engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
        log = tmp / "server.log"
        with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=mmproj) as server:
            for name, data in CLIPS.items():
                record = {"clip": name, **compare(engine, server, data)}
                result["inputs"].append(record)
                top = record["max_abs_top_logprob_diff"]
                print(f"{name}: {describe(record, TOKENS)}, top-{TOP} |logprob diff| {top}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

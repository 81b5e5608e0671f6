"""llama.cpp's converter and llama-server against llmrun on the tiny Qwen3-ASR the audio
tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_qwen3_asr.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Qwen3-ASR (tests/qwen3_asr_helpers.py)
and read the GGUFs that llama.cpp's converter writes of Qwen's layout of it (thinker_config,
thinker.* weights). Here SRC/convert_hf_to_gguf.py writes them again (--outtype f32; the
tiny tokenizer, stories260K's, written as the SentencePiece-style tokenizer.json it is,
where the Hub's is Qwen2's BPE), llmrun loads them, and `DIR/llama-server -m model.gguf --mmproj
mmproj.gguf` (f32 KV cache, no flash attention) answers /completion for a question on a
2-second clip (whole 1-second chunks, which llama.cpp pads every clip to, and shorter than
an attention window, which llama.cpp does not use). Per clip: the 8 greedy tokens of each
engine, how many agree, the largest difference of their log-probabilities (the chosen
tokens' and the 5 best's), and the prompt sizes. Results go to --out
(benchmarks/out/llama_cpp_qwen3_asr.json).
"""

from __future__ import annotations

import json
import sys
import tempfile
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
    max_top_logprob_diff,
)
from qwen3_asr_helpers import (  # noqa: E402
    converted,
    qwen_layout,
    save_qwen3_asr_dir,
    tiny_qwen3_asr,
)
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<|audio_start|><|audio_pad|><|audio_end|>"
QUESTION = "What is said?"
TOKENS, TOP = 8, 5
CLIPS = {
    "1.99s": wav_bytes(chirp(1.99, 16000, seed=1), 16000),
    "2.99s": wav_bytes(chirp(2.99, 16000, seed=2), 16000),
}


def compare(engine, server: LlamaServer, data: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one clip and QUESTION, with the log-
    probabilities of the chosen tokens and of the TOP best."""
    from llmrun import audio

    text = engine.prompt_text(QUESTION, audio=1)
    ids, clips = engine.audio_prompt(text, [audio.open_audio(data)])
    answer = greedy_completion(
        server, text.replace(PLACE, server.media_marker), [data], TOKENS, TOP
    )
    ours, chosen = llmrun_greedy(engine, ids, TOKENS, clips, TOP)
    return dict(
        **agreement(ours, chosen, answer),
        max_abs_top_logprob_diff=max_top_logprob_diff(chosen, answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_qwen3_asr.json")
    from llmrun import api

    result: dict = {"inputs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_qwen3_asr_dir(tiny_qwen3_asr(), tmp / "hf")
        script = args.converter / "convert_hf_to_gguf.py"
        text, mmproj = converted(script, qwen_layout(folder, tmp / "qwen"), tmp)
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

"""serve's per-request LoRA scales against llama-server's (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_lora_serve.py --llama-cpp DIR [--tokens 24]
        [--requests 8] [--out FILE]

The tests' tiny random Llama and Qwen2 (F32 GGUF) with their F32 LoRA adapter
(llama_cpp_lora.write_case) are served by DIR/llama-server --lora and by `llmrun serve
--lora`, both with 4 slots. Parity: GET /lora-adapters of both, then requests at scales 0,
0.5 and 1 (the request's `lora` field), sent together, greedy with the end-of-generation
token banned; each server's text per scale, compared (llama-server's /completion token
ids decoded by llmrun's tokenizer). Speed: --requests requests sent at once, their scales
alternating 0 and 1, the wall time on each server (llama-server runs requests of
different adapter scales in separate batches; llmrun decodes them together). Figures go
to --out (benchmarks/out/llama_cpp_lora_serve.json).

Found (2026-12, this CPU's AVX-512 build): the same text at scales 0, 0.5 and 1 on both
families. Speed: unmeasured (the machine was busy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_cpp_lora import write_case  # noqa: E402
from llama_cpp_parity import EOS, EXACT, PROMPT  # noqa: E402
from serving import Server as LlmrunServer  # noqa: E402
from tokenizer_fuzz import Server as LlamaServer  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SCALES = (0.0, 0.5, 1.0)
SLOTS = "4"


def llama_cpp_text(server: LlamaServer, tokens: int, scale: float, tokenizer) -> str:
    body = {
        "prompt": PROMPT,
        "n_predict": tokens,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,  # llama.cpp bans the end-of-generation token
        "return_tokens": True,
        "lora": [{"id": 0, "scale": scale}],
    }
    url = f"http://127.0.0.1:{server.port}/completion"  # one connection per thread
    ids = httpx.post(url, json=body, timeout=600).json()["tokens"]
    return tokenizer.decode(PROMPT + ids)[len(tokenizer.decode(PROMPT)) :]


def llmrun_text(url: str, tokens: int, scale: float) -> str:
    body = {
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(EOS): -100},  # banned, as llama.cpp's ignore_eos bans it
        "lora": [{"id": 0, "scale": scale}],
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    return answer["choices"][0]["text"]


def at_once(send, scales) -> tuple[list[str], float]:
    """`send(scale)` for every scale, all at once; the answers and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(scales)) as pool:
        answers = list(pool.map(send, scales))
    return answers, time.perf_counter() - start


def compare(family: str, folder: Path, binary: Path, tokens: int, requests: int) -> list[dict]:
    """llama-server (`binary`) and llmrun on `family`'s tiny model and adapter: parity,
    then speed."""
    from gguf import GGMLQuantizationType

    from llmrun.tokenizer import load_tokenizer

    f32 = GGMLQuantizationType.F32
    base, adapter = write_case(folder, family, f32, f32)
    tokenizer = load_tokenizer(base)
    log = folder / f"{base.stem}-serve.log"
    theirs = LlamaServer(binary, base, log, (*EXACT, "--lora", str(adapter), "--parallel", SLOTS))
    ours = LlmrunServer(folder, str(base), "--lora", str(adapter), "--parallel", SLOTS)

    def llama_cpp(scale: float) -> str:
        return llama_cpp_text(theirs, tokens, scale, tokenizer)

    def llmrun(scale: float) -> str:
        return llmrun_text(ours.url, tokens, scale)

    mixed = [float(i % 2) for i in range(requests)]
    try:
        their_list = httpx.get(f"http://127.0.0.1:{theirs.port}/lora-adapters").json()
        our_list = httpx.get(f"{ours.url}/lora-adapters").json()
        their_texts, _ = at_once(llama_cpp, SCALES)
        our_texts, _ = at_once(llmrun, SCALES)
        _, their_seconds = at_once(llama_cpp, mixed)
        _, our_seconds = at_once(llmrun, mixed)
    finally:
        theirs.close()
        ours.stop()
    print(f"{family}: llama-server /lora-adapters {their_list}")
    print(f"{family}: llmrun       /lora-adapters {our_list}")
    results = []
    for scale, mine, other in zip(SCALES, our_texts, their_texts, strict=True):
        same = mine == other
        results.append(dict(family=family, scale=scale, same_text=same))
        print(f"{family} scale {scale}: {'same text' if same else 'DIFFERENT'}")
        if not same:
            print(f"  llmrun    {mine!r}\n  llama.cpp {other!r}")
    print(
        f"{family}: {requests} requests at scales 0 and 1 at once, {tokens} tokens each: "
        f"llmrun {our_seconds:.2f} s, llama-server {their_seconds:.2f} s "
        f"(ratio {their_seconds / our_seconds:.2f})"
    )
    results.append(
        dict(family=family, requests=requests, llmrun_s=our_seconds, llama_server_s=their_seconds)
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_lora_serve.json")
    args = parser.parse_args()
    folder = OUT / "lora"
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for family in ("llama", "qwen2"):
        binary = args.llama_cpp / "llama-server"
        results += compare(family, folder, binary, args.tokens, args.requests)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

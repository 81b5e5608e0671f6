"""Every GPU check of the CUDA issue in one run, for a short device lease.

0. the GPU layout (llmrun.quant.planes) on --device, per type on a 7B-shaped matrix
   (11008 x 4096): planes dequantized there against gguf's numpy values (exact?), and
   one row's product timed three ways: the compiled fused kernel, dequantized weights
   and F.linear in bf16, and F.linear on bf16 weights (what a bf16 model reads), in
   GB/s of the bytes each reads, next to a measured device copy's GB/s.

On the Qwen2.5-0.5B-shaped files (make_qwen_model.py's; written first where missing):
1. correctness: the last prompt position's logits on --device against CPU f32 (the
   largest absolute difference, next to the logits' spread; within 3 % of it passes),
   and 64 greedy tokens decoded on both (on CUDA through the CUDA-graph step): how
   many agree before the first difference;
2. speed: `llmrun bench -p 512 -n 128 -r 3 --roofline` on --device (t/s, peak device
   memory, weights GB/s against the device's measured read bandwidth);
3. the baseline: transformers in bf16 on the same shape (random weights), prefill of
   512 and greedy decode of 128 tokens, t/s;
4. a 7B-shaped Q4_0 file (make_qwen_model.py --shape 7b, random blocks; --seven-b
   TYPES for others): decode t/s and its share of the measured bandwidth, at batch 1.
It prints a table and writes JSON lines to --out. On a machine without CUDA it runs
the same steps with `--device cpu` (smaller, to check the script itself).

    python benchmarks/gpu_check.py [--device cuda] [--types F16,Q8_0,Q4_0,Q4_K_M]
                                   [--greedy 64] [--out benchmarks/out/gpu_check.jsonl]

On the device machine (see benchmarks/README.md, "GPU check"): the image lacks gguf and
platformdirs (carried as wheels), and the qwen2 vocabulary comes from
tests/data/cache/vocab (carried).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import make_qwen_model as shape  # noqa: E402

from llmrun import api  # noqa: E402
from llmrun.generate import decode, prefill  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
# bf16 keeps 8 bits of mantissa (a relative step of 2^-8, 0.4 %); through 24 layers of
# rounded activations and weights, the last logits may move by a few of those steps of
# their range. The stated tolerance: 3 % of the CPU f32 logits' spread.
LOGIT_TOLERANCE = 0.03


def greedy(engine: api.Engine, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The logits at the prompt's last position (f32, CPU) and `steps` greedy tokens."""
    state = engine.new_state(len(prompt) + steps + 1)
    with torch.inference_mode():
        logits = prefill(engine.model, state, prompt)
        first = logits.float().cpu()
        tokens = []
        for _ in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            logits = decode(engine.model, state, token)  # on CUDA: the CUDA graph
    return first, tokens


def check_file(path: Path, device: str, steps: int) -> dict:
    reference = api.load(str(path), device="cpu")
    prompt = reference.tokenizer.encode(PROMPT)
    ref_logits, ref_tokens = greedy(reference, prompt, steps)
    del reference
    engine = api.load(str(path), device=device)
    logits, tokens = greedy(engine, prompt, steps)
    agree = next(
        (i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), steps
    )
    diff, spread = (
        float((logits - ref_logits).abs().max()),
        float(ref_logits.max() - ref_logits.min()),
    )
    return {
        "file": path.name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_abs_logit_diff": diff,
        "logit_spread": spread,
        "within_tolerance": diff <= LOGIT_TOLERANCE * spread,
        "greedy_agree": agree,
        "greedy_steps": steps,
    }


def timed_us(fn, device: str, repeats: int = 50) -> float:
    """Microseconds per call of fn after a warm-up (the device synchronized)."""
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e6


def copy_bandwidth(device: str) -> float:
    """GB/s of a 256 MiB device-to-device copy, bytes read and written."""
    source = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.nbytes / timed_us(lambda: target.copy_(source), device, 10) / 1e3


def planes_check(device: str, rows: int = 11008, cols: int = 4096) -> list[dict]:
    """Step 0: the planes' exactness and the decode product's speed on `device`."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize as gguf_dequantize

    from llmrun.quant import planes
    from llmrun.quant.planes import PlanarLinear

    if device == "cpu":
        rows, cols = 512, 1024
    copy_gbps = copy_bandwidth(device)
    fused = PlanarLinear.compiled()
    x = torch.randn(1, cols, device=device)
    out = []
    rng = np.random.default_rng(0)
    for ggml_type in sorted(planes.TYPES, key=lambda t: t.name):
        size, type_size = GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, (rows * cols // size, type_size), dtype=np.uint8)
        for offset in {planes.T.Q6_K: (208,), planes.T.Q4_K: (0, 2)}.get(ggml_type, (0,)):
            scale = (rng.standard_normal(len(raw)) * 1e-3).astype(np.float16)
            raw[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(rows, -1)
        split = planes.split(torch.from_numpy(raw).to(device), ggml_type)
        exact = torch.equal(
            planes.dequantize(split, ggml_type).cpu(),
            torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32)),
        )
        nbytes = sum(p.nbytes for p in split.values())
        bf16 = planes.dequantize(split, ggml_type, torch.bfloat16)
        xb = x.bfloat16()
        fused_us = timed_us(lambda s=split, t=ggml_type: fused(x, s, t), device)
        tiles_us = timed_us(
            lambda s=split, t=ggml_type, xb=xb: torch.nn.functional.linear(
                xb, planes.dequantize(s, t, torch.bfloat16)
            ),
            device,
        )
        bf16_us = timed_us(lambda w=bf16, xb=xb: torch.nn.functional.linear(xb, w), device)
        out.append({
            "type": ggml_type.name, "exact": exact, "plane_bytes": nbytes,
            "fused_us": fused_us, "fused_gbps": nbytes / fused_us / 1e3,
            "dequantize_linear_us": tiles_us, "bf16_linear_us": bf16_us,
            "bf16_gbps": bf16.nbytes / bf16_us / 1e3, "copy_gbps": copy_gbps,
        })  # fmt: skip
    return out


def bench(paths: list[Path], device: str, prompt: int, tokens: int) -> list[dict]:
    command = [sys.executable, "-m", "llmrun", "bench", *map(str, paths), "--device", device,
               "-p", str(prompt), "-n", str(tokens), "-r", "3", "--roofline", "-o", "json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode:
        return [{"bench_error": done.stderr.strip().splitlines()[-1:]}]
    return json.loads(done.stdout)


def transformers_baseline(device: str, prompt: int, tokens: int) -> dict:
    """transformers bf16 on Qwen2.5-0.5B's shape: prefill and greedy-decode t/s."""
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=shape.HIDDEN, intermediate_size=shape.FFN, num_hidden_layers=shape.LAYERS,
        num_attention_heads=shape.HEADS, num_key_value_heads=shape.KV_HEADS,
        vocab_size=shape.VOCAB_SIZE, tie_word_embeddings=True, max_position_embeddings=32768,
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = transformers.Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, shape.VOCAB_SIZE, (1, prompt), device=device)

    def timed(fn) -> float:
        fn()  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        prefill_s = timed(lambda: model(ids))
        short = ids[:, :16]
        decode_s = timed(
            lambda: model.generate(
                short, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
            )  # fmt: skip
        )
    return {
        "engine": "transformers",
        "dtype": str(dtype).removeprefix("torch."),
        "pp_ts": prompt / prefill_s,
        "tg_ts": tokens / decode_s,  # includes the 16-token prompt's prefill
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M")
    parser.add_argument("--greedy", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("-p", "--prompt", type=int, default=512)
    parser.add_argument("-n", "--tokens", type=int, default=128)
    parser.add_argument("--models", type=Path, default=HERE / "out")
    parser.add_argument("--out", type=Path, default=HERE / "out/gpu_check.jsonl")
    parser.add_argument(
        "--seven-b",
        default=None,
        help="types of the 7B-shaped decode check (default: Q4_0 on CUDA, none on CPU)",
    )
    args = parser.parse_args(argv)
    seven_b = (
        args.seven_b if args.seven_b is not None else ("Q4_0" if args.device == "cuda" else "")
    )
    types = args.types.split(",")
    paths = [args.models / f"qwen2.5-0.5b-shaped-{t}.gguf" for t in types]
    missing = [t for t, p in zip(types, paths, strict=True) if not p.is_file()]
    if missing:
        subprocess.run([sys.executable, str(HERE / "make_qwen_model.py"), "--types",
                        ",".join(missing), "--out", str(args.models)], check=True)  # fmt: skip
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:  # each record as it comes: a cut run keeps its results

        def report(record: dict, line: str | None = None) -> None:
            print(line or json.dumps(record), flush=True)
            out.write(json.dumps(record) + "\n")
            out.flush()

        for r in planes_check(args.device):
            report(r)
        for p in paths:
            r = check_file(p, args.device, args.greedy)
            verdict = "ok" if r["within_tolerance"] else f"OVER {LOGIT_TOLERANCE:.0%} of the spread"
            report(r, f"{r['file']}: {r['device']} {r['dtype']} logits within "
                      f"{r['max_abs_logit_diff']:.3g} of CPU f32 (spread {r['logit_spread']:.3g}, "
                      f"{verdict}); greedy agrees for {r['greedy_agree']}/{r['greedy_steps']} tokens")  # fmt: skip
        for r in bench(paths, args.device, args.prompt, args.tokens):
            report(r)
        report(transformers_baseline(args.device, args.prompt, args.tokens))
        for preset in filter(None, seven_b.split(",")):
            path = args.models / f"qwen2.5-7b-shaped-{preset}.gguf"
            if not path.is_file():
                subprocess.run([sys.executable, str(HERE / "make_qwen_model.py"), "--shape", "7b",
                                "--types", preset, "--out", str(args.models)], check=True)  # fmt: skip
            for r in bench([path], args.device, 0, args.tokens):
                report(r)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""RWKV-7 and RWKV-6 prompts: llmrun's chunked prefill, its old per-token loop, llama-bench.

llmrun's chunked prefill against the recurrence one token at a time (as llmrun ran prompts
before), in the same process, and llama.cpp's llama-bench pp on the same GGUF (not run by
CI).

    PYTHONPATH=. python benchmarks/rwkv_prefill.py [--family rwkv7 rwkv6] [--hidden 2048]
        [--layers 24] [-p 512] [-t 2] [--gguf FILE]
        [--llama-bench PATH --converter SRC] [--out FILE]

Without --gguf, a random model of a real shape per family (by default hidden 2048 in heads
of 64, 24 layers: RWKV-7 1.5B's and RWKV-6 1.6B's sizes; random weights at the tests'
scales), built in memory; with --llama-bench (and --converter, llama.cpp's source tree),
written instead as the folder llama.cpp's converter reads (tests/rwkv_helpers.py's layouts,
the world vocabulary) and converted to an F32 GGUF under benchmarks/out/rwkv_prefill/, which
both engines run. --gguf: a given rwkv7 or rwkv6 GGUF instead.

Per model: llmrun's prefill of -p random tokens (one forward with a fresh state, f32, best of
3) chunked and one token at a time, in tokens/s, the two prefills' largest logit difference,
and llama-bench's pp (-p tokens, -n 0, the same thread count). Honest only on a quiet
machine. Results go to --out (benchmarks/out/rwkv_prefill.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from llama_server_compare import convert  # noqa: E402
from rwkv_helpers import (  # noqa: E402
    CONFIG,
    CONFIG6,
    VOCAB_FILE,
    hf_state_dict6,
    tiny_weights,
    tiny_weights6,
)
from safetensors.torch import save_file  # noqa: E402

from llmrun.loading.loader import load_model  # noqa: E402
from llmrun.models import rwkv6, rwkv7  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
# family: (its model module, the recurrence's name there, its one-token step)
RECURRENCES = {
    "rwkv7": (rwkv7, "wkv7_chunked", rwkv7.wkv7_token),
    "rwkv6": (rwkv6, "wkv6_chunked", rwkv6.wkv6_token),
}


def real_config(family: str, hidden: int, layers: int) -> dict:
    """A real model's config at `hidden` and `layers` (heads of 64): RWKV-7 1.5B's low-rank
    sizes and 4x feed-forward, RWKV-6 1.6B's 3.5x feed-forward and rescaling."""
    if family == "rwkv7":
        ranks = dict(decay_low_rank_dim=96, a_low_rank_dim=96, v_low_rank_dim=64)
        sizes = dict(head_dim=64, intermediate_size=4 * hidden, gate_low_rank_dim=256, **ranks)
        return CONFIG | dict(hidden_size=hidden, num_hidden_layers=layers, **sizes)
    sizes = dict(head_size=64, intermediate_size=int(hidden * 3.5) // 32 * 32, rescale_every=6)
    return CONFIG6 | dict(
        hidden_size=hidden, attention_hidden_size=hidden, num_hidden_layers=layers, **sizes
    )


def folder_weights(family: str, config: dict) -> dict[str, torch.Tensor]:
    """Random weights at the tests' scales under the keys of the folder llama.cpp's
    converter reads (fla-hub's RWKV-7, the Hugging Face port's RWKV-6)."""
    if family == "rwkv7":
        return tiny_weights(config=config)
    return hf_state_dict6(tiny_weights6(config=config))


def random_model(family: str, hidden: int, layers: int) -> torch.nn.Module:
    """The family's model of that shape in memory, folder_weights' weights under its names
    (the port's RWKV-6 weights are not divided: nothing is halved)."""
    config = real_config(family, hidden, layers) | dict(rescale_every=0)
    weights = folder_weights(family, config)
    if family == "rwkv6":  # as llmrun.loading.rwkv6.hf_checkpoint names them
        weights = {
            "lm_head.weight" if name == "head.weight"
            else "model." + name.removeprefix("rwkv.").replace("blocks.", "layers.", 1): w
            for name, w in weights.items()
        }  # fmt: skip
    module = RECURRENCES[family][0]
    with torch.device("meta"):
        model = module.Model(module.ModelArgs.from_config(config))
    model.load_state_dict(weights, assign=True)
    return model.eval()


def converted(family: str, hidden: int, layers: int, converter: Path) -> Path:
    """The random model as the folder llama.cpp's converter reads, converted to F32."""
    work = OUT / "rwkv_prefill" / f"{family}-{hidden}x{layers}"
    gguf = work.with_suffix(".gguf")
    if gguf.is_file():
        return gguf
    work.mkdir(parents=True, exist_ok=True)
    config = real_config(family, hidden, layers)
    save_file(folder_weights(family, config), work / "model.safetensors")
    (work / "config.json").write_text(json.dumps(config))
    shutil.copy(VOCAB_FILE, work / VOCAB_FILE.name)
    convert(converter, work, gguf, "--outtype", "f32")
    shutil.rmtree(work)
    return gguf


def per_token(step: Callable) -> Callable:
    """The recurrence one token at a time through `step` (a decode step's), as llmrun
    prefilled before its chunked form: [B, T, H, N] inputs, the rest passed whole."""

    def run(state: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = []
        for t in range(inputs[0].shape[1]):
            token = (x[:, t : t + 1] if x.dim() == 4 else x for x in inputs)
            out, state = step(state, *token)
            outputs.append(out)
        return torch.cat(outputs, dim=1), state

    return run


def prefill_speed(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The best of 3 prefills of ids [1, P] from a fresh state: (tokens/s, the logits)."""
    best, logits = float("inf"), None
    positions = torch.arange(ids.shape[1])[None]
    for _ in range(3):
        cache = model.new_cache(1, ids.shape[1], torch.float32, "cpu")
        with torch.inference_mode():
            started = time.perf_counter()
            logits = model(ids, positions, cache, last_only=True)
            best = min(best, time.perf_counter() - started)
    return ids.shape[1] / best, logits


def llmrun_speeds(model: torch.nn.Module, family: str, tokens: int) -> dict:
    """llmrun's prefill chunked and one token at a time, and how far their logits differ."""
    module, name, step = RECURRENCES[family]
    ids = torch.randint(0, model.args.vocab_size, (1, tokens), generator=torch.Generator())
    chunked, chunked_logits = prefill_speed(model, ids)
    chunked_form = getattr(module, name)
    setattr(module, name, per_token(step))
    try:
        stepped, stepped_logits = prefill_speed(model, ids)
    finally:
        setattr(module, name, chunked_form)
    return {
        "llmrun chunked pp t/s": round(chunked, 2),
        "llmrun per-token pp t/s": round(stepped, 2),
        "speedup": round(chunked / stepped, 2),
        "max logit diff": (chunked_logits - stepped_logits).abs().max().item(),
    }


def llama_bench_speed(llama_bench: Path, gguf: Path, tokens: int, threads: int) -> float:
    """llama-bench's pp`tokens` (mean tokens/s of 3 runs)."""
    result = subprocess.run(
        [str(llama_bench), "-m", str(gguf), "-p", str(tokens), "-n", "0", "-r", "3",
         "-t", str(threads), "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(result.stdout)[0]["avg_ts"]


def models(args: argparse.Namespace) -> Iterator[tuple[str, str, torch.nn.Module, Path | None]]:
    """(name, family, model, its GGUF if any) of each model to measure, one at a time."""
    if args.gguf is not None:
        model = load_model(args.gguf, torch.device("cpu"), "f32").model
        family = type(model).__module__.rsplit(".", 1)[-1]
        if family not in RECURRENCES:
            sys.exit(f"error: {args.gguf} holds {family}, not rwkv7 or rwkv6")
        yield args.gguf.name, family, model, args.gguf
        return
    for family in args.family:
        name = f"{family} random {args.hidden}x{args.layers}"
        if args.llama_bench is None:
            yield name, family, random_model(family, args.hidden, args.layers), None
        else:
            gguf = converted(family, args.hidden, args.layers, args.converter)
            yield name, family, load_model(gguf, torch.device("cpu"), "f32").model, gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family", nargs="+", choices=list(RECURRENCES), default=["rwkv7", "rwkv6"]
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=512)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, help="an rwkv7 or rwkv6 GGUF instead")
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench")
    parser.add_argument("--converter", type=Path, help="llama.cpp's source (with --llama-bench)")
    parser.add_argument("--out", type=Path, default=OUT / "rwkv_prefill.json")
    args = parser.parse_args()
    if args.llama_bench is not None and args.gguf is None and args.converter is None:
        parser.error("--llama-bench on a random model needs --converter")
    torch.set_num_threads(args.threads)
    results = {}
    for name, family, model, gguf in models(args):
        record = llmrun_speeds(model, family, args.prompt_tokens)
        if args.llama_bench is not None:
            record["llama.cpp pp t/s"] = round(
                llama_bench_speed(args.llama_bench, gguf, args.prompt_tokens, args.threads), 2
            )
        results[name] = record
        print(name, json.dumps(record), flush=True)
        del model  # before the next one is built
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

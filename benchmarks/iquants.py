"""The i-quants and ternary types (IQ1_S ... IQ4_XS, TQ1_0, TQ2_0) against llama.cpp (not
run by CI).

    PYTHONPATH=. python benchmarks/iquants.py --llama-cpp DIR [--types IQ2_XXS,IQ3_S]
        [--tokens 24] [--speed] [--layers 8] [-n 32] [-r 3] [-t 2] [--out FILE]

DIR holds llama.cpp's prebuilt llama-server and llama-bench (e.g. /tmp/llama-cpp-avx512/bin).

Parity: per type, a tiny Llama as tests/quant/test_iquants.py writes it (hidden 256,
2 layers, stories260K's tokenizer) with every matrix, embedding and output included, of
random blocks of that type, greedily decoded by llama-server (f32 KV cache, no flash
attention) and by llmrun from the same prompt ids: the steps whose tokens agree before
the first difference, and the largest difference of the chosen tokens' probabilities
over them. llama.cpp multiplies these types with activations quantized to Q8_K (llmrun
multiplies the exactly dequantized weights in f32), so small differences are expected;
a layout misread would scramble the tokens from the first step. IQ4_XS, whose kernels
were held exact before, runs first by default, to give the scale of those differences.
The first step's log-probabilities over the whole vocabulary are compared too. Both
comparisons run again with llmrun's 8-bit-activation kernels (`--activations q8`,
which quantize the activations as llama.cpp does: Q8_K, IQ4_NL's Q8_0), which should
come much closer to llama.cpp.

--speed: per type, a bigger Llama of random blocks (hidden 2048, FFN 8192, --layers
layers, 32 heads and 8 KV heads, stories260K's 512-token vocabulary), decoded by
`llama-bench -p 0 -n N` and `llmrun bench -p 0 -n N`, exact and with `--activations q8`:
tokens/s side by side. Timings are only worth reading on an otherwise idle machine.

Files go to benchmarks/out/iquants/; the figures to --out (benchmarks/out/iquants.json).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "quant"), str(ROOT / "benchmarks")]

from helpers import write_gguf  # noqa: E402
from llama_cpp_parity import (  # noqa: E402
    EXACT,
    PROMPT,
    llama_cpp_greedy,
    llmrun_greedy,
    token_bytes,
)
from test_iquants import LLAMA, TYPES, WEIGHT_RMS, model_blocks  # noqa: E402
from test_quant_blocks import write_scales  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SHARPEN = 8
SPEED_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=2048,
)


def matrix_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """The HF names and [rows, cols] of a Llama config's matrices."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (hidden, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, hidden),
            f"{layer}.mlp.gate_proj.weight": (ffn, hidden),
            f"{layer}.mlp.up_proj.weight": (ffn, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, ffn),
        }
    return shapes | {"lm_head.weight": (config["vocab_size"], hidden)}


def norms(config: dict, rng) -> dict[str, np.ndarray]:
    hidden = config["hidden_size"]
    names = ["model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        names += [f"model.layers.{i}.input_layernorm.weight"]
        names += [f"model.layers.{i}.post_attention_layernorm.weight"]
    return {n: (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32) for n in names}


def tiny_model(path: Path, ggml_type: T) -> Path:
    """The tests' tiny Llama, every matrix of `ggml_type` (weights of RMS ~0.05; the
    output matrix's SHARPEN times that, so that few steps are near ties)."""
    import torch

    rng = np.random.default_rng(int(ggml_type))
    state = {k: torch.from_numpy(v) for k, v in norms(LLAMA, rng).items()}
    for name, shape in matrix_shapes(LLAMA).items():
        rms = WEIGHT_RMS * (SHARPEN if name == "lm_head.weight" else 1)
        state[name] = (model_blocks(ggml_type, *shape, rng, rms)[0], ggml_type)
    return write_gguf(path, LLAMA, state)


def speed_model(path: Path, ggml_type: T, layers: int) -> Path:
    """A bigger Llama of random blocks: quants uniform, f16 scales small."""
    import torch

    config = {**LLAMA, **SPEED_SHAPE, "num_hidden_layers": layers}
    rng = np.random.default_rng(0)
    state = {k: torch.from_numpy(v) for k, v in norms(config, rng).items()}
    for name, (rows, cols) in matrix_shapes(config).items():
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
        write_scales(raw, ggml_type, lambda n: rng.uniform(1e-4, 1e-3, n))
        state[name] = (raw.reshape(rows, -1), ggml_type)
    return write_gguf(path, config, state)


def llama_cpp_steps(server: Server, tokens: int, path: Path) -> tuple[list[int], dict]:
    """llama.cpp's greedy ids and chosen tokens' probabilities by step: one entry a step
    where it gives one (a control token, such as <unk>, makes an entry of no bytes, which
    llama_cpp_greedy cannot place), else as llama_cpp_greedy places them."""
    body = {
        "prompt": PROMPT,
        "n_predict": tokens,
        "temperature": 0,
        "n_probs": 1,
        "cache_prompt": False,
        "ignore_eos": True,
        "return_tokens": True,
    }
    answer = server._post("/completion", body)
    ids, entries = answer["tokens"], answer["completion_probabilities"]
    if [e["id"] for e in entries] == ids:
        return ids, {i: math.exp(e["logprob"]) for i, e in enumerate(entries)}
    return llama_cpp_greedy(server, tokens, token_bytes(path))


def first_logprobs(server: Server, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next token's log-probabilities after PROMPT over the whole vocabulary, by
    llama.cpp and by llmrun, exact and with 8-bit activations."""
    import torch

    from llmrun.loading.loader import load_model
    from llmrun.quant.linear import set_activations

    body = {"prompt": PROMPT, "n_predict": 1, "n_probs": LLAMA["vocab_size"]}
    body |= {"temperature": 0, "cache_prompt": False}
    top = server._post("/completion", body)["completion_probabilities"][0]["top_logprobs"]
    theirs = np.full(LLAMA["vocab_size"], np.nan)
    for entry in top:
        theirs[entry["id"]] = entry["logprob"]
    model = load_model(path, torch.device("cpu"), "f32").model
    ours = []
    for activations in ("f32", "q8"):
        set_activations(model, activations)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])[0, -1]
        ours.append(torch.log_softmax(logits.double(), -1).numpy())
    return theirs, *ours


def agreeing(ours: list[int], theirs: list[int]) -> int:
    """The steps whose tokens agree before the first difference."""
    pairs = zip(ours, theirs, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), len(ours))


def parity(llama_cpp: Path, ggml_type: T, folder: Path, tokens: int) -> dict:
    path = tiny_model(folder / f"tiny-{ggml_type.name}.gguf", ggml_type)
    ours, our_probs, our_top2 = llmrun_greedy(path, tokens)
    ours_q8, _, _ = llmrun_greedy(path, tokens, "q8")
    server = Server(llama_cpp / "llama-server", path, folder / f"{ggml_type.name}.log", EXACT)
    try:
        theirs, their_probs = llama_cpp_steps(server, tokens, path)
        their_first, our_first, our_q8_first = first_logprobs(server, path)
    finally:
        server.close()
    known = ~np.isnan(their_first)
    first_diff = float(np.abs(their_first - our_first)[known].max())
    q8_diff = float(np.abs(their_first - our_q8_first)[known].max())
    spread = float(our_first.max() - our_first.min())
    agree, agree_q8 = (agreeing(mine, theirs) for mine in (ours, ours_q8))
    worst = max((abs(our_probs[i] - p) for i, p in their_probs.items() if i < agree), default=0)
    print(
        f"{ggml_type.name:8} first step: max |log-prob diff| {first_diff:.3f} (q8 "
        f"{q8_diff:.1e}) over {known.sum()} tokens (log-probs span {spread:.1f}); "
        f"{agree:3}/{tokens} tokens agree (q8 {agree_q8}), chosen-token prob diff {worst:.2e}"
    )
    result = dict(type=ggml_type.name, agree=agree, tokens=tokens, max_prob_diff=worst)
    result |= dict(first_step_max_logprob_diff=first_diff, first_step_logprob_span=spread)
    result |= dict(first_step_max_logprob_diff_q8=q8_diff, agree_q8=agree_q8)
    if agree < tokens:  # a near tie where they part?
        print(f"{'':8} llmrun's top two at step {agree}: {our_top2[agree]}")
        result["llmrun_top2_where_they_differ"] = our_top2[agree]
    return result


def speed(llama_cpp: Path, ggml_type: T, folder: Path, args: argparse.Namespace) -> dict:
    path = speed_model(folder / f"speed-{ggml_type.name}.gguf", ggml_type, args.layers)
    common = ["-p", "0", "-n", str(args.n_gen), "-r", str(args.repetitions)]
    common += ["-t", str(args.threads)]
    theirs = subprocess.run(
        [str(llama_cpp / "llama-bench"), "-m", str(path), *common, "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    llama_ts = json.loads(theirs.stdout)[0]["avg_ts"]
    result = dict(type=ggml_type.name, test=f"tg{args.n_gen}", llama_cpp=llama_ts)
    line = f"{ggml_type.name:8} tg{args.n_gen}: llama.cpp {llama_ts:.2f} t/s"
    for activations in ("f32", "q8"):
        ours = subprocess.run(
            [sys.executable, "-m", "llmrun", "bench", str(path), *common,
             "--activations", activations, "-o", "json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        llmrun_ts = json.loads(ours.stdout)[0]["avg_ts"]
        key = "llmrun" if activations == "f32" else "llmrun_q8"
        result[key] = llmrun_ts
        line += f", {key} {llmrun_ts:.2f} t/s ({llmrun_ts / llama_ts:.2f}x)"
    print(line)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--types", default=",".join(t.name for t in [T.IQ4_XS, T.IQ4_NL, *TYPES]))
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("-n", "--n-gen", type=int, default=32)
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "iquants.json")
    args = parser.parse_args()
    folder = OUT / "iquants"
    folder.mkdir(parents=True, exist_ok=True)
    types = [T[name] for name in args.types.split(",")]
    results = {"parity": [parity(args.llama_cpp, t, folder, args.tokens) for t in types]}
    if args.speed:
        results["speed"] = [speed(args.llama_cpp, t, folder, args) for t in types]
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

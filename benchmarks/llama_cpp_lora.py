"""llama.cpp runs the tests' LoRA adapters as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_lora.py --llama-cpp DIR [--tokens 24]
        [--out FILE]

tests/loading/test_lora.py holds llmrun's logits to PEFT's on a tiny random Llama and
Qwen2 with a LoRA adapter written as convert_lora_to_gguf.py writes it; this serves the
same base GGUF with DIR/llama-server --lora (or --lora-scaled) and greedily decodes
--tokens tokens from the same prompt ids with both engines (llama_cpp_parity's loop:
llama.cpp's /completion at temperature 0 with the chosen token's probability per step,
its KV cache in f32, flash attention off). For each case it prints the steps where the
tokens agree before the first difference, the largest difference of the chosen tokens'
probabilities over them, and, as a control, how many steps llama.cpp's tokens with the
adapter agree with llmrun's without it. Figures go to --out
(benchmarks/out/llama_cpp_lora.json). Q8_0 bases run with --activations q8, as llama.cpp
multiplies them.

Found (2026-12, this CPU's AVX-512 build): F32 and Q8_0 bases with F32 adapters, scales
1 and 0.5: 24/24 tokens, probabilities within 6e-7 (llmrun without the adapter: 0-1/24).
Q8_0 adapters (lora_a in Q8_0, lora_b in F16) part after 0-18 tokens: llama.cpp rounds the
adapter's activations too (to Q8_0 before lora_a, to F16 before lora_b), which llmrun
computes in f32; rounding them so in llmrun gives llama.cpp's tokens (24/24 in three of
the four cases, 20/24 in the fourth).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import llama_cpp_parity  # noqa: E402
from llama_cpp_parity import EOS, EXACT, PROMPT, token_bytes  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
ALPHA = 16.0


def llmrun_greedy(
    path: Path, adapters: list[tuple[Path, float]], tokens: int, activations: str = "f32"
):
    """llmrun's greedy ids (the end-of-generation token never chosen, as llama.cpp's
    ignore_eos) and their probabilities, through the KV cache a token at a time;
    `activations` as --activations."""
    from llmrun.loading.loader import load_model
    from llmrun.quant.linear import set_activations

    model = load_model(path, torch.device("cpu"), "f32", adapters).model
    set_activations(model, activations)
    cache = model.new_cache(1, len(PROMPT) + tokens + 1, torch.float32, "cpu")
    ids, probs, feed, start = [], [], PROMPT, 0
    with torch.no_grad():
        for _ in range(tokens):
            positions = torch.arange(start, start + len(feed))[None]
            logits = model(torch.tensor([feed]), positions, cache)[0, -1]
            p = torch.softmax(logits.double(), -1)
            token = int(p.index_fill(0, torch.tensor([EOS]), -1).argmax())
            ids.append(token)
            probs.append(float(p[token]))
            start += len(feed)
            feed = [token]
    return ids, probs


def llama_cpp_greedy(server: Server, tokens: int, vocab: list[bytes]):
    """llama_cpp_parity's, with stories260K's <unk>, <s> and </s> printing nothing."""
    return llama_cpp_parity.llama_cpp_greedy(server, tokens, [b"", b"", b"", *vocab[3:]])


def write_case(folder: Path, family: str, qtype, adapter_qtype) -> tuple[Path, Path]:
    """The tests' base GGUF of `family` (2-D tensors in `qtype`) and its GGUF adapter (in
    `adapter_qtype`, the converter's F16 where rows are not whole blocks)."""
    from helpers import tiny_hf_model, write_gguf
    from lora_helpers import peft_model, write_gguf_lora

    hf, config = tiny_hf_model(family)
    peft = peft_model(hf, rank=8, alpha=ALPHA)
    tag = f"{family}-{qtype.name.lower()}"
    base = write_gguf(folder / f"{tag}.gguf", config, hf.state_dict(), qtype=qtype)
    name = f"{tag}-lora-{adapter_qtype.name.lower()}.gguf"
    adapter = write_gguf_lora(folder / name, peft, config, ALPHA, qtype=adapter_qtype)
    return base, adapter


def agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def main() -> None:
    from gguf import GGMLQuantizationType

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_lora.json")
    args = parser.parse_args()
    folder = OUT / "lora"
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    f32, q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
    for family in ("llama", "qwen2"):
        for qtype, adapter_qtype in ((f32, f32), (q8_0, f32), (q8_0, q8_0)):
            base, adapter = write_case(folder, family, qtype, adapter_qtype)
            vocab = token_bytes(base)
            # Q8_0: llama.cpp quantizes the activations to 8 bits, as --activations q8 does.
            activations = "f32" if qtype == f32 else "q8"
            plain, _ = llmrun_greedy(base, [], args.tokens, activations)
            for scale in (None, 1.0, 0.5):  # None: the base alone, llama.cpp's own drift
                if scale is None and adapter_qtype != f32:
                    continue  # the base was compared with the F32 adapter's
                name = adapter.stem + (" base" if scale is None else f" x{scale}")
                adapters = [] if scale is None else [(adapter, scale)]
                ours, our_probs = llmrun_greedy(base, adapters, args.tokens, activations)
                flags = () if scale is None else ("--lora-scaled", f"{adapter}:{scale}")
                log = folder / f"{base.stem}-{scale}.log"
                server = Server(args.llama_cpp / "llama-server", base, log, EXACT + flags)
                try:
                    theirs, their_probs = llama_cpp_greedy(server, args.tokens, vocab)
                finally:
                    server.close()
                agree = agreeing(ours, theirs)
                worst = max(
                    (abs(our_probs[i] - p) for i, p in their_probs.items() if i < agree), default=0
                )
                control = agreeing(plain, theirs)
                results.append(
                    dict(
                        case=name, activations=activations, agree=agree, tokens=args.tokens,
                        max_prob_diff=worst, agree_without_adapter=control,
                    )
                )  # fmt: skip
                print(
                    f"{name:30} {agree:3}/{args.tokens} tokens agree, chosen-token probability "
                    f"diff {worst:.2e} (llmrun without the adapter: {control}/{args.tokens})"
                )
                if agree < args.tokens:
                    print(f"{'':30} llmrun {ours}\n{'':30} llama.cpp {theirs}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

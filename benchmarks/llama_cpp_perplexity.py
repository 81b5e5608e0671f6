"""llama.cpp's perplexity of a GGUF over a text, through llama-server, next to llmrun's
(not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_perplexity.py --llama-cpp DIR [--model FILE]
        [--file TEXT] [--ctx-size 64] [--chunks N] [--kv f32|f16] [--out FILE]
    PYTHONPATH=. python benchmarks/llama_cpp_perplexity.py --llama-cpp DIR --quantize q8_0 ...

llama-perplexity is not among the prebuilt binaries (DIR holds llama-server), and
llama-server returns no log-probabilities of prompt tokens (its /v1/completions refuses
`echo`). It does return, with `n_probs`, the log-probabilities of the next token over as
much of the vocabulary as asked, before sampling: for a model whose vocabulary is small
enough to ask for all of it (stories260K's 512 tokens, the default model here), one
/completion per scored position, its prompt the chunk up to that position (token ids, the
cache reusing the chunk so far), gives llama-perplexity's numbers. The text is tokenized
by llama.cpp (/tokenize, special tokens as text), chunked by llama-perplexity's rule
(written out here: whole chunks of ctx tokens, BOS first in each where the vocabulary
adds one, positions ctx/2 .. ctx-2 scored) and its PPL and error computed with
llama-perplexity's formulas. It prints both engines' PPL and, position by position, the
largest difference of the right token's log-probability and the mean KL divergence of
llmrun's distribution from llama.cpp's; the figures go to --out
(benchmarks/out/llama_cpp_perplexity.json). --kv f32 (default) gives llama.cpp an f32
KV cache, f16 its default.

With --quantize TYPE (q8_0 or q4_0) it checks the KL-divergence pair instead: stories260K
written as a GGUF of TYPE (by the tests' writer; matrices whose rows are no whole number
of blocks stay F32, as llama-quantize leaves them), llama.cpp's distributions of the F32
file and of that one (both through llama-server) give the statistics written out here,
and llmrun's `--kl-divergence` pair gives its own, with exact (f32) activations and with
llama.cpp's 8-bit ones (`--activations q8`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from tokenizer_fuzz import Server  # noqa: E402

from llmrun import api, perplexity  # noqa: E402
from llmrun.paths import BUNDLED_MODEL  # noqa: E402

OUT = ROOT / "benchmarks" / "out"


def llama_cpp_ppl(nll: list[float]) -> tuple[float, float]:
    """llama-perplexity's final estimate: exp of the mean, and its error."""
    count = len(nll)
    mean = sum(nll) / count
    variance = sum(x * x for x in nll) / count - mean * mean
    ppl = math.exp(mean)
    return ppl, math.sqrt(variance / (count - 1)) * ppl


def next_token_logprobs(server: Server, prompt: list[int], vocab: int) -> torch.Tensor:
    """llama.cpp's log-probabilities [vocab] of the token after `prompt`."""
    answer = server._post(
        "/completion",
        {
            "prompt": prompt,
            "n_predict": 1,
            "n_probs": vocab,
            "samplers": [],
            "temperature": 0,
            "cache_prompt": True,
        },
    )
    entries = answer["completion_probabilities"][0]["top_logprobs"]
    out = torch.full((vocab,), -math.inf, dtype=torch.float64)
    for entry in entries:
        out[entry["id"]] = entry["logprob"]
    if len(entries) != vocab:
        raise SystemExit(f"llama-server returned {len(entries)} log-probs of {vocab}")
    return out


def llama_cpp_scored(
    binary: Path, model: Path, text: str, ctx: int, chunks: int | None, vocab: int, kv: str
) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's tokens of `text` and its log-probs [N, ctx - 1 - ctx // 2, vocab] at
    llama-perplexity's scored positions of its chunks (whole chunks, BOS first where the
    vocabulary adds one)."""
    extra = ("-c", str(max(ctx, 512)), "--cache-type-k", kv, "--cache-type-v", kv, "-fa", "off")
    server = Server(binary, model, OUT / "perplexity.log", extra)
    try:
        tokens = server.tokenize(text, add_special=True, parse_special=False)
        plain = server.tokenize(text, add_special=False, parse_special=False)
        bos = tokens[0] if len(tokens) > len(plain) else None
        count = min(len(tokens) // ctx, chunks or len(tokens))
        rows = []
        for i in range(count):
            chunk = tokens[i * ctx : (i + 1) * ctx]
            if bos is not None:
                chunk[0] = bos
            for p in range(ctx // 2, ctx - 1):
                rows.append(next_token_logprobs(server, chunk[: p + 1], vocab))
    finally:
        server.close()
    return tokens, torch.stack(rows).view(count, ctx - 1 - ctx // 2, vocab)


def quantized_stories(path: Path, qtype: str) -> Path:
    """stories260K (its model folder's weights) as a GGUF of `qtype`, the matrices whose
    rows are no whole number of 32-weight blocks (ffn_down's 172) in F32."""
    import gguf
    import numpy as np
    from helpers import STORIES_HF, write_gguf

    from llmrun.loading.safetensors_io import load_tensors

    config = json.loads((STORIES_HF / "config.json").read_text())
    tensors: dict = {}
    for name, tensor in load_tensors(STORIES_HF / "model.safetensors").items():
        if tensor.ndim == 2 and tensor.shape[1] % 32:
            raw = tensor.float().numpy().view(np.uint8)
            tensors[name] = (raw, gguf.GGMLQuantizationType.F32)
        else:
            tensors[name] = tensor.float()
    return write_gguf(path, config, tensors, gguf.GGMLQuantizationType[qtype.upper()])


def divergence(base: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict:
    """The KL-divergence statistics written out from two models' log-probs [..., vocab]."""
    base, other = base.flatten(0, -2), other.flatten(0, -2)
    targets = targets.flatten()[:, None]
    kld = (base.exp() * (base - other)).sum(-1)
    nll_q, nll_base = -other.gather(1, targets), -base.gather(1, targets)
    dp = nll_q.neg().exp() - nll_base.neg().exp()
    return dict(
        ppl=math.exp(float(nll_q.mean())),
        base_ppl=math.exp(float(nll_base.mean())),
        kld_mean=float(kld.mean()),
        kld_99=float(torch.quantile(kld, 0.99)),
        kld_max=float(kld.max()),
        rms_delta_p=float(dp.square().mean().sqrt()),
        same_top_p=float((base.argmax(-1) == other.argmax(-1)).double().mean()),
    )


def compare_quantized(args: argparse.Namespace, text: str) -> dict:
    """The KL-divergence pair on stories260K F32 against a --quantize GGUF of it."""
    from llmrun import kl_divergence

    ctx = args.ctx_size
    quantized = quantized_stories(OUT / f"stories260K-{args.quantize}.gguf", args.quantize)
    binary = args.llama_cpp / "llama-server"
    base_engine = api.load(str(args.model), device="cpu", ctx_size=ctx)
    chunks = perplexity.text_chunks(base_engine.tokenizer, text, ctx, args.chunks)
    vocab = base_engine.tokenizer.vocab_size
    _, theirs_base = llama_cpp_scored(binary, args.model, text, ctx, args.chunks, vocab, args.kv)
    _, theirs_q = llama_cpp_scored(binary, quantized, text, ctx, args.chunks, vocab, args.kv)
    targets = perplexity.scored_targets(chunks)
    result = dict(
        model=str(args.model), quantized=args.quantize, ctx_size=ctx, chunks=len(chunks),
        kv=args.kv, llama_cpp=divergence(theirs_base, theirs_q, targets),
    )  # fmt: skip
    base_file = OUT / "stories260K.kld"
    for _ in kl_divergence.save_base(
        base_engine.model, base_engine.new_cache, base_engine.tokenizer, chunks, base_file, "base"
    ):
        pass
    for activations in ("f32", "q8"):
        engine = api.load(str(quantized), device="cpu", ctx_size=ctx, activations=activations)
        base = kl_divergence.read_base(base_file, engine.tokenizer)
        *_, step = kl_divergence.compare(engine.model, engine.new_cache, base)
        s = step.divergence.summary()
        result[f"llmrun_activations_{activations}"] = dict(
            ppl=s["ppl"], base_ppl=s["base_ppl"], kld_mean=s["kld"]["mean"],
            kld_99=s["kld"]["99.0%"], kld_max=s["kld"]["max"],
            rms_delta_p=s["delta_p"]["rms"], same_top_p=s["same_top_p"],
        )  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--file", type=Path, help="the text (default: tests' STORY)")
    parser.add_argument("--ctx-size", type=int, default=64)
    parser.add_argument("--chunks", type=int)
    parser.add_argument("--kv", choices=("f32", "f16"), default="f32")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_perplexity.json")
    parser.add_argument("--quantize", choices=("q8_0", "q4_0"))
    args = parser.parse_args()
    if args.file is not None:
        text = args.file.read_text(encoding="utf-8").removesuffix("\n")
    else:
        from test_perplexity import STORY as text
    ctx = args.ctx_size
    OUT.mkdir(parents=True, exist_ok=True)
    if args.quantize:
        _write(args.out, compare_quantized(args, text))
        return

    engine = api.load(str(args.model), device="cpu", ctx_size=ctx)
    chunks = perplexity.text_chunks(engine.tokenizer, text, ctx, args.chunks)
    ours = torch.stack(list(perplexity.scored_logprobs(engine.model, engine.new_cache, chunks)))
    estimate = list(perplexity.estimates(ours, chunks))[-1]
    vocab = ours.shape[-1]
    binary = args.llama_cpp / "llama-server"
    tokens, theirs = llama_cpp_scored(binary, args.model, text, ctx, args.chunks, vocab, args.kv)
    same_tokens = tokens == perplexity.tokenize(engine.tokenizer, text)
    count = len(theirs)
    their_chunks = torch.tensor(tokens[: count * ctx]).view(count, ctx)
    nll = (-theirs.gather(2, perplexity.scored_targets(their_chunks)[..., None])).flatten().tolist()
    ppl, error = llama_cpp_ppl(nll)
    result = dict(
        model=str(args.model),
        ctx_size=ctx,
        chunks=count,
        kv=args.kv,
        same_tokens=same_tokens,
        tokens_scored=len(nll),
        llama_cpp_ppl=ppl,
        llama_cpp_error=error,
        llmrun_ppl=estimate.ppl,
        llmrun_error=estimate.error,
        relative_difference=estimate.ppl / ppl - 1,
    )
    if same_tokens:
        ours64 = ours.double()
        targets = perplexity.scored_targets(chunks)[..., None]
        diff = (ours64.gather(2, targets) - theirs.gather(2, targets)).abs()
        kld = (theirs.exp() * (theirs - ours64)).sum(-1)
        result.update(
            max_abs_target_logprob_diff=float(diff.max()),
            max_abs_logprob_diff=float((ours64 - theirs).abs().max()),
            mean_kld_llama_cpp_to_llmrun=float(kld.mean()),
            same_top_token=float((ours64.argmax(-1) == theirs.argmax(-1)).double().mean()),
        )
    _write(args.out, result)


def _write(out: Path, result: dict) -> None:
    """Print the record and add it to the records in `out`."""
    print(json.dumps(result, indent=1))
    records = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps([*records, result], indent=1))


if __name__ == "__main__":
    main()

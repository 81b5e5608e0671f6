"""llama.cpp itself reranks with the GGUFs the reranking tests write, as llmrun does (not
run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_rerank.py --llama-cpp DIR [--out FILE]

The reranking tests hold llmrun's scores to transformers' on tiny random cross-encoders
written as llama.cpp's converter writes them (tests/rerank_helpers.py). This is the other
half: each file goes into benchmarks/out/rerank/, is served with `DIR/llama-server
--reranking`, and its /v1/rerank scores of the tests' query and documents (each engine
tokenizing the pairs itself from the file's vocabulary) are compared with llmrun's
Engine.rerank and with transformers': the largest absolute differences, whether the
orders agree and both engines' token counts go to --out
(benchmarks/out/llama_cpp_rerank.json).

The files: XLM-RoBERTa-style (byte-level BPE, <s> q </s></s> d </s>, the whole head);
BERT as the converter writes it (its pooler dropped: both engines score classifier(h[CLS]),
which transformers does not); BERT with its pooler kept as `cls` (the file scores as
transformers); and both BERT files again with token type 1's row equal to type 0's, since
llama.cpp gives every token type 0 where BERT's document tokens are type 1 (llmrun's and
transformers' way): with equal rows that difference vanishes and the rest is compared.
And a Qwen3-Reranker (a causal LM, stories260K's vocabulary) with its rerank prompt: the
probability of "yes".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from rerank_helpers import (  # noqa: E402
    DOCUMENTS,
    QUERY,
    causal_reference,
    hf_causal_reranker,
    hf_reranker,
    reference_scores,
    write_causal_reranker_gguf,
    write_reranker_dir,
    write_reranker_gguf,
)
from tokenizer_fuzz import Server  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off")


def family(kind: str, pooler: bool = False, one_type: bool = False) -> Callable:
    """A writer of a cross-encoder of `kind` (its folder and GGUF), the BERT pooler kept
    as cls where `pooler`, token type 1's row set to type 0's where `one_type`; it
    returns transformers' scores."""

    def write(folder: Path, path: Path) -> list[float]:
        hf = hf_reranker(kind)
        if one_type:
            with torch.no_grad():
                types = hf.bert.embeddings.token_type_embeddings.weight
                types[1] = types[0]
        write_reranker_dir(folder, hf)
        write_reranker_gguf(path, hf, folder, pooler=pooler)
        return reference_scores(hf, folder)

    return write


def qwen3_reranker(folder: Path, path: Path) -> list[float]:
    """Qwen3-Reranker as conversion/qwen.py writes it (stories260K's vocabulary)."""
    hf = hf_causal_reranker()
    write_causal_reranker_gguf(path, hf)
    return causal_reference(hf)


FAMILIES: dict[str, Callable] = {
    "xlm-roberta": family("xlm-roberta"),
    "bert-converted": family("bert"),
    "bert-pooler": family("bert", pooler=True),
    "bert-converted-one-type": family("bert", one_type=True),
    "bert-pooler-one-type": family("bert", pooler=True, one_type=True),
    "qwen3-reranker": qwen3_reranker,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_rerank.json")
    args = parser.parse_args()
    from llmrun import api

    results = []
    for name in args.family or list(FAMILIES):
        folder = OUT / "rerank" / name
        folder.mkdir(parents=True, exist_ok=True)
        path = OUT / "rerank" / f"{name}.gguf"
        expected = FAMILIES[name](folder, path)
        ours = api.load(str(path), device="cpu", generate=False).rerank(QUERY, DOCUMENTS)
        extra = ("--reranking", "-ub", "512", *EXACT)
        server = Server(
            args.llama_cpp / "llama-server", path, OUT / "rerank" / f"{name}.log", extra
        )
        try:
            answer = server._post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
        finally:
            server.close()
        theirs = [0.0] * len(DOCUMENTS)
        for result in answer["results"]:
            theirs[result["index"]] = result["relevance_score"]
        ours_t, theirs_t = torch.tensor(ours.scores), torch.tensor(theirs)
        record = dict(
            family=name,
            llmrun=ours.scores,
            llama_cpp=theirs,
            transformers=expected,
            max_abs_diff_llama_cpp=float((ours_t - theirs_t).abs().max()),
            max_abs_diff_transformers=float((ours_t - torch.tensor(expected)).abs().max()),
            same_order=[r.index for r in ours.ranked()] == [r["index"] for r in answer["results"]],
            tokens_llmrun=ours.prompt_tokens,
            tokens_llama_cpp=answer["usage"]["prompt_tokens"],
        )
        results.append(record)
        print(
            f"{name:24} |llmrun - llama.cpp| {record['max_abs_diff_llama_cpp']:.2e}, "
            f"|llmrun - transformers| {record['max_abs_diff_transformers']:.2e}, "
            f"same order {record['same_order']}, tokens {ours.prompt_tokens} / "
            f"{record['tokens_llama_cpp']}"
        )
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

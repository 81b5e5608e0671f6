"""llama.cpp itself tokenizes the Unigram ("t5") GGUFs the tests write, as llmrun does (not
run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_unigram.py [--llama-cpp DIR] [-n 500]
        [--out FILE]

1. A tiny XLM-RoBERTa shaped as bge-m3 (tests/models/test_xlm_roberta_unigram.py: "bert"
   arch, CLS pooling) with a real SentencePiece Unigram vocabulary trained on the tests'
   corpus (nmt_nfkc: a real precompiled charsmap), written as llama.cpp's converter writes
   XLMRobertaModel, served by `DIR/llama-server --embeddings`: each of the tests' strings
   (tests/unigram_helpers.py TEXTS) through POST /tokenize in the four (add_special,
   parse_special) modes against llmrun's (add_special: BOS and EOS as the file says), and
   POST /v1/embeddings of the text against llmrun's Engine.embed of it (each tokenizes it
   itself: the largest difference of the vectors).
2. The hand-made vocabulary of tests/test_unigram.py's rules (unigram_helpers.RULES_VOCAB):
   llama.cpp's ids of each of RULE_TEXTS against the ids the test expects.
3. benchmarks/tokenizer_fuzz.py's differential fuzz (-n random texts plus the tests' strings
   in the four modes, random id sequences decoded) on each vocabulary: nmt_nfkc and
   identity normalization (the latter keeping extra whitespace; with and without the space
   prefix), in T5's and XLM-R's layouts, and the rules one.

The counts go to --out (benchmarks/out/llama_cpp_unigram.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import gguf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

import tokenizer_fuzz  # noqa: E402
import unigram_helpers as h  # noqa: E402
from test_bert import hf_model  # noqa: E402
from test_xlm_roberta_unigram import write_xlmr_gguf  # noqa: E402

from llmrun.api import load  # noqa: E402
from llmrun.tokenizer import load_tokenizer  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "llama_cpp_unigram.json"
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off")
# Each vocabulary's GGUF tokenizer metadata: the trained ones, and the rules one.
VOCABULARIES = {name: lambda name=name: h.trained(name)[1] for name in h.VARIANTS}
VOCABULARIES["rules"] = h.rules_metadata


def rules_check(llama_cpp: Path, work: Path) -> dict:
    """The ids tests/test_unigram.py expects of each of RULE_TEXTS, from llama.cpp."""
    vocab = h.write_tokenizer_gguf(work / "rules-vocab.gguf", h.rules_metadata())
    model = work / "rules.gguf"
    tokenizer_fuzz.write_model(vocab, model)
    server = tokenizer_fuzz.Server(llama_cpp / "llama-server", model, work / "rules.log")
    try:
        got = {text: server.tokenize(text, False, False) for text in h.RULE_TEXTS}
    finally:
        server.close()
    wrong = {t: {"llama.cpp": ids, "expected": h.RULE_TEXTS[t]} for t, ids in got.items()}
    wrong = {t: v for t, v in wrong.items() if v["llama.cpp"] != v["expected"]}
    return {"texts": len(got), "mismatches": len(wrong), "cases": wrong}


def embedding_server_check(llama_cpp: Path, work: Path) -> dict:
    """Part 1 (module docstring)."""
    metadata = VOCABULARIES["nfkc-xlmr"]()
    hf = hf_model("xlm-roberta", vocab_size=len(metadata[gguf.Keys.Tokenizer.LIST]))
    path = write_xlmr_gguf(work / "xlmr.gguf", hf, metadata)
    tok = load_tokenizer(path)
    engine = load(str(path), generate=False)
    server = tokenizer_fuzz.Server(
        llama_cpp / "llama-server", path, work / "xlmr.log", ("--embeddings", *EXACT)
    )
    mismatches, cases, worst = (
        {tokenizer_fuzz.mode_name(m): 0 for m in tokenizer_fuzz.MODES},
        [],
        0.0,
    )
    try:
        for text in h.TEXTS:
            for mode in tokenizer_fuzz.MODES:
                expected = server.tokenize(text, *mode)
                got = tokenizer_fuzz.llmrun_encode(tok, text, mode)
                if tokenizer_fuzz.encode_differs(tok, expected, got):
                    mismatches[tokenizer_fuzz.mode_name(mode)] += 1
                    cases.append({"text": text, "mode": mode, "llama.cpp": expected, "llmrun": got})
            if not text.strip():
                continue
            theirs = server._post("/v1/embeddings", {"input": text})["data"][0]["embedding"]
            ours = engine.embed([text]).vectors[0].float()
            worst = max(worst, (torch.tensor(theirs) - ours).abs().max().item())
    finally:
        server.close()
    return {"texts": len(h.TEXTS), "encode": mismatches, "cases": cases, "embed_max_diff": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama-cpp-avx512/bin"))
    parser.add_argument("-n", type=int, default=500, help="random texts per vocabulary")
    parser.add_argument("--seqs", type=int, default=300, help="random id sequences")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    fuzz_args = argparse.Namespace(
        n=args.n, seqs=args.seqs, minimise=10, seed="0", llama_cpp=args.llama_cpp, lcpp_python=None
    )
    report = {}
    with tempfile.TemporaryDirectory(prefix="llama_cpp_unigram.") as work:
        work = Path(work)
        report["xlmr-embeddings"] = embedding_server_check(args.llama_cpp, work)
        part = report["xlmr-embeddings"]
        print(
            f"xlmr bert GGUF: {part['texts']} texts, /tokenize mismatches {part['encode']}, "
            f"embedding max |diff| {part['embed_max_diff']:.2e}",
            flush=True,
        )
        for case in part["cases"]:
            print("   ", json.dumps(case, ensure_ascii=True)[:400], flush=True)
        report["rules"] = rules_check(args.llama_cpp, work)
        print(f"rules: {report['rules']}", flush=True)
        # The tests' strings and rule texts are fuzzed too, with every vocabulary.
        tokenizer_fuzz.FIXED = [*tokenizer_fuzz.FIXED, *h.TEXTS, *h.RULE_TEXTS]
        for variant, metadata in VOCABULARIES.items():
            vocab = h.write_tokenizer_gguf(work / f"{variant}.gguf", metadata())
            fuzzed = tokenizer_fuzz.fuzz_vocab(variant, vocab, fuzz_args, work)
            report[f"fuzz-{variant}"] = fuzzed
            print(tokenizer_fuzz.summary(fuzzed), flush=True)
            for case in fuzzed["encode_cases"] + fuzzed["decode_cases"]:
                print("   ", json.dumps(case, ensure_ascii=True)[:400], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""llama.cpp itself tokenizes the "whitespace" GGUF vocabulary (jina-embeddings-v2-base-zh's
kind) that tests/tokenizer/test_whitespace_vocab.py writes, as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_whitespace.py [--llama-cpp DIR] [-n 300]

The test's trained vocabulary, written as llama.cpp's converter writes it (tokenizer model
and pre "whitespace", the merges, tokenizer.ggml.normalizer.lowercase true, <s> ... </s>),
in a tiny llama (benchmarks/tokenizer_fuzz.py write_model) served by `DIR/llama-server`:
the test's strings and -n random ones (words of the training corpus, capitals, whitespace of
every kind, characters without a token) through POST /tokenize with and without special
tokens, against llmrun's ids. Prints the count of strings whose ids differ.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import gguf
from gguf import Keys

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "tokenizer"), str(ROOT / "benchmarks")]

import test_whitespace_vocab as w  # noqa: E402
import tokenizer_fuzz  # noqa: E402

from llmrun.tokenizer import load_tokenizer  # noqa: E402

SPACES = [" ", "  ", "\t", "\n", "\r\n", "\u3000", "\xa0", "\u2003"]


def write_vocab(path: Path, metadata: dict) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(metadata[Keys.Tokenizer.MODEL])
    writer.add_tokenizer_pre(metadata[Keys.Tokenizer.PRE])
    writer.add_token_list(metadata[Keys.Tokenizer.LIST])
    writer.add_token_types(metadata[Keys.Tokenizer.TOKEN_TYPE])
    writer.add_token_merges(metadata[Keys.Tokenizer.MERGES])
    writer.add_bos_token_id(metadata[Keys.Tokenizer.BOS_ID])
    writer.add_eos_token_id(metadata[Keys.Tokenizer.EOS_ID])
    writer.add_unk_token_id(metadata[Keys.Tokenizer.UNK_ID])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_bool(w.LOWERCASE_KEY, True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_texts(n: int, rng: random.Random) -> list[str]:
    words = " ".join(w.CORPUS).split() + ["☃", "Ω", "ÄÖÜ", "İstanbul", "12345"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            word = rng.choice(words)
            if rng.random() < 0.3:
                word = word.upper()
            parts += [word, rng.choice(SPACES)]
        out.append("".join(parts[: rng.randint(1, len(parts))]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama-cpp-avx512/bin"))
    parser.add_argument("-n", type=int, default=300)
    args = parser.parse_args()
    metadata = w.metadata(w.train(), "whitespace", "whitespace", True)
    texts = w.TEXTS + random_texts(args.n, random.Random(0))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vocab = write_vocab(work / "vocab.gguf", metadata)
        model = work / "model.gguf"
        tokenizer_fuzz.write_model(vocab, model)
        ours = load_tokenizer(model)
        server = tokenizer_fuzz.Server(args.llama_cpp / "llama-server", model, work / "log")
        try:
            for mode in ((False, False), (True, False)):
                differ = []
                for text in texts:
                    theirs = server.tokenize(text, *mode)
                    if tokenizer_fuzz.llmrun_encode(ours, text, mode) != theirs:
                        differ.append(text)
                name = tokenizer_fuzz.mode_name(mode)
                print(f"{name}: {len(differ)} of {len(texts)} strings differ")
                for text in differ[:5]:
                    print(f"  {text!r}")
        finally:
            server.close()


if __name__ == "__main__":
    main()

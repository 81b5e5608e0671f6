"""llama.cpp's merging next to llmrun's two (C, and the tokenizers library's BPE) where they
can part: SentencePiece scores with ties, and random BPE merges (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_merging.py --llama-cpp DIR [-n 300]

DIR holds llama-server (e.g. a copy of ../shared/peers/llama-cpp-avx512/bin with the run bit
set). Each case's vocabulary goes into a tiny llama (tokenizer_fuzz.write_model), served by
llama-server; -n random texts go through its /tokenize (add_special and parse_special off)
and through llmrun's tokenizer built both ways; the counts of texts where each differs from
llama.cpp are printed. The cases: Gemma 4's 262,144 tokens as a SentencePiece vocabulary with
scores drawn from 51 values (ties everywhere), llama-spm with its own scores, and random
byte-level BPE vocabularies (tests/test_gguf_bpe.random_bpe).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from gguf import GGUFValueType, GGUFWriter, Keys

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from test_gguf_bpe import random_bpe, random_text  # noqa: E402
from tokenizer_fuzz import Server, write_model  # noqa: E402

from llmrun import native  # noqa: E402
from llmrun.loading.gguf_io import read_gguf  # noqa: E402
from llmrun.tokenizer import Tokenizer  # noqa: E402

VOCAB_DIR = Path(__file__).parents[1] / "tests" / "data" / "cache" / "vocab"


def write_vocab(metadata: dict, path: Path) -> None:
    writer = GGUFWriter(path, "llama")
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            sub = {str: GGUFValueType.STRING, float: GGUFValueType.FLOAT32}.get(
                type(value[0]), GGUFValueType.INT32
            )
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32)
        else:
            writer.add_key_value(key, value, GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def cases() -> dict[str, dict]:
    gemma = read_gguf(VOCAB_DIR / "ggml-vocab-gemma-4.gguf", with_tensors=False).metadata
    rng = random.Random(0)
    tied = {k: v for k, v in gemma.items() if k != Keys.Tokenizer.MERGES}
    tied[Keys.Tokenizer.MODEL] = "llama"
    tied[Keys.Tokenizer.SCORES] = [float(rng.randint(-50, 0)) for _ in tied[Keys.Tokenizer.LIST]]
    found = {"spm-262k-tied": tied}
    found["llama-spm"] = read_gguf(VOCAB_DIR / "ggml-vocab-llama-spm.gguf").metadata
    for seed in range(3):
        found[f"random-bpe-{seed}"] = random_bpe(random.Random(seed), 300)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("-n", type=int, default=300)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmrun-merging-"))
    for name, metadata in cases().items():
        merged = Tokenizer.from_gguf_metadata(metadata, name)
        real = native.tokenize_library
        native.tokenize_library = lambda: None
        library = Tokenizer.from_gguf_metadata(metadata, name)
        native.tokenize_library = real
        write_vocab(metadata, work / f"{name}.gguf")
        write_model(work / f"{name}.gguf", work / f"{name}-model.gguf")
        server = Server(args.llama_cpp / "llama-server", work / f"{name}-model.gguf", work / "log")
        rng = random.Random(name)
        if name.startswith("random-bpe"):
            texts = ["".join(rng.choice("abcd \n") for _ in range(40)) for _ in range(args.n)]
        else:
            texts = [random_text(rng) for _ in range(args.n)]
        wrong = {"C": 0, "library": 0}
        try:
            for text in texts:
                expected = server.tokenize(text, add_special=False, parse_special=False)
                for way, tok in (("C", merged), ("library", library)):
                    wrong[way] += tok.encode(text, add_bos=False, parse_special=False) != expected
        finally:
            server.close()
        print(f"{name}: {len(texts)} texts, differing from llama.cpp: {wrong}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

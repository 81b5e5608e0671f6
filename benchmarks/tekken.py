"""tekken.json (Mistral's tokenizer file) in llmrun against mistral_common, transformers and
llama.cpp (not run by CI).

    PYTHONPATH=. python benchmarks/tekken.py [--llama-cpp DIR] [--converter SRC] [-r 3] [--out FILE]

- build: CPU seconds (the least of -r runs) to build the Mistral Nemo vocabulary that
  mistral_common ships (data/tekken_240718.json: 131,072 ids, 269,443 merges): llmrun's
  `tekken.tokenizer_args` (the merges found from the ranks, the C merging tables), the
  `tokenizers` library's BPE constructor on those merges alone (llmrun's way without the C
  library), mistral_common's `Tekkenizer.from_file` and transformers'
  `convert_tekken_tokenizer` (the one that derives its merges in a Python loop).
- ids: the Nemo file's ids of tests/test_tekken.py's texts and of random texts (letters
  of every case and script, marks, digits, spaces, emoji), llmrun's folder tokenizer
  against mistral_common's: the count that differ (0 expected).
- gguf: llama.cpp's converter (SRC/convert_hf_to_gguf.py --outtype f32) on a tiny Mistral
  folder (tests/helpers.py's, with Nemo's 131,072 ids) with only the Nemo tekken.json:
  whether its GGUF's tokens and merges are what
  llmrun derives, and per text whether the ids of that GGUF (llmrun's GGUF tokenizer, and
  llama-server's /tokenize from DIR) equal the folder's. llama.cpp cuts text with its own
  "tekken" regex, whose capitals and small letters are ASCII's and whose letters hold no
  combining marks, so it parts from the file's pattern on such texts.

Results go to --out (benchmarks/out/tekken.json).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
OUT = ROOT / "benchmarks" / "out"

from test_tekken import NEMO, TEXTS  # noqa: E402

from llmrun import tekken  # noqa: E402
from llmrun.tokenizer import Tokenizer  # noqa: E402


def cpu_seconds(build, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        build()
        best = min(best, time.process_time() - start)
    return round(best, 3)


def build_times(repeats: int) -> dict[str, float]:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    tokens = tekken._read(NEMO)[0]
    spelled, merges = tekken.byte_level_vocabulary(tokens)
    vocab = dict(zip(spelled, range(1000, 1000 + len(spelled)), strict=True))
    pairs = [tuple(m.split(" ")) for m in merges]
    return {
        "merges": len(pairs),
        "llmrun tekken.tokenizer_args": cpu_seconds(lambda: tekken.tokenizer_args(NEMO), repeats),
        "  of which the tokens and merges (tekken.byte_level_vocabulary)": cpu_seconds(
            lambda: tekken.byte_level_vocabulary(tokens), repeats
        ),
        "tokenizers BPE(vocab, merges) alone": cpu_seconds(
            lambda: Backend(BPE(vocab, pairs, ignore_merges=True)), repeats
        ),
        "mistral_common Tekkenizer.from_file": cpu_seconds(
            lambda: Tekkenizer.from_file(NEMO), repeats
        ),
        "transformers convert_tekken_tokenizer": cpu_seconds(
            lambda: convert_tekken_tokenizer(str(NEMO), chat_template=""), 1
        ),
    }


def random_texts(count: int) -> list[str]:
    pools = [
        " \t\n\r\u00a0\u2028\u3000\x0b\x0c\x85",
        "abcXYZ",
        "0123456789\u0663\u096a",
        "\u00c0\u00e9\u00ce\u00f5\u00dc\u01c5\u02b0",
        "\u65e5\u672c\u8a9e\u4e2d\u6587\ud55c\uad6d",
        "\U0001f916\U0001f44d\U0001f3fd\u200d",
        "!?.,;:/\\'\"()[]<>{}-_=+*&^%$#@",
        "\u0301\u0308\u093f\u0e31",
        "\u0391\u03b2\u0393\u03b4\u041f\u0440\u0418\u0432",
    ]
    rng = random.Random(0)
    return [
        "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))
        for _ in range(count)
    ]


def id_mismatches() -> dict[str, int]:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tekken.json").write_bytes(NEMO.read_bytes())
        ours = Tokenizer.from_hf_dir(tmp)
    reference = Tekkenizer.from_file(NEMO)
    out = {}
    for name, texts in (("texts", TEXTS), ("random texts", random_texts(5000))):
        out[name] = len(texts)
        out[f"{name} whose ids differ"] = sum(
            ours.encode(t, parse_special=False) != reference.encode(t, bos=True, eos=False)
            for t in texts
        )
    return out


def gguf_parity(converter: Path, llama_cpp: Path | None) -> dict:
    from helpers import save_hf_dir, tiny_hf_model
    from tokenizer_fuzz import Server

    from llmrun.loading.gguf_io import read_gguf

    with tempfile.TemporaryDirectory() as tmp:
        hf, _ = tiny_hf_model("mistral", vocab_size=131072)
        folder = save_hf_dir(hf, Path(tmp) / "model")
        (folder / "tekken.json").write_bytes(NEMO.read_bytes())
        gguf_file = Path(tmp) / "model.gguf"
        subprocess.run(
            [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder),
             "--outfile", str(gguf_file), "--outtype", "f32"],
            check=True, capture_output=True,
        )  # fmt: skip
        metadata = read_gguf(gguf_file, with_tensors=False).metadata
        ours = Tokenizer.from_hf_dir(folder)
        tokens, specials, _, _ = tekken._read(folder / "tekken.json")
        spelled, merges = tekken.byte_level_vocabulary(tokens)
        result = {
            "tokenizer.ggml.pre": metadata["tokenizer.ggml.pre"],
            "tokens equal": metadata["tokenizer.ggml.tokens"] == specials + spelled,
            "merges equal": metadata["tokenizer.ggml.merges"] == merges,
        }
        from_gguf = Tokenizer.from_gguf_metadata(metadata, str(gguf_file))
        server = None
        if llama_cpp is not None:
            server = Server(llama_cpp / "llama-server", gguf_file, Path(tmp) / "server.log")
        try:
            rows = []
            for text in TEXTS:
                folder_ids = ours.encode(text)
                row = {"text": text[:40], "llmrun gguf": from_gguf.encode(text) == folder_ids}
                if server is not None:
                    row["llama.cpp gguf"] = server.tokenize(text, True, True) == folder_ids
                rows.append(row)
        finally:
            if server is not None:
                server.close()
        result["ids equal to the folder's, per text"] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="folder of llama-server")
    parser.add_argument("--converter", type=Path, help="llama.cpp's source folder")
    parser.add_argument("-r", "--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT / "tekken.json")
    args = parser.parse_args()
    report = {"build CPU seconds": build_times(args.repeats), "ids": id_mismatches()}
    if args.converter is not None:
        report["gguf"] = gguf_parity(args.converter, args.llama_cpp)
    text = json.dumps(report, indent=1, ensure_ascii=False)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

"""The PLaMo families' tiny folders (tests/models/test_plamo.py, test_plamo2.py,
test_plamo3.py): PLaMo's tokenizer files (a tokenizer.jsonl in the Hub's format, [token,
score, type] a line, made of stories260K's vocabulary), the texts whose llama.cpp ids the
golden record holds, and the three families' GGUFs converted in one converter run."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import llama_converter
from helpers import STORIES_GGUF
from llama_cpp_golden import FILE_TYPES

from llmrun.loading.gguf_io import read_gguf

FAMILIES = ("plamo", "plamo2", "plamo3")

SPECIAL = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>", "<|plamo:op|>"]
LINES = 510  # and two [PADn] fillers of score -1000 from the converter, for a vocabulary of 512
# Texts for the tokenizer: byte fallback of 2-, 3- and 4-byte characters, a BOM, spaces,
# a control token's and a -1000 filler's text, ties between pieces.
TOKENIZER_TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  double  spaces\tand\nlines\n\n",
    "caf\u00e9 \u65e5\u672c\u8a9e \U0001f600!",
    "\ufeffthe BOM goes",
    "<|plamo:bos|>Hello<|plamo:op|> [PAD1] [PAD2]x",
    "aaaaaaa bbbbbbb thethethe",
    "",
]


def write_plamo_tokenizer(path: Path) -> None:
    """tokenizer.jsonl and tokenizer_config.json in `path`: PLaMo's five special tokens
    (unknown, then control), the 256 byte tokens, then stories260K's first pieces with
    their scores (its "\u2581" a space, as PLaMo's pieces spell spaces)."""
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    pieces = meta["tokenizer.ggml.tokens"][259:]
    scores = meta["tokenizer.ggml.scores"][259:]
    rows = [[SPECIAL[0], 0.0, "UNKNOWN"]] + [[t, 0.0, "CONTROL"] for t in SPECIAL[1:]]
    rows += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    for piece, score in zip(pieces, scores, strict=False):
        if len(rows) == LINES:
            break
        rows.append([piece.replace("\u2581", " "), score, "NORMAL"])
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    (path / "tokenizer.jsonl").write_text(text, encoding="utf-8")
    config = {
        "bos_token": SPECIAL[1],
        "eos_token": SPECIAL[2],
        "pad_token": SPECIAL[3],
        "unk_token": SPECIAL[0],
        "add_bos_token": True,
        "tokenizer_class": "Plamo2Tokenizer",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def converted(tmp_path_factory, family: str) -> dict[str, Path]:
    """`family`'s folder ("folder", its test module's build_folder) and its GGUFs as
    llama_cpp_golden.convert writes them ("f32", "q8_0", with the module's CONVERTER_PATCH);
    the three families' converted together once a test session, in one converter run
    (llama_converter.convert; each patch changes its own family's class alone)."""
    root = tmp_path_factory.getbasetemp() / "plamo"
    found, runs, patches = {}, [], []
    for name in FAMILIES:
        module = importlib.import_module(f"test_{name}")
        folder = root / name / name
        if not (folder / "config.json").is_file():
            module.build_folder(folder)
        files = {t: folder.parent / f"{name}-{t}.gguf" for t in FILE_TYPES}
        found[name] = {"folder": folder, **files}
        runs += [[folder, "--outfile", out, "--outtype", t] for t, out in files.items()]
        patches.append(getattr(module, "CONVERTER_PATCH", ""))
    if not all(found[family][t].is_file() for t in FILE_TYPES):
        llama_converter.convert(runs, llama_converter.TINY_VOCAB + "\n".join(patches))
    return found[family]

"""Differential fuzz of llmrun's GGUF tokenizer against llama.cpp itself (not run by CI).

    PYTHONPATH=. python benchmarks/tokenizer_fuzz.py --llama-cpp DIR [--lcpp-python PY]
        [--vocab NAME ...] [-n 3000] [--seqs 1000] [--seed 0] [--minimise 30] [--out FILE]

(PYTHONPATH=.: this checkout's llmrun, not whichever one is installed.) For each of
llama.cpp's test vocabularies (`python tests/data/fetch.py` puts them in
tests/data/cache/vocab/; ../shared/vocab is read too) whose tokenizer model llmrun builds:

1. Writes a tiny llama model (1 layer, width 64, random weights) that carries the vocabulary
   file's tokenizer.* metadata key by key, and its general.name (llama.cpp marks Phi-3's
   special tokens by it), since llama-server will not load a vocabulary-only file.
2. Starts DIR/llama-server on 127.0.0.1 with it (DIR: the prebuilt peers, e.g. a copy of
   ../shared/peers/llama-cpp-avx512/bin with the run bit set).
3. Encode: -n random texts (random Unicode of many scripts, emoji sequences, combining
   marks, control characters and NUL, code, long numbers, whitespace runs, contractions,
   the vocabulary's own special-token texts embedded in text, runs of its tokens, ...),
   each through POST /tokenize with add_special and parse_special both true and false,
   against `Tokenizer.encode(text, add_bos=None if add_special else False, parse_special)`.
   llmrun encodes prompts (chat, serve, run) with parse_special on and the model's BOS;
   `llmrun tokenize --no-special` is the off case. llmrun never doubles a BOS that the
   text itself starts with, where llama.cpp does (and warns): that is not counted.
4. Decode: --seqs random id sequences (normal, byte and control tokens mixed, so partial
   UTF-8 comes up) through POST /detokenize (llama.cpp's pieces with control tokens
   printed, concatenated) against llmrun's pieces with skip_special off, and llmrun's
   `decode` and streamed decode against each other. /detokenize answers JSON, in which
   llama.cpp writes bytes that are not UTF-8 as U+FFFD, so such results are compared
   after the same replacement.
5. Pieces (with --lcpp-python, a Python that has llama-cpp-python, e.g. one with
   ../shared/peers/wheels/avx512/*.whl installed): every token's exact bytes from
   llama_token_to_piece with special true and false, against llmrun's `token_bytes` and
   what `decode` prints for it with skip_special on and off.

Each mismatching text is shrunk (characters dropped while it still mismatches) and printed
with both id lists; the summary line counts, per mode (add_special, parse_special: tt tf ft
ff), the texts that mismatch. Known differences, counted apart as "known": see UNK_BYTE. Counts per vocabulary and every minimised case go to --out
(benchmarks/out/tokenizer_fuzz.json).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, TokenType
from gguf.gguf_reader import ReaderField

import llmrun
from llmrun.tokenizer import Tokenizer, load_tokenizer
from llmrun.tokenizer_gguf import GGUF_MODELS

ROOT = Path(__file__).resolve().parents[1]
VOCAB_DIRS = [ROOT / "tests/data/cache/vocab", ROOT.parent / "shared/vocab"]
OUT = ROOT / "benchmarks/out/tokenizer_fuzz.json"
WIDTH = 64


# ---- the model llama-server loads --------------------------------------------------------


def _field_value(field: ReaderField) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """A field's value as GGUFWriter takes it, strings as raw bytes (some vocabularies hold
    tokens that are not UTF-8, which must reach llama.cpp unchanged)."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], kind, sub
        return [field.parts[i][0].item() for i in field.data], kind, sub
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), kind, None
    return field.parts[field.data[0]][0].item(), kind, None


def write_model(vocab_file: Path, out: Path) -> None:
    """A 1-layer llama of width 64 with `vocab_file`'s tokenizer metadata."""
    reader = GGUFReader(vocab_file)
    fields = {f.name: f for f in reader.fields.values()}
    n_vocab = len(fields[Keys.Tokenizer.LIST].data)
    writer = GGUFWriter(out, "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(1)
    writer.add_feed_forward_length(WIDTH)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(WIDTH)
    for name, field in fields.items():
        if name.startswith("tokenizer.") or name == Keys.General.NAME:
            value, kind, sub = _field_value(field)
            writer.add_key_value(name, value, kind, sub)
    rng = np.random.default_rng(0)

    def matrix(rows: int) -> np.ndarray:
        # f16: Gemma 4's 262,144-row embedding stays at 32 MiB.
        return (rng.standard_normal((rows, WIDTH)) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(n_vocab), raw_dtype=GGMLQuantizationType.F16)
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        writer.add_tensor(f"blk.0.{part}.weight", matrix(WIDTH), raw_dtype=GGMLQuantizationType.F16)
    for norm in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{norm}.weight", np.ones(WIDTH, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- llama-server -----------------------------------------------------------------------


class Server:
    """A llama-server on 127.0.0.1 with /tokenize and /detokenize over one kept-alive
    connection."""

    def __init__(self, binary: Path, model: Path, log: Path, extra: tuple[str, ...] = ()) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["-c", "512", "-t", "1", "--parallel", "1", *extra]
        self.process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self._connection: http.client.HTTPConnection | None = None
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                tail = log.read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError("llama-server did not start:\n" + "\n".join(tail))
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        for attempt in range(2):  # a dropped keep-alive connection is opened again once
            if self._connection is None:
                self._connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self._connection.request("POST", path, data, {"Content-Type": "application/json"})
                response = self._connection.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException):
                self._connection.close()
                self._connection = None
                if attempt:
                    raise
                continue
            if response.status != 200:
                raise RuntimeError(f"{path}: HTTP {response.status}: {payload[:200]!r}")
            return json.loads(payload)
        raise AssertionError("unreachable")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        return self._post("/tokenize", body)["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["content"]

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ---- random texts -----------------------------------------------------------------------


def _chars(*ranges: tuple[int, int]) -> list[str]:
    return [chr(c) for lo, hi in ranges for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF]


# Pools of characters by kind; each text draws its pieces from several.
POOLS: dict[str, list[str]] = {
    "ascii": _chars((0x20, 0x7E)),
    "latin": _chars((0xC0, 0x24F), (0x1E00, 0x1EFF)),
    "greek-cyrillic": _chars((0x370, 0x3FF), (0x400, 0x52F), (0x531, 0x58F), (0x10A0, 0x10FF)),
    "cjk": _chars((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0xF900, 0xFAFF)),
    "kana-hangul": _chars((0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x1100, 0x11FF), (0x3130, 0x318F)),
    "cjk-punct": _chars((0x3000, 0x303F), (0xFF00, 0xFFEF), (0xFE30, 0xFE4F), (0x2010, 0x2027)),
    "rtl": _chars((0x590, 0x5FF), (0x600, 0x6FF), (0x750, 0x77F), (0xFB50, 0xFDFF)),
    "indic-thai": _chars((0x900, 0x97F), (0x980, 0x9FF), (0xB80, 0xBFF), (0xE00, 0xE7F)),
    "combining": _chars((0x300, 0x36F), (0x1AB0, 0x1AFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F)),
    "control": _chars((0x0, 0x1F), (0x7F, 0x9F)),
    "format": _chars((0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0xFEFF, 0xFEFF))
    + ["\u00ad", "\u180e", "\u061c", "\u034f"],
    "spaces": _chars((0x2000, 0x200A))
    + ["\u00a0", "\u1680", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\u0085"],
    "digits": _chars((0x660, 0x669), (0x966, 0x96F), (0xFF10, 0xFF19), (0x1D7CE, 0x1D7FF))
    + _chars((0xB2, 0xB3), (0xB9, 0xB9), (0xBC, 0xBE), (0x2150, 0x218B), (0x2460, 0x24FF)),
    "symbols": _chars((0x2190, 0x23FF), (0x2500, 0x27BF), (0x20A0, 0x20C0), (0x1D400, 0x1D4FF)),
    "odd": _chars((0xE000, 0xE0FF), (0xFFF0, 0xFFFF), (0xFDD0, 0xFDEF), (0xE0000, 0xE007F))
    + _chars((0xFE00, 0xFE0F), (0xE0100, 0xE01EF), (0xF0000, 0xF00FF), (0x10FFF0, 0x10FFFF))
    + _chars((0x378, 0x379), (0x2FFF0, 0x2FFFF), (0x1F000, 0x1F0FF), (0x10000, 0x100FF))
    # Unassigned planes: their UTF-8 starts with bytes (F1, F2) some vocabularies lack.
    + _chars((0x40000, 0x4000F), (0x80000, 0x8000F), (0xC0000, 0xC000F)),
    # Assigned in Unicode 15 to 16 (Kawi, CJK extensions H and I, Garay, Gurung Khema, Todhri,
    # Ol Onal...): where two Unicode tables might disagree.
    "new": _chars((0x11F00, 0x11F5F), (0x31350, 0x313FF), (0x2EBF0, 0x2EC5F), (0x10D40, 0x10D8F))
    + _chars((0x16100, 0x1613F), (0x105C0, 0x105FF), (0x1E5D0, 0x1E5FF), (0x1CC00, 0x1CCFF)),
    "emoji": _chars((0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF))
    + _chars((0x1F900, 0x1F9FF), (0x2600, 0x26FF)),
}
SKIN = _chars((0x1F3FB, 0x1F3FF))
ZWJ, VS16 = "\u200d", "\ufe0f"
WHITESPACE = [" ", "\t", "\n", "\r\n", "\r", "\v", "\f", "\u00a0", "\u3000", "  ", "\n\n"]
CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'VE", "'m", "'M", "'ll", "'LL"]
CONTRACTIONS += ["'d", "'D", "'Ll", "\u2019s", "'", "''", "'x", "'ss"]
WORDS = ["the", "The", "THE", "don", "I", "we", "they", "hello", "world", "Hello", "a", "x"]
WORDS += ["naïve", "café", "Straße", "東京", "日本語", "привет", "مرحبا", "שלום", "नमस्ते"]
CODE = [
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }\n",
    'const s = `${a}-${b}`; console.log("ok", s);\n',
    '{"key": [1, 2.5e-3, null, true], "nested": {"a": "b\\n"}}\n',
    '<div class="x">&amp; &lt;tag&gt;</div>\n',
    'if [ -f "$F" ]; then echo "$F" | grep -E \'^[a-z]+$\'; fi\n',
    "SELECT * FROM t WHERE id IN (1,2,3) AND name LIKE '%x%';\n",
    "    \t\tx = y[:, 0::2] @ z.T\r\n",
    '#include <stdio.h>\nint main(void){printf("%d\\n", 42);}\n',
    'fn main() { let v: Vec<u8> = vec![0xFF; 3]; println!("{:?}", v); }\n',
]
GENERIC_SPECIAL = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
GENERIC_SPECIAL += ["<|begin_of_text|>", "<|eot_id|>", "[INST]", "<|user|>", "<|end|>", "<pad>"]


class Texts:
    """Random texts for one vocabulary: generic pieces, and its own tokens' texts."""

    def __init__(self, tok: Tokenizer, types: list[int], rng: random.Random) -> None:
        self.rng = rng
        # By the file's token types, not by what llmrun made of them.
        marked = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        special = [i for i, t in enumerate(types) if t in marked]
        self.special = [t for i in special if (t := _text(tok, i))] + GENERIC_SPECIAL
        normal = [i for i, t in enumerate(types) if t == TokenType.NORMAL]
        self.pieces = [t for i in normal if (t := _text(tok, i))]
        self.overlaps = _overlaps(self.special)

    def __call__(self) -> str:
        rng = self.rng
        count = rng.choice([1, 1, 2, 3, 4, 6, 10])
        makers = self.makers + [Texts.overlap] * bool(self.overlaps)
        text = "".join(rng.choice(makers)(self) for _ in range(count))
        if rng.random() < 0.15:
            text = rng.choice([" ", "  ", "\n", "\t", " " * rng.randint(3, 20)]) + text
        if rng.random() < 0.05:
            text *= rng.randint(2, 5)
        return text

    def pool(self) -> str:
        pool = POOLS[self.rng.choice(list(POOLS))]
        return "".join(self.rng.choice(pool) for _ in range(self.rng.randint(1, 12)))

    def anything(self) -> str:
        """Code points from all of Unicode but the surrogates (JSON cannot carry them)."""
        points = (self.rng.randrange(0x110000) for _ in range(self.rng.randint(1, 6)))
        return "".join(chr(c) for c in points if not 0xD800 <= c <= 0xDFFF)

    def emoji(self) -> str:
        rng = self.rng
        parts = []
        for _ in range(rng.randint(1, 4)):
            e = rng.choice(POOLS["emoji"])
            if rng.random() < 0.4:
                e += rng.choice(SKIN)
            if rng.random() < 0.3:
                e += VS16
            parts.append(e)
        joined = ZWJ if rng.random() < 0.6 else ""
        flag = "".join(chr(0x1F1E6 + rng.randrange(26)) for _ in range(rng.choice([0, 2, 4])))
        keycap = rng.choice(["", "1\ufe0f\u20e3", "#\u20e3"])
        return joined.join(parts) + flag + keycap

    def combining(self) -> str:
        rng = self.rng
        base = rng.choice(POOLS["ascii"] + POOLS["latin"] + POOLS["indic-thai"] + POOLS["rtl"])
        return base + "".join(rng.choice(POOLS["combining"]) for _ in range(rng.randint(1, 5)))

    def whitespace(self) -> str:
        rng = self.rng
        return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 40)))

    def number(self) -> str:
        rng = self.rng
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40)))
        shape = rng.randrange(6)
        if shape == 0:
            return f"{rng.choice(['', '-', '+', ' ', '$'])}{digits}"
        if shape == 1:
            return f"{digits[:5]}.{digits[5:]}"
        if shape == 2:
            return ",".join(digits[i : i + 3] for i in range(0, len(digits), 3))
        if shape == 3:
            return f"{digits[:3]}e-{digits[3:5] or '1'}"
        if shape == 4:
            return f"0x{rng.randrange(1 << 64):X}"
        return " ".join(digits[i : i + rng.randint(1, 4)] for i in range(0, len(digits), 4))

    def words(self) -> str:
        rng = self.rng
        out = []
        for _ in range(rng.randint(1, 6)):
            word = rng.choice(WORDS)
            if rng.random() < 0.4:
                word += rng.choice(CONTRACTIONS)
            out.append(word)
            out.append(rng.choice([" ", " ", "", ", ", ". ", "\n", "  "]))
        return "".join(out)

    def code(self) -> str:
        snippet = self.rng.choice(CODE)
        start = self.rng.randrange(len(snippet))
        return snippet[start : start + self.rng.randint(1, len(snippet))]

    def special_text(self) -> str:
        rng = self.rng
        token = rng.choice(self.special)
        if rng.random() < 0.15:
            token = token[: rng.randint(1, max(len(token) - 1, 1))]  # a part of one
        pad = ["", "", " ", "\n", "  ", "x", " \n "]
        return rng.choice(pad) + token + rng.choice(pad)

    def overlap(self) -> str:
        """Two special tokens, the end of one the start of the other (">>TITLE<<" and
        "<|endoftext|>" in ">>TITLE<<|endoftext|>")."""
        first, second, shared = self.rng.choice(self.overlaps)
        return first + second[shared:]

    def long(self) -> str:
        """A long run: of one character, of digits, or of one word."""
        rng = self.rng
        unit = rng.choice([" ", "\n", "\t", "a", "0", "　", "!", rng.choice(WORDS), "ab "])
        if unit == "0":
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(50, 500)))
        return unit * rng.randint(50, 2000)

    def vocab_pieces(self) -> str:
        return "".join(self.rng.choice(self.pieces) for _ in range(self.rng.randint(1, 8)))

    makers: list[Callable[[Texts], str]] = [
        pool, pool, anything, emoji, combining, whitespace, number, words, words, code,
        special_text, special_text, vocab_pieces, vocab_pieces, long,
    ]  # fmt: skip


def _overlaps(texts: list[str], most: int = 10000) -> list[tuple[str, str, int]]:
    """Up to `most` (a, b, k): the last k characters of a are the first k of b."""
    starts: dict[str, list[str]] = {}
    for text in texts:
        for k in range(1, len(text)):
            starts.setdefault(text[:k], []).append(text)
    found = (
        (text, other, len(text) - k)
        for text in set(texts)
        for k in range(1, len(text))
        for other in starts.get(text[k:], ())
    )
    return list(itertools.islice(found, most))


def _text(tok: Tokenizer, i: int) -> str | None:
    """The text a token prints, if it is valid UTF-8."""
    try:
        return tok.token_bytes(i).decode("utf-8")
    except UnicodeDecodeError:
        return None


FIXED = ["", " ", "  ", "\n", "\t", "\r\n", "\x00", "a\x00b", " Hello", "Hello", "'s", " 's"]


# ---- comparisons ------------------------------------------------------------------------

# (add_special, parse_special) as llama-server takes them.
MODES = [(True, True), (False, True), (True, False), (False, False)]


def mode_name(mode: tuple[bool, bool]) -> str:
    return f"add_special={str(mode[0]).lower()},parse_special={str(mode[1]).lower()}"


def llmrun_encode(tok: Tokenizer, text: str, mode: tuple[bool, bool]) -> list[int]:
    """llama.cpp's add_special: BOS as the model says, and EOS (WPM: SEP) where the file
    asks for it, as Tokenizer.encode_sequence adds it."""
    add_special, parse_special = mode
    ids = tok.encode(text, add_bos=None if add_special else False, parse_special=parse_special)
    if add_special and tok.add_eos and tok.eos_id is not None:
        ids.append(tok.eos_id)
    return ids


def encode_differs(tok: Tokenizer, expected: list[int], got: list[int]) -> bool:
    # llmrun never doubles a BOS that the text starts with; llama.cpp does (and warns).
    bos = tok.bos_id
    doubled = bos is not None and expected[:2] == [bos, bos] and got == expected[1:]
    return expected != got and not doubled


def shrink(text: str, fails: Callable[[str], bool]) -> str:
    """A shorter text that still `fails`: spans of characters dropped, halving the span
    while none can go."""
    span = max(len(text) // 2, 1)
    while True:
        i, dropped = 0, False
        while i < len(text):
            shorter = text[:i] + text[i + span :]
            if fails(shorter):
                text, dropped = shorter, True
            else:
                i += span
        if span == 1 and not dropped:
            return text
        span = span if dropped else max(span // 2, 1)


def fuzz_encode(
    tok: Tokenizer, server: Server, texts: list[str], limit: int
) -> tuple[dict[str, int], list[dict]]:
    """Per mode, how many texts llmrun encodes unlike llama.cpp; the first `limit`
    mismatches shrunk (one per distinct shrunk text)."""
    counts = {mode_name(m): 0 for m in MODES}
    found: dict[tuple[str, tuple[bool, bool]], dict] = {}
    for text in texts:
        for mode in MODES:
            expected = server.tokenize(text, *mode)
            got = llmrun_encode(tok, text, mode)
            if not encode_differs(tok, expected, got):
                continue
            counts[mode_name(mode)] += 1
            if len(found) >= limit:
                continue

            def fails(t: str, mode=mode) -> bool:
                return encode_differs(tok, server.tokenize(t, *mode), llmrun_encode(tok, t, mode))

            small = shrink(text, fails)
            if (small, mode) not in found:
                found[small, mode] = {
                    "mode": mode_name(mode),
                    "text": small,
                    "llama.cpp": server.tokenize(small, *mode),
                    "llmrun": llmrun_encode(tok, small, mode),
                    "from": text,
                }
    return counts, list(found.values())


def random_ids(groups: list[list[int]], rng: random.Random) -> list[int]:
    """A random id sequence, each id from a random non-empty group."""
    return [rng.choice(rng.choice(groups)) for _ in range(rng.randint(1, 16))]


def streamed(tok: Tokenizer, ids: list[int], skip_special: bool) -> str:
    decoder = tok.stream(skip_special)
    return "".join([decoder.add(i) for i in ids] + [decoder.flush()])


def fuzz_decode(
    tok: Tokenizer, server: Server, types: list[int], count: int, rng: random.Random
) -> tuple[dict[str, int], list[dict]]:
    """Random id sequences: llama-server's /detokenize against llmrun's decode (control
    tokens printed), and llmrun's stream against its decode."""
    n = tok.vocab_size
    partial = [i for i in range(n) if _text(tok, i) is None]
    groups = [list(range(n))]
    groups += [g for g in (partial, [i for i, t in enumerate(types) if t != TokenType.NORMAL]) if g]
    counts = {"detokenize": 0, "stream": 0, "known": 0}
    cases: list[dict] = []
    for _ in range(count):
        ids = random_ids(groups, rng)
        expected = server.detokenize(ids)
        if UNK_BYTE in expected:
            counts["known"] += 1
            continue
        if tok.strip_leading_space and expected[:1] == " ":
            expected = expected[1:]  # as llama_detokenize removes the prefixed space
        got = tok.decode(ids, skip_special=False)
        if got != expected:
            counts["detokenize"] += 1
            cases.append({"ids": ids, "llama.cpp": expected, "llmrun": got})
        for skip in (True, False):
            if streamed(tok, ids, skip) != tok.decode(ids, skip_special=skip):
                counts["stream"] += 1
                cases.append({"ids": ids, "stream": True, "skip_special": skip})
    return counts, cases[:50]


# Run by --lcpp-python: every token's piece (hex) with special on and off, its attributes,
# and the vocabulary's BOS/EOS settings, as llama.cpp's C API gives them.
_PIECES = r"""
import ctypes, json, os, sys
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
import llama_cpp as L
L.llama_backend_init()
params = L.llama_model_default_params()
params.vocab_only = True
model = L.llama_model_load_from_file(sys.argv[1].encode(), params)
vocab = L.llama_model_get_vocab(model)
buf = ctypes.create_string_buffer(1 << 16)
def piece(t, special):
    n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, special)
    return buf.raw[:n].hex()
tokens = [
    [piece(t, True), piece(t, False), L.llama_vocab_get_attr(vocab, t), L.llama_vocab_is_eog(vocab, t)]
    for t in range(L.llama_vocab_n_tokens(vocab))
]
json.dump({
    "tokens": tokens,
    "bos": L.llama_vocab_bos(vocab), "eos": L.llama_vocab_eos(vocab),
    "add_bos": L.llama_vocab_get_add_bos(vocab), "add_eos": L.llama_vocab_get_add_eos(vocab),
}, sys.stdout)
"""
_ATTR_CONTROL_OR_UNKNOWN = 1 | 8  # LLAMA_TOKEN_ATTR_UNKNOWN, LLAMA_TOKEN_ATTR_CONTROL
# A known difference, left as it is: llama.cpp prints a byte-level token with characters
# outside GPT-2's byte alphabet (Command-R has 1403, such as "\u200d" stored as itself) as
# "[UNK_BYTE_0x<its UTF-8 in hex><the token>]"; llmrun prints the token's own text, as the
# ByteLevel decoder of `tokenizers` does. No text encodes to such a token.
UNK_BYTE = "[UNK_BYTE_0x"


def check_pieces(tok: Tokenizer, python: str, vocab_file: Path) -> tuple[dict[str, int], list]:
    """Every token's bytes, control-ness and end-of-generation-ness, against the C API's."""
    result = subprocess.run([python, "-c", _PIECES, str(vocab_file)], capture_output=True)
    if result.returncode:
        raise RuntimeError(f"{python}: llama-cpp-python failed on {vocab_file}")
    ref = json.loads(result.stdout)
    counts = {"piece": 0, "piece_skip_special": 0, "special": 0, "eog": 0, "bos_eos": 0}
    counts["known"] = 0
    cases: list = []
    for i, (shown, plain, attr, eog) in enumerate(ref["tokens"]):
        if UNK_BYTE.encode().hex() in shown:
            counts["known"] += 1
            continue
        mine = tok.token_bytes(i)
        mine_plain = b"" if i in tok.special_ids else mine
        checks = {
            "piece": (bytes.fromhex(shown), mine),
            "piece_skip_special": (bytes.fromhex(plain), mine_plain),
            "special": (bool(attr & _ATTR_CONTROL_OR_UNKNOWN), i in tok.special_ids),
            "eog": (bool(eog), i in tok.eog_ids),
        }
        for name, (expected, got) in checks.items():
            if expected != got:
                counts[name] += 1
                cases.append(
                    {"check": name, "id": i, "llama.cpp": repr(expected), "llmrun": repr(got)}
                )
    null = -1
    settings = {
        "bos": (None if ref["bos"] == null else ref["bos"], tok.bos_id),
        "eos": (None if ref["eos"] == null else ref["eos"], tok.eos_id),
        "add_bos": (ref["add_bos"], tok.add_bos),
        "add_eos": (ref["add_eos"], tok.add_eos),
    }
    for name, (expected, got) in settings.items():
        if expected != got:
            counts["bos_eos"] += 1
            cases.append({"check": name, "llama.cpp": expected, "llmrun": got})
    return counts, cases[:50]


# ---- the run ----------------------------------------------------------------------------


def vocab_files(names: list[str]) -> dict[str, Path]:
    """Vocabulary name -> file, for the files whose tokenizer model llmrun builds."""
    found: dict[str, Path] = {}
    for folder in VOCAB_DIRS:
        for path in sorted(folder.glob("ggml-vocab-*.gguf")):
            name = path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
            if name in found or (names and name not in names):
                continue
            model = GGUFReader(path).fields[Keys.Tokenizer.MODEL]
            if bytes(model.parts[model.data[0]]).decode() in GGUF_MODELS:
                found[name] = path
    return found


def token_types(vocab_file: Path, n: int) -> list[int]:
    field = GGUFReader(vocab_file).fields.get(Keys.Tokenizer.TOKEN_TYPE)
    if field is None:
        return [int(TokenType.NORMAL)] * n
    return [int(field.parts[i][0]) for i in field.data]


def fuzz_vocab(name: str, path: Path, args: argparse.Namespace, work: Path) -> dict:
    started = time.monotonic()
    tok = load_tokenizer(path)
    types = token_types(path, tok.vocab_size)
    rng = random.Random(f"{args.seed}:{name}")
    make = Texts(tok, types, rng)
    texts = FIXED + [make() for _ in range(args.n)]
    model = work / f"{name}.gguf"
    write_model(path, model)
    server = Server(args.llama_cpp / "llama-server", model, work / f"{name}.log")
    try:
        encode_counts, encode_cases = fuzz_encode(tok, server, texts, args.minimise)
        decode_counts, decode_cases = fuzz_decode(tok, server, types, args.seqs, rng)
    finally:
        server.close()
        model.unlink()
    report = {
        "vocab": name,
        "texts": len(texts),
        "encode": encode_counts,
        "encode_cases": encode_cases,
        "sequences": args.seqs,
        "decode": decode_counts,
        "decode_cases": decode_cases,
    }
    if args.lcpp_python:
        report["pieces"], report["pieces_cases"] = check_pieces(tok, args.lcpp_python, path)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def summary(report: dict) -> str:
    encode = " ".join(str(v) for v in report["encode"].values())
    decode = " ".join(f"{k}={v}" for k, v in report["decode"].items())
    pieces = " ".join(f"{k}={v}" for k, v in report.get("pieces", {}).items())
    return (
        f"{report['vocab']:16} texts {report['texts']:5}  encode mismatches (tt tf ft ff) "
        f"{encode:16} decode {decode}  {pieces}  {report['seconds']}s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama-server")
    parser.add_argument("--lcpp-python", help="a Python with llama-cpp-python (piece checks)")
    parser.add_argument("--vocab", nargs="*", default=[], help="names (default: all)")
    parser.add_argument("-n", type=int, default=3000, help="random texts per vocabulary")
    parser.add_argument("--seqs", type=int, default=1000, help="random id sequences")
    parser.add_argument("--minimise", type=int, default=30, help="mismatches shrunk per vocab")
    parser.add_argument("--seed", default="0")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    # Killed, it still stops its llama-server (the `finally` in fuzz_vocab).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    files = vocab_files(args.vocab)
    if not files:
        print("no vocabularies: run python tests/data/fetch.py", file=sys.stderr)
        return 1
    # The llmrun under test: the installed one, unless PYTHONPATH names a checkout.
    print(f"llmrun: {Path(llmrun.__file__).parent}", flush=True)
    reports = []
    with tempfile.TemporaryDirectory(prefix="tokenizer_fuzz.") as work:
        for name, path in files.items():
            report = fuzz_vocab(name, path, args, Path(work))
            reports.append(report)
            print(summary(report), flush=True)
            for case in report["encode_cases"] + report["decode_cases"]:
                print("   ", json.dumps(case, ensure_ascii=True)[:400], flush=True)
            for case in report.get("pieces_cases", [])[:10]:
                print("   ", json.dumps(case, ensure_ascii=True)[:400], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reports, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    counts = [{**r["encode"], **r["decode"], **r.get("pieces", {})} for r in reports]
    return 1 if any(v for c in counts for k, v in c.items() if k != "known") else 0


if __name__ == "__main__":
    sys.exit(main())

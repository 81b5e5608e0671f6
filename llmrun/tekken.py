"""Mistral's tekken.json read into the `Tokenizer` arguments llmrun builds, so that a folder
with tekken.json and no tokenizer.json (Mistral Nemo, Mistral Small 3, Ministral,
Devstral, Magistral, Pixtral, Voxtral) tokenizes as mistral_common's Tekkenizer does.

The file, as mistral_common reads it (tokens/tokenizers/tekken.py): `vocab`, each token's
bytes in base64 at its rank; `config`: the pre-tokenizer `pattern` (tiktoken's pat_str),
`default_vocab_size`, `default_num_special_tokens` and `version`; `special_tokens`, each at
its rank, or none in files of version v7 and before, which have Mistral's first twenty. The
ids: the special tokens first (the file's, then <SPECIAL_i> fillers up to their number),
then one id per rank, for the first `default_vocab_size` minus that many ranks.

Tiktoken encodes each piece its pattern cuts by byte-level BPE: a piece that is a token is
taken whole; else the adjacent pair whose bytes joined have the lowest rank merges first.
Its merges are therefore every cut of a token into two tokens, ordered by that token's
rank, then by the halves' ranks (as llama.cpp's converter and transformers'
MistralConverter list them), run on GPT-2's byte alphabet by llmrun.gguf_bpe. llama.cpp's
GGUF of the same folder ("tekken") holds these tokens and merges, but cuts text with its
own approximation of the pattern, which parts from it on some letters beyond ASCII.
Special tokens are matched in a text only where special tokens parse (mistral_common's
encode never does; a chat template's text needs them), the longest at the leftmost place.
No torch here.
"""

from __future__ import annotations

import binascii
import json
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun import gguf_bpe
from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.token_bytes import BYTE_LEVEL_ALPHABET, byte_level_bytes

FILE = "tekken.json"
BOS, EOS = "<s>", "</s>"
FILLER = "<SPECIAL_{}>"  # mistral_common's name for a special id the file leaves unnamed
# The special tokens of a file without a list (mistral_common's DEPRECATED_SPECIAL_TOKENS),
# which only files up to version _LAST_DEFAULT_VERSION may leave out.
DEFAULT_SPECIALS = (
    "<unk>",
    BOS,
    EOS,
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)
_LAST_DEFAULT_VERSION = 7
# Far beyond any real file's (Mistral's longest token is 76 bytes, its longest special
# token 19 characters); the merges are found in time that grows with them.
MAX_TOKEN_BYTES = 4096
MAX_SPECIAL_CHARS = 256
_BYTES = [bytes([b]) for b in range(256)]  # ranks 0-255 must be the bytes themselves
# Each byte's character in GPT-2's byte-level alphabet, as a code point.
_CODES = np.zeros(256, np.uint32)
_CODES[[byte_level_bytes(c)[0] for c in BYTE_LEVEL_ALPHABET]] = list(map(ord, BYTE_LEVEL_ALPHABET))


def tokenizer_args(file: Path) -> dict[str, Any]:
    """Keyword arguments of `Tokenizer` for a tekken.json file."""
    tokens, specials, pattern, vocab_size = _read(file)
    try:
        split = pre_tokenizers.Split(Regex(pattern), "isolated")
    except Exception as e:
        raise UnsupportedError(
            f"{file}: config.pattern is not a regex llmrun can run: {e}"
        ) from None
    pre = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    n_special = len(specials)
    spelled, merges = byte_level_vocabulary(tokens)
    vocab = dict(zip(spelled, range(n_special, n_special + len(tokens)), strict=True))

    def library() -> Backend:
        pairs = [tuple(m.split(" ")) for m in merges]
        backend = Backend(BPE(vocab, pairs, ignore_merges=True))
        backend.pre_tokenizer = pre
        return backend

    merging = gguf_bpe.bpe_backend(
        vocab,
        vocab_size,
        merges,
        normalizer=None,
        pre_tokenizer=pre,
        ignore_merges=True,
        newline_words=False,
        byte_level=True,
        source=str(file),
        batch_backend=library,
    )
    special_ids = dict(zip(specials, range(n_special), strict=True))

    def spell(i: int) -> bytes:
        return specials[i].encode("utf-8") if i < n_special else tokens[i - n_special]

    return dict(
        backend=merging or library(),
        spell=spell,
        vocab_size=vocab_size,
        bos_id=special_ids.get(BOS),
        eos_id=special_ids.get(EOS),
        # llama.cpp's converter writes add_bos for these, and Mistral's prompts begin with it.
        add_bos=True,
        add_eos=False,
        special_ids=range(n_special),
        eog_ids=[special_ids[EOS]] if EOS in special_ids else [],
        strip_leading_space=False,
        source=str(file),
        split_special=_special_splitter(special_ids),
        # A special token's text is its own, where a plain token spells the same.
        token_ids=vocab | special_ids,
    )


def _read(file: Path) -> tuple[list[bytes], list[str], str, int]:
    """The plain tokens' bytes by rank, the special tokens' texts by id, the pattern and the
    vocabulary size, each checked as mistral_common checks it."""

    def fail(what: str) -> TokenizerError:
        return TokenizerError(f"{file}: {what}")

    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise fail(f"cannot be read as JSON: {e}") from None
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise fail("no config object")
    pattern = config.get("pattern")
    vocab_size = config.get("default_vocab_size")
    n_special = config.get("default_num_special_tokens")
    version = config.get("version")
    if not isinstance(pattern, str) or not pattern:
        raise fail("config.pattern is not a regex")
    for key, value in (
        ("default_vocab_size", vocab_size),
        ("default_num_special_tokens", n_special),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise fail(f"config.{key} is not a count: {value!r}")
    number = re.fullmatch(r"v(\d+)", version) if isinstance(version, str) else None
    if number is None:
        raise fail(f"config.version {version!r} is not one like 'v3'")

    listed = data.get("special_tokens")
    if listed is None:
        if int(number[1]) > _LAST_DEFAULT_VERSION:
            raise fail(f"no special_tokens, which a file of version {version} must list")
        specials = list(DEFAULT_SPECIALS)
    elif isinstance(listed, list):
        specials = [_special_text(entry, rank, fail) for rank, entry in enumerate(listed)]
    else:
        raise fail("special_tokens is not a list")
    if len(specials) > n_special:
        raise fail(
            f"{len(specials)} special_tokens, more than default_num_special_tokens {n_special}"
        )
    specials += [FILLER.format(i) for i in range(len(specials), n_special)]
    if len(set(specials)) < n_special:
        raise fail("special_tokens holds a text twice")

    n_plain = vocab_size - n_special
    entries = data.get("vocab")
    if not isinstance(entries, list) or not 256 <= n_plain <= len(entries):
        got = len(entries) if isinstance(entries, list) else "no"
        raise fail(
            f"default_vocab_size {vocab_size} less default_num_special_tokens {n_special} "
            f"needs from 256 to {got} vocab entries"
        )
    entries = entries[:n_plain]
    try:
        ranks = list(map(operator.itemgetter("rank"), entries))
        tokens = list(map(binascii.a2b_base64, map(operator.itemgetter("token_bytes"), entries)))
    except (TypeError, KeyError, ValueError):
        raise fail("a vocab entry is not a rank and its token_bytes in base64") from None
    if ranks != list(range(n_plain)):
        raise fail("vocab entries are not at their ranks 0, 1, 2, ...")
    if tokens[:256] != _BYTES:
        raise fail("vocab ranks 0-255 are not the 256 bytes in order")
    if len(set(tokens)) < n_plain:
        raise fail("vocab holds a token's bytes twice")
    longest = max(map(len, tokens))
    if longest > MAX_TOKEN_BYTES:
        raise fail(f"a vocab token is {longest} bytes long (llmrun reads up to {MAX_TOKEN_BYTES})")
    return tokens, specials, pattern, vocab_size


def _special_text(entry: Any, rank: int, fail: Callable[[str], TokenizerError]) -> str:
    if not isinstance(entry, dict) or entry.get("rank") != rank:
        raise fail(f"special_tokens entry {rank} is not the one of rank {rank}")
    text = entry.get("token_str")
    if not isinstance(text, str) or not 0 < len(text) <= MAX_SPECIAL_CHARS or not _is_utf8(text):
        raise fail(
            f"special_tokens entry {rank} has no token_str of 1 to {MAX_SPECIAL_CHARS} "
            "characters of Unicode text"
        )
    return text


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def byte_level_vocabulary(tokens: list[bytes]) -> tuple[list[str], list[str]]:
    """The tokens (distinct, by rank) spelled in GPT-2's byte-level alphabet, and their
    merges ("left right") in order, as llama.cpp's converter writes them to a GGUF."""
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    starts = np.cumsum(lengths) - lengths
    flat = np.frombuffer(b"".join(tokens), np.uint8)
    merged, cut = _merges(tokens, lengths)
    return _byte_level(flat, starts, lengths), _byte_level(
        flat, starts[merged], lengths[merged], cut
    )


def _merges(tokens: list[bytes], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every cut of a token into two tokens, as the token's rank and the left half's length,
    in merge order: by the token's rank, then the left half's (which fixes the right)."""
    token_l, cut_l, left = _prefix_tokens(tokens, lengths)
    token_r, cut_r, _ = _prefix_tokens([t[::-1] for t in tokens], lengths)
    # A cut is a prefix that is a token whose rest, reversed, is a reversed token's prefix:
    # each cut is a place in the tokens' bytes one after another.
    starts = np.cumsum(lengths) - lengths
    is_cut = np.zeros(int(lengths.sum()), bool)
    is_cut[starts[token_r] + lengths[token_r] - cut_r] = True
    both = is_cut[starts[token_l] + cut_l]
    token, cut, left = token_l[both], cut_l[both], left[both]
    order = np.argsort(token * len(tokens) + left)
    return token[order], cut[order]


def _byte_level(
    flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, cuts: np.ndarray | None = None
) -> list[str]:
    """The byte runs flat[start : start + length] spelled in GPT-2's byte-level alphabet,
    with a space at each one's cut where `cuts` are given (a merge's "left right")."""
    n = len(starts)
    spaced = cuts is not None
    # Each run's characters, then its space if any and a newline: neither is in the alphabet.
    ends = np.cumsum(lengths + 1 + spaced)
    out_starts = ends - lengths - 1 - spaced
    run = np.repeat(np.arange(n), lengths)
    place = np.arange(len(run)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    codes = np.full(int(ends[-1]) if n else 0, ord("\n"), np.uint32)
    target = out_starts[run] + place
    if spaced:
        target += place >= cuts[run]
        codes[out_starts + cuts] = ord(" ")
    codes[target] = _CODES[flat[starts[run] + place]]
    return codes.tobytes().decode("utf-32-le").split("\n")[:-1]


def _prefix_tokens(
    tokens: list[bytes], lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token, length, prefix) ranks for each shorter prefix of a token that is a token.

    In sorted order, the tokens that begin with a token stand in one run right after it:
    up to the first that shares fewer of its bytes with the one before."""
    n = len(tokens)
    order = np.array(sorted(range(n), key=tokens.__getitem__), dtype=np.int64)
    lens = lengths[order]
    shared = _shared_with_previous(b"".join(map(tokens.__getitem__, order.tolist())), lens)
    runs = _next_below(shared, lens) - np.arange(n) - 1
    prefix = np.repeat(np.arange(n), runs)
    token = np.arange(len(prefix)) - np.repeat(np.cumsum(runs) - runs, runs) + prefix + 1
    return order[token], lens[prefix], order[prefix]


def _shared_with_previous(joined: bytes, lens: np.ndarray) -> np.ndarray:
    """How many first bytes each of the tokens `joined` holds shares with the one before."""
    flat = np.frombuffer(joined, np.uint8)
    starts = np.cumsum(lens) - lens
    shared = np.zeros(len(lens), np.int64)
    pairs = np.arange(1, len(lens))  # those equal so far, by their second token
    depth = 0
    while pairs.size:
        pairs = pairs[(lens[pairs] > depth) & (lens[pairs - 1] > depth)]
        pairs = pairs[flat[starts[pairs] + depth] == flat[starts[pairs - 1] + depth]]
        depth += 1
        shared[pairs] = depth
    return shared


def _next_below(values: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """For each place i, the first place after it whose value is below limits[i] (else the
    length), by binary lifting over the minima of runs of 1, 2, 4... values."""
    n = len(values)
    minima = [values]  # minima[k][i]: the least of values[i : i + 2**k]
    while (2 << (len(minima) - 1)) <= n:
        half = 1 << (len(minima) - 1)
        minima.append(np.minimum(minima[-1][:-half], minima[-1][half:]))
    found = np.arange(1, n + 1)
    for k in reversed(range(len(minima))):
        step = 1 << k
        can = np.flatnonzero(found <= n - step)
        can = can[minima[k][found[can]] >= limits[can]]
        found[can] += step
    return found


def _special_splitter(
    special_ids: dict[str, int],
) -> Callable[[str, bool], list[str | int]] | None:
    """(text, parse_special) -> the text cut into plain text and special-token ids, each
    special token's text matched where special tokens parse, the longest at the leftmost
    place (as transformers' tokenizer of the folder matches them); None without any."""
    if not special_ids:
        return None
    # One regex of the texts as a trie: a match steps down one branch per character, where
    # an alternation of a thousand texts would try each at every "<" and "[".
    find = re.compile(_trie_regex(list(special_ids))).finditer

    def split(text: str, parse_special: bool) -> list[str | int]:
        if not parse_special:
            return [text]
        parts: list[str | int] = []
        end = 0
        for match in find(text):
            if match.start() > end:
                parts.append(text[end : match.start()])
            parts.append(special_ids[match[0]])
            end = match.end()
        if end < len(text) or not parts:
            parts.append(text[end:])
        return parts

    return split


def _trie_regex(texts: list[str]) -> str:
    """A regex matching any of `texts`, the longest where one begins another."""
    trie: dict[str, dict] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}

    def branch(node: dict[str, dict]) -> str:
        alternatives = [re.escape(c) + branch(child) for c, child in node.items() if c]
        if not alternatives:
            return ""
        if len(alternatives) == 1 and "" not in node:
            return alternatives[0]
        body = "(?:" + "|".join(alternatives) + ")"
        # Greedy: a longer text is tried before the one that ends here.
        return body + "?" if "" in node else body

    return branch(trie)

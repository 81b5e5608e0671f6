"""Marian's tokenizer (Helsinki-NLP/opus-mt-* folders: source.spm, target.spm, vocab.json,
no tokenizer.json) as transformers' MarianTokenizer gives its ids: the text cut into
source.spm's SentencePiece Unigram pieces, each piece then looked up in vocab.json (the
model's ids), the special tokens' text and a leading ">>xx<<" target-language code kept as
their own tokens, </s> after a sequence; decoding spells each id's vocab.json piece, "\u2581"
as a space. Speech2TextTokenizer's files (sentencepiece.bpe.model and vocab.json, the same
lookup; <s> one more special token, no language codes) are read the same way (SPEECH_TO_TEXT).

The pieces are found as llmrun.unigram finds a SentencePiece Unigram's (source.spm's scores
and normalizer spec), over a vocabulary laid out at vocab.json's ids: each id holds its piece
where source.spm has it (normal or user-defined), else an empty piece no text matches, so
that the search sees exactly source.spm's pieces. A source piece vocab.json lacks (which
MarianTokenizer turns into <unk>) is refused rather than guessed at. MarianTokenizer's Moses
punctuation normalizer runs only where `sacremoses` is installed; this is the tokenizer
without it. No torch here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import normalizers
from tokenizers.models import Unigram

from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.sentencepiece_model import UNIGRAM, read_model
from llmrun.token_bytes import spm_bytes
from llmrun.unigram import Charsmap, UnigramNormalizer

FILE, VOCAB = "source.spm", "vocab.json"
SPEECH_TO_TEXT_FILE = "sentencepiece.bpe.model"
# sentencepiece_model.proto's SentencePiece.Type of the pieces a text can be cut into.
_NORMAL, _USER_DEFINED = 1, 4
# MarianTokenizer's special tokens (its defaults, which every opus-mt folder keeps).
UNK, EOS, PAD = "<unk>", "</s>", "<pad>"
BOS = "<s>"  # one more of Speech2TextTokenizer's


@dataclass(frozen=True)
class Layout:
    """Which SentencePiece file, special tokens and target-language codes a family's
    tokenizer has."""

    file: str
    specials: tuple[str, ...]
    codes: bool  # a leading ">>xx<<" is its own token


MARIAN = Layout(FILE, (EOS, UNK, PAD), codes=True)
SPEECH_TO_TEXT = Layout(SPEECH_TO_TEXT_FILE, (BOS, EOS, UNK, PAD), codes=False)


def _vocab(file: Path) -> dict[str, int]:
    try:
        vocab = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: cannot be read as JSON: {e}") from None
    if not isinstance(vocab, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and 0 <= v < 1 << 24 for k, v in vocab.items()
    ):
        raise TokenizerError(f"{file}: not an object of tokens to ids")
    for token in (UNK, EOS):
        if token not in vocab:
            raise TokenizerError(f"{file}: no {token} token")
    return vocab


def split_special(text: str, vocab: dict[str, int], layout: Layout = MARIAN) -> list[str | int]:
    """The text as MarianTokenizer cuts it before SentencePiece: its special tokens' text
    (</s>, <unk>, <pad>) taken out as their ids, and in each run between them
    (remove_language_code) a leading ">>xx<<" as that token."""
    specials = [name for name in layout.specials if name in vocab]
    out: list[str | int] = []
    for part in re.split(f"({'|'.join(map(re.escape, specials))})", text):
        if part in specials:
            out.append(vocab[part])
        elif layout.codes and part.startswith(">>") and (end := part.find("<<")) != -1:
            out += [vocab.get(part[: end + 2], vocab[UNK]), part[end + 2 :]]
        else:
            out.append(part)
    return out


def tokenizer_args(folder: Path, layout: Layout = MARIAN) -> dict[str, Any]:
    """llmrun.tokenizer.Tokenizer's arguments for a Marian folder (or another `layout`'s)."""
    file = folder / layout.file
    vocab = _vocab(folder / VOCAB)
    model = read_model(file.read_bytes(), str(file))
    if model.model_type != UNIGRAM:
        raise UnsupportedError(f"{file}: a SentencePiece model that is not Unigram")
    scores = {
        piece: (score if kind == _NORMAL else 0.0)
        for piece, score, kind in model.pieces
        if kind in (_NORMAL, _USER_DEFINED)
    }
    lacking = [piece for piece in scores if piece not in vocab]
    if lacking:
        raise UnsupportedError(
            f"{file}: {len(lacking)} pieces (such as {lacking[0]!r}) are not in {VOCAB}, "
            "which the tokenizer reads as <unk>: not supported"
        )
    size = max(vocab.values()) + 1
    lowest = min(s for p, s, k in model.pieces if k == _NORMAL)
    texts = [""] * size
    for token, i in vocab.items():
        texts[i] = token
    pieces = [(t, scores[t]) if t in scores else ("", lowest) for t in texts]
    backend = Backend(Unigram(pieces, unk_id=vocab[UNK], byte_fallback=False))
    blob = model.precompiled_charsmap
    backend.normalizer = normalizers.Normalizer.custom(
        UnigramNormalizer(
            Charsmap(blob, str(file)) if blob else None,
            add_space_prefix=model.add_dummy_prefix,
            merge_spaces=model.remove_extra_whitespaces,
        )
    )

    def spell(i: int) -> bytes:
        return spm_bytes(texts[i], False)

    def split(text: str, parse_special: bool) -> list[str | int]:
        return split_special(text, vocab, layout) if parse_special else [text]

    specials = {vocab[name] for name in layout.specials if name in vocab}
    return dict(
        backend=backend,
        spell=spell,
        vocab_size=size,
        bos_id=None,
        eos_id=vocab[EOS],
        add_bos=False,
        add_eos=True,
        special_ids=specials,
        eog_ids={vocab[EOS]},
        strip_leading_space=True,
        source=str(file),
        split_special=split,
        token_ids=vocab,
    )

"""Source and target languages of a many-to-many translator, as transformers' tokenizers
set them: mBART-50's (en_XX), NLLB's (eng_Latn) and M2M100's (__en__) language codes are
special tokens of the vocabulary. The source language's code takes the place of the code
the tokenizer frames a text with (MBart50Tokenizer, NllbTokenizer, M2M100Tokenizer with
src_lang set: the code before the text and </s> after it; MBartTokenizer's and legacy
NLLB's: </s> and the code after it), and the target language's code is the decoder's
forced first token (generate's forced_bos_token_id, as their model cards pass it).

A model's codes are its tokenizer's special tokens of the shape of the code its frame
holds (else of any of the three shapes); M2M100's are also named without their
underscores (en for __en__), as M2M100Tokenizer takes them.

A multilingual Marian (opus-mt-en-mul, opus-mt-en-ROMANCE, ...) is told its target language
by a ">>xxx<<" token of its vocabulary first in the source text (MarianTokenizer keeps it
whole): marian_codes finds them, and the target's goes before the encoder's ids, named with
or without its brackets (deu or >>deu<<)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from llmrun.errors import UsageError
from llmrun.tokenizer import Tokenizer

SHAPES = (
    re.compile(r"[a-z]{2}_[A-Z]{2}"),  # mBART's: en_XX, de_DE
    re.compile(r"[a-z]{3}_[A-Z][a-z]{3}"),  # NLLB's: eng_Latn, deu_Latn
    re.compile(r"__[a-z]{2,3}__"),  # M2M100's: __en__, __de__
)
SHOWN = 6  # the codes an error names
MARIAN_CODE = re.compile(r">>[^<>\s]+<<")


@dataclass(frozen=True)
class Framing:
    """The ids a tokenizer puts around a text (before, after) and its language codes."""

    head: tuple[int, ...]
    tail: tuple[int, ...]
    codes: dict[str, int]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Framing:
        """The tokenizer's framing of a sequence (its post-processor's, or a GGUF's BOS and
        EOS) and its language codes."""
        plain = tokenizer.encode("a", add_bos=False)
        whole = tokenizer.encode_sequence("a")
        at = next((i for i in range(len(whole)) if whole[i : i + len(plain)] == plain), len(whole))
        head, tail = tuple(whole[:at]), tuple(whole[at + len(plain) :])
        special = {tokenizer.token_to_piece(i): i for i in sorted(tokenizer.special_ids)}
        around = [p for p, i in special.items() if i in head + tail]
        shapes = [s for s in SHAPES if any(s.fullmatch(p) for p in around)] or SHAPES
        codes = {p: i for p, i in special.items() if any(s.fullmatch(p) for s in shapes)}
        return cls(head, tail, codes)

    @property
    def code(self) -> int | None:
        """The language code the frame holds, if any."""
        return next((i for i in self.head + self.tail if i in self.codes.values()), None)

    def ids(self, prompt: list[int], source: int | None = None) -> list[int]:
        """`prompt` framed, each part of the frame added where the ids lack it; with
        `source`, that code in place of the frame's."""
        head, tail = list(self.head), list(self.tail)
        ids = list(prompt)
        if head and ids[: len(head)] == head:
            ids = ids[len(head) :]
        if tail and ids[-len(tail) :] == tail:
            ids = ids[: -len(tail)]
        if source is not None:
            head = [source if i == self.code else i for i in head]
            tail = [source if i == self.code else i for i in tail]
        return head + ids + tail

    def code_id(self, name: str, model: str, side: str) -> int:
        """The id of language `name` (`side`: "source" or "target"), refused in one line
        where the model has no such code."""
        if not self.codes:
            raise UsageError(
                f"{model} has no language codes to choose a {side} language by (mBART-50, "
                "NLLB and M2M100 translators have them)"
            )
        for candidate in (name, f"__{name}__"):
            if candidate in self.codes:
                return self.codes[candidate]
        known = sorted(self.codes)
        more = f", ... ({len(known)} in all)" if len(known) > SHOWN else ""
        raise UsageError(
            f"unknown {side} language {name!r} for {model}: its codes are "
            f"{', '.join(known[:SHOWN])}{more}"
        )


@lru_cache(maxsize=4)
def marian_codes(tokenizer: Tokenizer) -> dict[str, int]:
    """A Marian vocabulary's ">>xxx<<" target-language tokens, each by name and id."""
    pieces = (tokenizer.token_to_piece(i) for i in range(tokenizer.vocab_size))
    return {p: i for i, p in enumerate(pieces) if MARIAN_CODE.fullmatch(p)}


def marian_target(tokenizer: Tokenizer, name: str, model: str) -> int:
    """The id of the ">>xxx<<" token that asks a multilingual Marian for language `name`
    (xxx or >>xxx<<), refused in one line where the model has none such."""
    codes = marian_codes(tokenizer)
    if not codes:
        raise UsageError(
            f"{model} translates into one language: its vocabulary has no >>xxx<< "
            "target-language tokens"
        )
    for candidate in (name, f">>{name}<<"):
        if candidate in codes:
            return codes[candidate]
    known = sorted(codes)
    more = f", ... ({len(known)} in all)" if len(known) > SHOWN else ""
    raise UsageError(
        f"unknown target language {name!r} for {model}: its codes are "
        f"{', '.join(known[:SHOWN])}{more}"
    )

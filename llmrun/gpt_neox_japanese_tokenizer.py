"""GPT-NeoX Japanese's tokenizer (abeja/gpt-neox-japanese-2.7b ships vocab.txt and
emoji.json, no tokenizer.json), giving the ids of transformers' GPTNeoXJapaneseTokenizer
(tanreinama's Japanese-BPEEncoder_V2).

vocab.txt holds one token a line; a line with commas lists spellings that share its id
(慶応,慶應), the first of them the one decoded. Before matching, spaces (ASCII and
ideographic) become <SP>, line breaks <BR>, tabs <TAB>, the em dash and the minus sign
"ー", and each of emoji.json's emoji its tag (<|emoji1|>, ...). Then, from each position,
among the vocabulary's spellings that start there (up to 3 characters, or up to the
longest spelling where the text has "<" there), the one of the smallest id is taken, but
a tag of 3 or more characters starting "<" is taken first; a character no spelling
starts becomes <KIGOU> (some 2-byte symbols), <U2000U2BFF> (U+2000..U+2BFF), or its UTF-8
bytes as <|byteN|> tokens. No special token is put around a text.

Decoding joins the tokens' bytes (a byte token's one byte, a tag's character: a space,
a line break, a tab, the emoji, ▀ for <BLOCK>, ǀ for <KIGOU>, ‖ for <U2000U2BFF>), so a
character split into byte tokens decodes whole, where transformers decodes each byte
token alone (U+FFFD) and strips the text's ends. tokenizer_config.json's do_clean_text
(URLs, e-mail addresses, phone numbers, dates and prices turned into tags) is refused.
No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.rwkv_tokenizer import Encoding

VOCAB, EMOJI = "vocab.txt", "emoji.json"
# What the text's characters become before matching, in this order.
_REPLACED = (
    (" ", "<SP>"),
    ("\u3000", "<SP>"),
    ("\r\n", "<BR>"),
    ("\n", "<BR>"),
    ("\r", "<BR>"),
    ("\t", "<TAB>"),
    ("\u2014", "\u30fc"),
    ("\u2212", "\u30fc"),
)
# Tags' text when decoded (the emoji's from emoji.json's emoji_inv).
_SHOWN = {
    "<SP>": " ",
    "<BR>": "\n",
    "<TAB>": "\t",
    "<BLOCK>": "\u2580",
    "<KIGOU>": "\u01c0",
    "<U2000U2BFF>": "\u2016",
}
# The 2-byte UTF-8 symbols that become <KIGOU>: ranges of their two bytes read as one number.
_KIGOU = ((0xC2A1, 0xC2BF), (0xC780, 0xC783), (0xCAB9, 0xCBBF), (0xCC80, 0xCDA2))
# GPTNeoXJapaneseTokenizer's special tokens, by tokenizer_config.json's names.
_SPECIALS = {
    "unk_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
}


def applies(folder: Path) -> bool:
    """Whether the folder holds GPT-NeoX Japanese's tokenizer files."""
    return (folder / VOCAB).is_file() and (folder / EMOJI).is_file()


def read_vocab(path: Path) -> list[list[str]]:
    """Each id's spellings, as GPTNeoXJapaneseTokenizer reads vocab.txt: a line split at
    its commas unless it has none (or is a lone "," at the end of the file)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read: {e}") from None
    return [
        [line.rstrip("\n")] if line == "," or "," not in line else line.rstrip("\n").split(",")
        for line in lines
    ]


def _kind(char: str) -> str | None:
    """The tag of a character no spelling starts: <KIGOU>, <U2000U2BFF> or None (bytes)."""
    data = char.encode("utf-8")
    if len(data) == 2 and any(lo <= (data[0] << 8 | data[1]) <= hi for lo, hi in _KIGOU):
        return "<KIGOU>"
    if len(data) == 3 and 0xE28080 <= int.from_bytes(data, "big") <= 0xE2B07F:
        return "<U2000U2BFF>"
    return None


class JapaneseBackend:
    """The part of the tokenizers library's Tokenizer that llmrun.tokenizer.Tokenizer calls
    (`encode`, `encode_batch_fast`, `token_to_id`, `add_tokens`, `encode_special_tokens`)."""

    def __init__(self, spellings: list[list[str]], emoji: dict[str, str], unk: str) -> None:
        self.ids: dict[str, int] = {}
        for i, names in enumerate(spellings):
            for name in names:
                self.ids[name] = i  # a spelling on two lines takes the later id
        self.longest = max(len(name) for name in self.ids)
        self.emoji = emoji
        self.unk_id = self.ids.get(unk)
        self.encode_special_tokens = False  # moot: special tokens are matched as any text

    def add_tokens(self, tokens: list[Any]) -> None:
        """Nothing to add: the vocabulary spells every token."""

    def tokens(self, text: str) -> list[str]:
        """The text's tokens, as SubWordJapaneseTokenizer.tokenize cuts them."""
        for old, new in _REPLACED:
            text = text.replace(old, new)
        for char, tag in self.emoji.items():
            text = text.replace(char, tag)
        out, at, ids = [], 0, self.ids
        while at < len(text):
            end = min(len(text), at + self.longest + 1) if text[at] == "<" else at + 3
            best: tuple[int, str, int] | None = None
            for stop in range(end, at, -1):
                piece = text[at:stop]
                if piece not in ids:
                    continue
                if piece[0] == "<" and len(piece) > 2:
                    best = (ids[piece], piece, stop)
                    break
                if best is None or ids[piece] < best[0]:
                    best = (ids[piece], piece, stop)
            if best is not None:
                out.append(best[1])
                at = best[2]
                continue
            char = text[at]
            tag = _kind(char)
            out += [tag] if tag else [f"<|byte{b}|>" for b in char.encode("utf-8")]
            at += 1
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """`text`'s ids; a token the vocabulary lacks (a byte token) as the unknown token."""
        ids = [self.ids.get(token, self.unk_id) for token in self.tokens(text)]
        return Encoding([i for i in ids if i is not None])

    def encode_batch_fast(
        self, texts: list[str], add_special_tokens: bool = False
    ) -> list[Encoding]:
        return [self.encode(t) for t in texts]

    def token_to_id(self, text: str) -> int | None:
        return self.ids.get(text)


def _config_token(config: dict[str, Any], key: str) -> str:
    value = config.get(key, _SPECIALS[key])
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_args(folder: Path) -> dict[str, Any]:
    """llmrun.tokenizer.Tokenizer's arguments for a GPT-NeoX Japanese folder."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if config.get("do_clean_text"):
        raise UnsupportedError(
            f"{config_file}: do_clean_text (URLs, e-mail addresses, phone numbers, dates "
            "and prices turned into tags) is not supported"
        )
    spellings = read_vocab(folder / VOCAB)
    try:
        emoji = json.loads((folder / EMOJI).read_text(encoding="utf-8"))
        to_tag, to_char = dict(emoji["emoji"]), dict(emoji["emoji_inv"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{folder / EMOJI}: not an emoji table: {e}") from None
    if not spellings:
        raise TokenizerError(f"{folder / VOCAB}: no tokens")
    backend = JapaneseBackend(spellings, to_tag, _config_token(config, "unk_token"))

    def spell(i: int) -> bytes:
        word = spellings[i][0]
        number = word[6:-2] if word.startswith("<|byte") and word.endswith("|>") else ""
        if number.isdigit() and int(number) < 256:
            return bytes([int(number)])
        return to_char.get(word, _SHOWN.get(word, word)).encode("utf-8")

    specials = {backend.ids.get(_config_token(config, key)) for key in _SPECIALS} - {None}
    eos = backend.ids.get(_config_token(config, "eos_token"))
    return dict(
        backend=backend,
        spell=spell,
        vocab_size=len(spellings),
        bos_id=backend.ids.get(_config_token(config, "bos_token")),
        eos_id=eos,
        add_bos=False,
        add_eos=False,
        special_ids=specials,
        eog_ids={eos} - {None},
        strip_leading_space=False,
        source=str(folder / VOCAB),
    )

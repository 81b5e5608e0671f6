"""A folder's byte-level BPE tokenizer from vocab.json and merges.txt, where it ships no
tokenizer.json (facebook/blenderbot-400M-distill, -1B-distill), built as transformers 5's
BlenderbotTokenizer builds it: the BPE of vocab.json's ids and merges.txt's merges in their
order, GPT-2's byte-level pre-tokenizer (a space put before the text where
tokenizer_config.json's add_prefix_space says, as it does by default) and decoder, the
special tokens (<s>, </s>, <unk>, <pad>, <mask> unless tokenizer_config.json names others;
<mask> takes the space before it), added_tokens.json's tokens, and nothing put around a
sequence (transformers 5 frames none; its version 4 put </s> after). Other tokenizer
classes of the same two files (BlenderbotSmallTokenizer's, which lowercases and splits
words its own way; GPT-2's, RoBERTa's) are refused. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun.errors import TokenizerError, UnsupportedError

VOCAB, MERGES = "vocab.json", "merges.txt"
CLASS = "BlenderbotTokenizer"
# The tokenizer class transformers takes for a folder whose tokenizer_config.json names none.
_BY_MODEL_TYPE = {"blenderbot": CLASS, "blenderbot-small": "BlenderbotSmallTokenizer"}
# BlenderbotTokenizer's special tokens, by tokenizer_config.json's names, and their defaults.
_SPECIALS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "sep_token": "</s>",
    "cls_token": "<s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "mask_token": "<mask>",
}


def applies(folder: Path) -> bool:
    """Whether the folder's tokenizer is a vocab.json and merges.txt."""
    return (folder / VOCAB).is_file() and (folder / MERGES).is_file()


def _json(file: Path) -> Any:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: cannot be read as JSON: {e}") from None


def backend(folder: Path) -> Backend:
    """The folder's tokenizer (the module's docstring)."""
    settings = _json(folder / "tokenizer_config.json")
    settings = settings if isinstance(settings, dict) else {}
    config = _json(folder / "config.json")
    kind = settings.get("tokenizer_class") or (
        _BY_MODEL_TYPE.get(config.get("model_type")) if isinstance(config, dict) else None
    )
    if kind != CLASS:
        owner = f" ({kind}'s)" if kind else ""
        raise UnsupportedError(
            f"{folder / VOCAB} with {MERGES}{owner} is not supported: {CLASS}'s is, and a "
            "folder with tokenizer.json"
        )
    vocab = _json(folder / VOCAB)
    if not isinstance(vocab, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in vocab.items()
    ):
        raise TokenizerError(f"{folder / VOCAB}: expected an object of tokens and their ids")
    try:
        lines = (folder / MERGES).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{folder / MERGES}: {e}") from None
    merges = []
    for number, line in enumerate(lines, 1):
        if (number == 1 and line.startswith("#version")) or not line:
            continue
        pair = line.split(" ")
        if len(pair) != 2 or pair[0] + pair[1] not in vocab:
            raise TokenizerError(f"{folder / MERGES}: line {number} is not a merge of the vocab")
        merges.append((pair[0], pair[1]))
    model = BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tokenizer = Backend(model)
    prefix = settings.get("add_prefix_space", True)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix is not False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = []
    for name, default in _SPECIALS.items():
        value = settings.get(name, default)
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str) and text not in (t.content for t in specials):
            mask = name == "mask_token"
            specials.append(AddedToken(text, lstrip=mask, normalized=False, special=True))
    tokenizer.add_special_tokens(specials)
    added = _json(folder / "added_tokens.json")
    for text, wanted in sorted(added.items() if isinstance(added, dict) else (), key=_id):
        if text in vocab:
            continue
        tokenizer.add_tokens([AddedToken(text, normalized=False)])
        if tokenizer.token_to_id(text) != wanted:
            raise UnsupportedError(
                f"{folder / 'added_tokens.json'}: {text!r} at id {wanted!r}, not after the "
                "vocabulary, is not supported"
            )
    return tokenizer


def _id(item: tuple[str, Any]) -> int:
    return item[1] if isinstance(item[1], int) else -1

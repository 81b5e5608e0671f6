"""A folder's byte-level BPE tokenizer from vocab.json and merges.txt, where it ships no
tokenizer.json (facebook/blenderbot-400M-distill, -1B-distill; microsoft/trocr-*'s
RobertaTokenizer files), built as transformers 5's BlenderbotTokenizer and RobertaTokenizer
build it: the BPE of vocab.json's ids and merges.txt's merges in their order, GPT-2's
byte-level pre-tokenizer (a space put before the text where tokenizer_config.json's
add_prefix_space says; Blenderbot's default puts one, RoBERTa's none) and decoder, the special
tokens (<s>, </s>, <unk>, <pad>, <mask> unless tokenizer_config.json or special_tokens_map.json
names others; a token's lstrip and rstrip as they or added_tokens_decoder say, else
Blenderbot's <mask> takes the space before it), added_tokens.json's tokens, and what is put
around a sequence: nothing for Blenderbot (transformers 5 frames none; its version 4 put </s>
after), <s> ... </s> for RoBERTa. Other tokenizer classes of the same two files
(BlenderbotSmallTokenizer's, which lowercases and splits words its own way; GPT-2's) are
refused. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun.errors import TokenizerError, UnsupportedError

VOCAB, MERGES = "vocab.json", "merges.txt"
CLASS, ROBERTA = "BlenderbotTokenizer", "RobertaTokenizer"
# Per class: add_prefix_space's default, whether <mask> takes the space before it by default,
# whether <s> ... </s> frame a sequence.
_CLASSES = {CLASS: (True, True, False), ROBERTA: (False, False, True)}
# The tokenizer class transformers takes for a folder whose tokenizer_config.json names none.
_BY_MODEL_TYPE = {
    "blenderbot": CLASS,
    "blenderbot-small": "BlenderbotSmallTokenizer",
    "roberta": ROBERTA,
}
# The two classes' special tokens, by tokenizer_config.json's names, and their defaults.
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
    if kind not in _CLASSES:
        owner = f" ({kind}'s)" if kind else ""
        raise UnsupportedError(
            f"{folder / VOCAB} with {MERGES}{owner} is not supported: {CLASS}'s and "
            f"{ROBERTA}'s are, and a folder with tokenizer.json"
        )
    prefix_default, mask_lstrip, framed = _CLASSES[kind]
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
    prefix = settings.get("add_prefix_space", prefix_default)
    prefix = prefix if isinstance(prefix, bool) else prefix_default
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    tokenizer.decoder = decoders.ByteLevel()
    specials: list[AddedToken] = []
    values = _special_values(folder, settings)
    for name, value in values.items():
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str) and text not in (t.content for t in specials):
            lstrip = mask_lstrip and name == "mask_token"
            strips = value if isinstance(value, dict) else {"lstrip": lstrip}
            specials.append(
                AddedToken(
                    text,
                    lstrip=strips.get("lstrip") is True,
                    rstrip=strips.get("rstrip") is True,
                    normalized=False,
                    special=True,
                )
            )
    tokenizer.add_special_tokens(specials)
    if framed:
        cls, sep = (_content(values[k]) for k in ("cls_token", "sep_token"))
        cls_id, sep_id = (
            tokenizer.token_to_id(t) if isinstance(t, str) else None for t in (cls, sep)
        )
        if cls_id is None or sep_id is None:
            raise TokenizerError(f"{folder}: {ROBERTA}'s {cls!r} or {sep!r} has no id")
        tokenizer.post_processor = processors.RobertaProcessing(
            (sep, sep_id), (cls, cls_id), trim_offsets=True, add_prefix_space=prefix
        )
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


def _special_values(folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Each special token's text or settings, as transformers 5 resolves them: from
    tokenizer_config.json, which special_tokens_map.json overrides where tokenizer_config.json
    has no added_tokens_decoder, and whose entry of the same text (lstrip, rstrip) wins."""
    values = {name: settings.get(name, default) for name, default in _SPECIALS.items()}
    decoder = settings.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        mapped = _json(folder / "special_tokens_map.json")
        mapped = mapped if isinstance(mapped, dict) else {}
        values.update({k: v for k, v in mapped.items() if k in _SPECIALS and v})
        return values
    by_text = {
        t.get("content"): t for t in decoder.values() if isinstance(t, dict) and t.get("content")
    }
    return {name: by_text.get(_content(value), value) for name, value in values.items()}


def _content(value: Any) -> Any:
    return value.get("content") if isinstance(value, dict) else value


def _id(item: tuple[str, Any]) -> int:
    return item[1] if isinstance(item[1], int) else -1

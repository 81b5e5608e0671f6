"""Wav2Vec2CTCTokenizer's files (vocab.json of characters, tokenizer_config.json) as an
llmrun Tokenizer: a text is its characters, a space the word delimiter (`|`), the
special tokens (<pad>, <s>, </s>, <unk>) kept whole; a token decodes to its text, the word
delimiter to replace_word_delimiter_char (a space). CTC's grouping of repeats and its
blank (the pad token) are the transcriber's (llmrun.wav2vec2). A multilingual vocab.json
(one vocabulary per target language, MMS's) and do_lower_case (the text upper-cased before
encoding) are refused.

Reference: transformers/models/wav2vec2/tokenization_wav2vec2.py (Wav2Vec2CTCTokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from llmrun.errors import TokenizerError, UnsupportedError

VOCAB = "vocab.json"
CLASS = "Wav2Vec2CTCTokenizer"
# tokenizer_config.json's special tokens, and Wav2Vec2CTCTokenizer's defaults
MODEL_TYPES = ("wav2vec2", "hubert", "data2vec-audio", "wavlm")
_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def _read(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: not a JSON object")
    return data


def applies(folder: Path) -> bool:
    """Whether the folder's tokenizer is a Wav2Vec2CTCTokenizer's vocab.json: so named, or
    unnamed in a wav2vec2, HuBERT, data2vec-audio or WavLM folder (the Hub's facebook/wav2vec2-base-960h names no
    tokenizer_class)."""
    if not (folder / VOCAB).is_file():
        return False
    kind = _read(folder / "tokenizer_config.json").get("tokenizer_class")
    model_type = _read(folder / "config.json").get("model_type")
    return kind == CLASS or (kind is None and model_type in MODEL_TYPES)


def _token(config: dict[str, Any], key: str, default: str) -> str:
    value = config.get(key, default)
    return value.get("content", default) if isinstance(value, dict) else value


def tokenizer_args(folder: Path) -> dict[str, Any]:
    """llmrun.tokenizer.Tokenizer's arguments for a Wav2Vec2CTCTokenizer folder."""
    config = _read(folder / "tokenizer_config.json")
    vocab = _read(folder / VOCAB)
    if any(isinstance(v, dict) for v in vocab.values()):
        raise UnsupportedError(
            f"{folder / VOCAB}: one vocabulary per target language (a multilingual "
            f"{CLASS}'s), which llmrun does not run"
        )
    if not vocab or not all(isinstance(v, int) and 0 <= v < len(vocab) for v in vocab.values()):
        raise TokenizerError(f"{folder / VOCAB}: not a vocabulary of ids 0..{len(vocab) - 1}")
    if config.get("do_lower_case"):
        raise UnsupportedError(
            f"{folder / 'tokenizer_config.json'}: do_lower_case (texts upper-cased before "
            "encoding) is not supported"
        )
    texts = {i: t for t, i in vocab.items()}
    if len(texts) != len(vocab):
        raise TokenizerError(f"{folder / VOCAB}: two tokens share an id")
    delimiter = _token(config, "word_delimiter_token", "|")
    shown = config.get("replace_word_delimiter_char", " ")
    specials = {k: _token(config, k, d) for k, d in _SPECIALS.items()}
    backend = Backend(models.WordLevel(vocab, unk_token=specials["unk_token"]))
    backend.normalizer = normalizers.Replace(" ", delimiter)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    # kept whole, the spaces around them dropped (lstrip, rstrip), as the tokenizer adds them
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, lstrip=True, rstrip=True)
            for t in specials.values()
            if t in vocab
        ]
    )

    def spell(i: int) -> bytes:
        text = texts[i]
        return (shown if text == delimiter else text).encode("utf-8")

    ids = {k: vocab.get(t) for k, t in specials.items()}
    return dict(
        backend=backend,
        spell=spell,
        vocab_size=len(vocab),
        bos_id=ids["bos_token"],
        eos_id=ids["eos_token"],
        add_bos=False,
        add_eos=False,
        special_ids={i for i in ids.values() if i is not None},
        eog_ids={ids["eos_token"]} - {None},
        strip_leading_space=False,
        source=str(folder / VOCAB),
    )

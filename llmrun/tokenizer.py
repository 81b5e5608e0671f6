"""Text <-> token ids: the Tokenizer every source builds, its streaming decoder, load_tokenizer.

The `tokenizers` library does the encoding. A tokenizer comes from a tokenizer.json (read here),
from Mistral's tekken.json (llmrun.tekken), from a Marian folder's source.spm and vocab.json
(llmrun.marian_tokenizer) or from GGUF `tokenizer.ggml.*` metadata
(llmrun.tokenizer_gguf, which reproduces llama.cpp), which a folder's SentencePiece model file
becomes (llmrun.sentencepiece_model).
Decoding is done here, from each token's bytes (llmrun.token_bytes), so that a stream of pieces
concatenates to exactly the full decode and never ends inside a UTF-8 character. No torch here.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from llmrun import (
    byte_level_bpe,
    gpt_neox_japanese_tokenizer,
    marian_tokenizer,
    plamo2_tokenizer,
    rwkv_tokenizer,
    sentencepiece_model,
    tekken,
    tokenizer_gguf,
    wav2vec2_tokenizer,
)
from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.pretokenizers import SPM_SPACE
from llmrun.token_bytes import byte_level_bytes, raw, spm_bytes
from llmrun.tokenizer_gguf import END_OF_GENERATION, FIM_ENDS, fim_by_text

_BATCH = 4096  # texts per call of the tokenizers library's encode_batch
XGLM_CLASSES = ("XGLMTokenizer", "XGLMTokenizerFast")


class Tokenizer:
    """Encodes text to token ids and decodes them back, the same way for every source."""

    def __init__(
        self,
        backend: Backend,
        spell: Callable[[int], bytes],
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        special_ids: Iterable[int],
        eog_ids: Iterable[int],
        strip_leading_space: bool,
        source: str,
        split_special: Callable[[str, bool], list[str | int]] | None = None,
        post_processed: bool = False,
        fim_ids: Mapping[str, int] | None = None,
        token_ids: Mapping[str, int] | None = None,
    ) -> None:
        self._backend = backend
        # Token text -> id, where the backend's vocabulary does not spell every token
        # (a GGUF Unigram one holds no control token's text); else the backend's.
        self._token_ids = token_ids
        self._spell = spell
        self._bytes: list[bytes | None] = [None] * vocab_size
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.special_ids = frozenset(special_ids)
        self.eog_ids = frozenset(eog_ids)
        self.strip_leading_space = strip_leading_space
        self.source = source
        # (text, parse_special) -> plain text and special-token ids, where llama.cpp finds
        # special tokens otherwise than the tokenizers library does (tokenizer_gguf).
        self._split_special = split_special
        # Whether the backend's post-processor (a tokenizer.json's) says which special
        # tokens go around a text, as transformers applies it; else add_bos and add_eos say.
        self._post_processed = post_processed
        # Fill-in-the-middle tokens by name (tokenizer_gguf.FIM_NAMES: pre, suf, mid, pad,
        # rep, sep), those the vocabulary has.
        self.fim_ids = dict(fim_ids or {})

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`; BOS as the model says unless `add_bos`, and never twice.

        `parse_special=False` reads control tokens such as "<|im_end|>" as plain text;
        user-defined tokens are matched either way, as llama.cpp does.
        """
        self._backend.encode_special_tokens = not parse_special
        if self._split_special is None:
            ids = self._encode_text(text)
        else:
            parts = self._split_special(text, parse_special)
            ids = _stitch(parts, map(self._encode_text, _plain(parts)))
        wants_bos = self.add_bos if add_bos is None else add_bos
        if wants_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def encode_sequence(self, text: str) -> list[int]:
        """Token ids of `text` as a sequence on its own, with the special tokens the model's
        tokenizer puts around one (an embedding's input): a tokenizer.json's post-processor
        where it has one (transformers' add_special_tokens, e.g. BERT's [CLS] ... [SEP],
        Qwen3-Embedding's <|endoftext|> at the end), else BOS and EOS as the file's
        add_bos and add_eos say (llama.cpp's add_special). Special-token text is parsed."""
        if self._post_processed:
            self._backend.encode_special_tokens = False
            try:
                return self._backend.encode(text, add_special_tokens=True).ids
            except TypeError:  # not UTF-8: the library takes only valid text
                return self._backend.encode(valid_text(text), add_special_tokens=True).ids
        ids = self.encode(text)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def pair_parts(
        self, first: str, seconds: Sequence[str]
    ) -> list[tuple[list[int], list[int], list[int], int]] | None:
        """`first` joined with each of `seconds` by a tokenizer.json's post-processor, as
        transformers' `tokenizer(first, second)` joins a cross-encoder's pair: for each, the
        ids before the second text, the second text's own, those after it, and where token
        type 1 begins. None without a post-processor (the caller joins by its own rules)."""
        if not self._post_processed:
            return None
        backend = self._backend
        backend.encode_special_tokens = False
        head = backend.encode(valid_text(first), add_special_tokens=False)
        out = []
        for second in seconds:
            tail = backend.encode(valid_text(second), add_special_tokens=False)
            pair = backend.post_process(head, tail, add_special_tokens=True)
            ids, sequences = pair.ids, pair.sequence_ids
            start = sequences.index(1) if 1 in sequences else len(ids)
            end = len(sequences) - sequences[::-1].index(1) if 1 in sequences else len(ids)
            type_one = pair.type_ids.index(1) if 1 in pair.type_ids else len(ids)
            out.append((ids[:start], ids[start:end], ids[end:], type_one))
        return out

    def encode_batch(
        self,
        texts: Sequence[str],
        add_bos: bool | None = None,
        parse_special: bool = True,
        threads: int | None = None,
    ) -> list[list[int]]:
        """`encode` of each text, on the `tokenizers` library's threads (`threads` of them).

        The library sizes its thread pool once per process, at its first parallel encode, so
        a `threads` given later than that is not honoured, except 1 (no pool at all).
        """
        self._backend.encode_special_tokens = not parse_special
        with _thread_pool(threads):
            if self._split_special is None:
                out = self._encode_texts(list(texts))
            else:
                split = [self._split_special(t, parse_special) for t in texts]
                plain = iter(self._encode_texts([p for parts in split for p in _plain(parts)]))
                out = [_stitch(parts, plain) for parts in split]
        wants_bos = self.add_bos if add_bos is None else add_bos
        if wants_bos and self.bos_id is not None:
            for ids in out:
                if ids[:1] != [self.bos_id]:
                    ids.insert(0, self.bos_id)
        return out

    def _encode_text(self, text: str) -> list[int]:
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:  # not UTF-8: the library takes only valid text
            return self._backend.encode(valid_text(text), add_special_tokens=False).ids

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        # In chunks: the library's Encoding objects hold each token's text and offsets too.
        for start in range(0, len(texts), _BATCH):
            chunk = texts[start : start + _BATCH]
            try:
                encodings = self._backend.encode_batch_fast(chunk, add_special_tokens=False)
            except TypeError:  # a text that is not UTF-8
                chunk = [valid_text(t) for t in chunk]
                encodings = self._backend.encode_batch_fast(chunk, add_special_tokens=False)
            out += [e.ids for e in encodings]
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary decode to nothing, like in `tokenizers`."""
        data = b"".join(self._piece(i, skip_special) for i in ids)
        if self.strip_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def stream(self, skip_special: bool = True, *, after: Iterable[int] = ()) -> StreamDecoder:
        """An incremental decoder. `after` holds ids whose text was already shown (a prompt):
        the stream continues them, so a leading space that decode() would strip is kept."""
        decoder = StreamDecoder(self, skip_special)
        for token_id in after:
            decoder.add(token_id)
        return decoder

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (one byte for a byte-fallback token)."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(
                f"{self.source}: token id {token_id} is outside the vocabulary "
                f"of {self.vocab_size} tokens"
            )
        piece = self._bytes[token_id]
        if piece is None:
            piece = self._bytes[token_id] = self._spell(token_id)
        return piece

    def token_to_piece(self, token_id: int) -> str:
        """What llama.cpp's llama-tokenize prints for the id (control tokens as their text)."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def token_id(self, text: str) -> int | None:
        """The id of a token stored exactly as `text`, such as "<|im_end|>"; None if none."""
        if self._token_ids is not None:
            return self._token_ids.get(text)
        return self._backend.token_to_id(text)

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        if (skip_special and token_id in self.special_ids) or not (0 <= token_id < self.vocab_size):
            return b""
        return self.token_bytes(token_id)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], source: str) -> Tokenizer:
        """Build from GGUF metadata as llama.cpp reads it; `source` names the file in errors."""
        return cls(**tokenizer_gguf.tokenizer_args(metadata, source))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from tokenizer.json, with BOS/EOS from tokenizer_config.json when present;
        where the folder has no tokenizer.json, from Mistral's tekken.json as mistral_common
        reads it, else from a SentencePiece model file (tokenizer.model, spiece.model or
        sentencepiece.bpe.model) as llama.cpp's converter reads it, else a Marian folder's
        source.spm and vocab.json as MarianTokenizer reads them (llmrun.marian_tokenizer, which
        reads a Speech2Text folder's sentencepiece.bpe.model and vocab.json too), else a
        Blenderbot or RoBERTa folder's vocab.json and merges.txt (llmrun.byte_level_bpe), else
        GPT-NeoX Japanese's vocab.txt and emoji.json (llmrun.gpt_neox_japanese_tokenizer), else
        PLaMo's tokenizer.jsonl (llmrun.plamo2_tokenizer), else a Wav2Vec2CTCTokenizer's
        vocab.json (llmrun.wav2vec2_tokenizer)."""
        path = Path(path)
        file = hf_tokenizer_file(path)
        if file.name == tekken.FILE:
            return cls(**tekken.tokenizer_args(file))
        if file.name == rwkv_tokenizer.VOCAB_FILE:  # fla-hub's RWKV, as llama.cpp converts it
            vocab_size = _read_json(path / "config.json").get("vocab_size", 65536)
            metadata = rwkv_tokenizer.folder_metadata(path, vocab_size)
            return cls.from_gguf_metadata(metadata, str(file))
        if file.name == plamo2_tokenizer.VOCAB_FILE:  # PLaMo's, as llama.cpp converts it
            vocab_size = _read_json(path / "config.json").get("vocab_size", 0)
            metadata = plamo2_tokenizer.folder_metadata(path, vocab_size)
            return cls.from_gguf_metadata(metadata, str(file))
        if file.name == wav2vec2_tokenizer.VOCAB and wav2vec2_tokenizer.applies(path):
            return cls(**wav2vec2_tokenizer.tokenizer_args(path))
        if file.name == marian_tokenizer.FILE:
            return cls(**marian_tokenizer.tokenizer_args(path))
        if (
            file.name == marian_tokenizer.SPEECH_TO_TEXT_FILE
            and _read_json(path / "config.json").get("model_type") == "speech_to_text"
        ):
            return cls(**marian_tokenizer.tokenizer_args(path, marian_tokenizer.SPEECH_TO_TEXT))
        if file.name == sentencepiece_model.XLMR_FILE and (path / "vocab.json").is_file():
            # M2M100Tokenizer's files (facebook/m2m100_*): pieces looked up in vocab.json,
            # not laid out as XLM-RoBERTa's are, which would give other ids.
            raise UnsupportedError(
                f"{file} with vocab.json (M2M100Tokenizer's) is not supported: a folder "
                "with tokenizer.json is"
            )
        if file.name == sentencepiece_model.T5_FILE and _read_json(path / "config.json").get(
            "model_type"
        ) in ("pegasus", "pegasus_x"):
            # PegasusTokenizer's spiece.model: its pieces 103 ids on, after <pad>, </s>, the
            # masks and <unk_2>..<unk_102>, not where T5Tokenizer puts them.
            raise UnsupportedError(
                f"{file} (PegasusTokenizer's) is not supported: a folder with tokenizer.json is"
            )
        if file.name in sentencepiece_model.FILES:
            metadata = sentencepiece_model.gguf_metadata(file)
            return cls(**tokenizer_gguf.tokenizer_args(metadata, str(file)))
        if file.name == gpt_neox_japanese_tokenizer.VOCAB:
            return cls(**gpt_neox_japanese_tokenizer.tokenizer_args(path))
        if file.name == byte_level_bpe.VOCAB:
            backend = byte_level_bpe.backend(path)
        else:
            try:
                backend = Backend.from_file(str(file))
            except Exception as e:
                raise TokenizerError(
                    f"{file}: cannot be read by the tokenizers library: {e}"
                ) from None
        config = _read_json(path / "tokenizer_config.json")

        def config_token(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        added = backend.get_added_tokens_decoder()
        special_ids = {i for i, t in added.items() if t.special}
        if _read_json(path / "config.json").get("model_type") == "florence2":
            # Florence-2's task and location tokens (<od>, <loc_N>, ...) are its replies'
            # text: its processor decodes them (skip_special_tokens=False) and drops only
            # <s>, </s> and <pad>.
            special_ids &= {config_token(k) for k in ("bos_token", "eos_token", "pad_token")}
        bos, eos = config_token("bos_token"), config_token("eos_token")
        template_first = _template_first_special(backend)
        if bos is None:
            bos = template_first
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = template_first is not None and template_first == bos
        if config.get("tokenizer_class") in XGLM_CLASSES:
            # transformers' XGLMTokenizer sets a post-processor that puts its EOS (</s>),
            # not its BOS, before every text, whatever tokenizer.json holds.
            bos, add_bos = eos, eos is not None
        eog_ids = {i for i, t in added.items() if t.content in END_OF_GENERATION}
        eog_ids |= {eos} if eos is not None else set()
        eot = config_token("eot_token")  # CodeLlama's "▁<EOT>", which ends an infill
        eog_ids |= {eot} if eot is not None else set()
        # As llama.cpp finds them in the GGUF of the same folder: by their text, the pad,
        # repo and file-separator ones ending generation.
        fim_ids = fim_by_text(backend.token_to_id)
        eog_ids |= {fim_ids[name] for name in FIM_ENDS if name in fim_ids}

        decoder = _decoder_parts(backend, file)
        strip = False
        if "ByteLevel" in decoder:
            spell_model: Callable[[str], bytes] = byte_level_bytes
        elif "Metaspace" in decoder or "Replace" in decoder:
            fallback = "ByteFallback" in decoder
            metaspace = decoder.get("Metaspace", {})
            strip = metaspace.get("prepend_scheme", "never") != "never" or bool(
                metaspace.get("add_prefix_space")
            )
            strip |= decoder.get("Strip", {}).get("start", 0) > 0

            def spell_model(text: str) -> bytes:
                return spm_bytes(text, fallback)
        elif set(decoder) == {"Fuse"}:  # OmniASR's (OmniASRConverter): the pieces as written
            spell_model = raw
        elif "WordPiece" in decoder:  # BERT's: "##" continues a word, other pieces start one
            prefix, strip = decoder["WordPiece"].get("prefix", "##"), True

            def spell_model(text: str) -> bytes:
                return raw(text[len(prefix) :] if text.startswith(prefix) else " " + text)
        else:
            raise UnsupportedError(
                f"{file}: decoder {sorted(decoder) or 'none'} is not supported "
                "(supported: ByteLevel, Metaspace, Replace \u2581 with ByteFallback, WordPiece, "
                "Fuse)"
            )

        def spell(i: int) -> bytes:
            if i in added:
                return raw(added[i].content)
            text = backend.id_to_token(i)
            return b"" if text is None else spell_model(text)

        return cls(
            backend,
            spell,
            vocab_size=max(
                backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1
            ),
            bos_id=bos,
            eos_id=eos,
            add_bos=add_bos,
            add_eos=bool(config.get("add_eos_token", False)),
            special_ids=special_ids,
            eog_ids=eog_ids,
            strip_leading_space=strip,
            source=str(file),
            post_processed=backend.post_processor is not None,
            fim_ids=fim_ids,
        )


class StreamDecoder:
    """Turns ids into text one at a time, holding back bytes of an unfinished character.

    The pieces returned by `add` and `flush` concatenate to exactly `Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._strip = tokenizer.strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        """Text that `token_id` completes; may be empty while a character is unfinished."""
        data = self._tokenizer._piece(token_id, self._skip_special)
        if self._strip and data:
            self._strip = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is held back (an unfinished character decodes to U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _plain(parts: list[str | int]) -> list[str]:
    return [p for p in parts if isinstance(p, str)]


def _stitch(parts: list[str | int], plain_ids: Iterator[list[int]]) -> list[int]:
    """The ids of text split into plain text and token ids: the plain texts' ids, in order,
    come from `plain_ids`."""
    ids: list[int] = []
    for part in parts:
        ids += [part] if isinstance(part, int) else next(plain_ids)
    return ids


def valid_text(text: str) -> str:
    """`text` with what is not UTF-8 in it as U+FFFD: bytes that were not UTF-8 (which
    Python reads from stdin and argv as lone surrogates) or a lone surrogate from JSON."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def hf_tokenizer_file(folder: Path) -> Path:
    """A model folder's tokenizer.json, else its tekken.json (as llama.cpp's converter
    chooses), else its SentencePiece model file, else a Marian folder's source.spm, else its
    vocab.json beside merges.txt, else GPT-NeoX Japanese's vocab.txt beside emoji.json;
    refuses a folder with none."""
    for name in ("tokenizer.json", tekken.FILE, *sentencepiece_model.FILES, marian_tokenizer.FILE):
        if (folder / name).is_file():
            return folder / name
    if byte_level_bpe.applies(folder):
        return folder / byte_level_bpe.VOCAB
    if gpt_neox_japanese_tokenizer.applies(folder):
        return folder / gpt_neox_japanese_tokenizer.VOCAB
    if rwkv_tokenizer.applies(folder):
        return folder / rwkv_tokenizer.VOCAB_FILE
    if plamo2_tokenizer.applies(folder):
        return folder / plamo2_tokenizer.VOCAB_FILE
    if wav2vec2_tokenizer.applies(folder):
        return folder / wav2vec2_tokenizer.VOCAB
    raise TokenizerError(
        f"{folder}: no tokenizer.json, tekken.json or tokenizer.model (a model directory "
        f"needs one; {' or '.join(sentencepiece_model.FILES[1:])} also do)"
    )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from a GGUF file, a model directory, or a tokenizer.json file."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.name == "tokenizer.json" and path.is_file():
        return Tokenizer.from_hf_dir(path.parent)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such file or directory")
    # Imported here: the llmrun.loading package imports torch, which tokenizing never needs.
    from llmrun.loading.gguf_io import read_gguf

    return Tokenizer.from_gguf_metadata(read_gguf(path, with_tensors=False).metadata, str(path))


_pool = {"started": False}


@contextlib.contextmanager
def _thread_pool(threads: int | None) -> Iterator[None]:
    """Runs a batch on `threads` of the tokenizers library's threads (None: its default).

    The library reads TOKENIZERS_PARALLELISM at every call (while it is "false", no thread
    pool is used or started) and RAYON_NUM_THREADS once, when it starts its pool.
    """
    if threads is not None and threads < 1:
        raise TokenizerError(f"threads must be at least 1, got {threads}")
    if threads == 1:
        with _environ("TOKENIZERS_PARALLELISM", "false"):
            yield
        return
    starts = not _pool["started"]
    _pool["started"] = True
    with _environ("RAYON_NUM_THREADS", str(threads) if starts and threads else None):
        yield


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (None: left as it is) for the block."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and saved is None:
            del os.environ[name]
        elif value is not None:
            os.environ[name] = saved


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return data


def _component(obj: Any) -> dict[str, Any]:
    # tokenizers' components pickle to their tokenizer.json form.
    return json.loads(obj.__getstate__()) if obj is not None else {}


def _decoder_parts(backend: Backend, file: Path) -> dict[str, dict[str, Any]]:
    """The decoder's steps by type: {"ByteLevel": {...}} or {"Replace": ..., "Strip": ...}."""
    decoder = _component(backend.decoder)
    steps = decoder.get("decoders", [decoder]) if decoder else []
    for step in steps:
        if step.get("type") == "Replace" and (
            step.get("pattern") != {"String": SPM_SPACE} or step.get("content") != " "
        ):
            raise UnsupportedError(
                f"{file}: decoder Replace {step.get('pattern')} -> {step.get('content')!r} "
                f"is not supported (only {SPM_SPACE} -> ' ')"
            )
    return {s["type"]: s for s in steps if "type" in s}


def _template_first_special(backend: Backend) -> int | None:
    """The id a TemplateProcessing post-processor puts before the text, if any (e.g. BOS)."""
    processor = _component(backend.post_processor)
    for step in processor.get("processors", [processor]):
        if step.get("type") != "TemplateProcessing":
            continue
        single = step.get("single") or [{}]
        first = single[0].get("SpecialToken")
        if first is not None:
            ids = step.get("special_tokens", {}).get(first.get("id"), {}).get("ids") or [None]
            return ids[0]
    return None

"""A tokenizer's parts from GGUF `tokenizer.ggml.*` metadata, as llama.cpp reads it.

The vocabulary (text -> id), the backend that merges it (llmrun.gguf_bpe's C merging: the
file's merges for BPE, "gpt2", "gemma4" and "whitespace", the scores for SentencePiece,
"llama"; the `tokenizers` library's BPE for batches and where nothing can be compiled, with
SentencePiece merges derived from the scores by llmrun.spm_merges), llama.cpp's
pre-tokenizer for the file's `tokenizer.ggml.pre` (llmrun.pretokenizers), and llama.cpp's
rules for which tokens are control, user-defined, unused or end generation.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from gguf import Keys, TokenType
from tokenizers import AddedToken, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from llmrun import gguf_bpe
from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.gguf_bpe import MergingBackend
from llmrun.plamo2_tokenizer import Plamo2Backend
from llmrun.pretokenizers import (
    FORK_PRE_TOKENIZERS,
    PRE_TOKENIZERS,
    SPM_SPACE,
    WHITESPACE_MODEL,
    PreTokenizer,
    pre_tokenizer,
)
from llmrun.rwkv_tokenizer import RwkvBackend
from llmrun.spm_merges import spm_merges
from llmrun.token_bytes import BYTE_LEVEL_ALPHABET, byte_level_bytes, raw, spm_bytes
from llmrun.unigram import unigram_backend
from llmrun.wordpiece import LOWERCASE_KEY, wordpiece_backend

# Token texts llama.cpp treats as end of generation (and as control tokens) in any vocabulary.
END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's
    "[e~[",
)
# Fill-in-the-middle tokens, found by their text where the file names none: llama.cpp makes
# them control tokens, and the pad, repo and file-separator ones end generation.
_FIM_TEXTS = {
    Keys.Tokenizer.FIM_PRE_ID: (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    Keys.Tokenizer.FIM_SUF_ID: (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    Keys.Tokenizer.FIM_MID_ID: (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    Keys.Tokenizer.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    Keys.Tokenizer.FIM_REP_ID: (
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ),
    Keys.Tokenizer.FIM_SEP_ID: ("<|file_sep|>",),
}
_FIM_ENDS = (Keys.Tokenizer.FIM_PAD_ID, Keys.Tokenizer.FIM_REP_ID, Keys.Tokenizer.FIM_SEP_ID)
# What Tokenizer.fim_ids calls each one.
FIM_NAMES = {
    Keys.Tokenizer.FIM_PRE_ID: "pre",
    Keys.Tokenizer.FIM_SUF_ID: "suf",
    Keys.Tokenizer.FIM_MID_ID: "mid",
    Keys.Tokenizer.FIM_PAD_ID: "pad",
    Keys.Tokenizer.FIM_REP_ID: "rep",
    Keys.Tokenizer.FIM_SEP_ID: "sep",
}
FIM_ENDS = tuple(FIM_NAMES[key] for key in _FIM_ENDS)
_FIM_OLD_KEYS = {  # the names older files use
    Keys.Tokenizer.FIM_PRE_ID: Keys.Tokenizer.PREFIX_ID,
    Keys.Tokenizer.FIM_SUF_ID: Keys.Tokenizer.SUFFIX_ID,
    Keys.Tokenizer.FIM_MID_ID: Keys.Tokenizer.MIDDLE_ID,
}
# gpt-oss: llama.cpp always matches and prints these, even where the file calls them control.
_ALWAYS_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
GGUF_MODELS = ("llama", "gpt2", "gemma4", "bert", "t5", "whitespace", "rwkv", "plamo2")
RWKV_MODEL = "rwkv"  # RWKV world: llmrun.rwkv_tokenizer
PLAMO2_MODEL = "plamo2"  # PLaMo 2 and 3: llmrun.plamo2_tokenizer
WPM_MODEL = "bert"  # WordPiece: llmrun.wordpiece
UGM_MODEL = "t5"  # Unigram: llmrun.unigram
# llama.cpp's WPM ids where the file names none (llama_vocab::impl::load, "bert").
WPM_DEFAULTS = {Keys.Tokenizer.BOS_ID: 101, Keys.Tokenizer.SEP_ID: 102, Keys.Tokenizer.UNK_ID: 100}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection inside: building a vocabulary makes a million tuples and no
    cycles, and the collector, run every few hundred of them, would find nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_metadata(metadata: dict[str, Any], source: str) -> PreTokenizer | None:
    """Refuses, in a moment, GGUF metadata whose tokenizer llmrun cannot build (so `run`
    says so before it loads the weights); returns its BPE pre-tokenizer (None: SPM, WPM or
    UGM, which have none)."""
    model = metadata.get(Keys.Tokenizer.MODEL)
    if model not in GGUF_MODELS:
        if model is None:
            raise TokenizerError(f"{source}: no {Keys.Tokenizer.MODEL} in the metadata")
        raise UnsupportedError(
            f"{source}: {Keys.Tokenizer.MODEL} {model!r} is not supported "
            f"(supported: {', '.join(map(repr, GGUF_MODELS))})"
        )
    tokens = metadata.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens:
        raise TokenizerError(f"{source}: no {Keys.Tokenizer.LIST} in the metadata")
    if model in ("llama", WPM_MODEL, UGM_MODEL, RWKV_MODEL, PLAMO2_MODEL):
        return None
    if model == "whitespace":
        pre_name = metadata.get(Keys.Tokenizer.PRE) or "whitespace"
        if pre_name != "whitespace":
            raise UnsupportedError(
                f"{source}: pre-tokenizer {Keys.Tokenizer.PRE} = {pre_name!r} is not supported "
                "with tokenizer model 'whitespace' (llama.cpp's converter writes 'whitespace')"
            )
        # llama.cpp lowercases there only, as tokenizer.ggml.normalizer.lowercase says.
        return replace(WHITESPACE_MODEL, lowercase=bool(metadata.get(LOWERCASE_KEY, False)))
    # llama.cpp reads no tokenizer.ggml.pre for Gemma 4's own tokenizer model, and takes
    # a missing or empty one for "default".
    name = "gemma4" if model == "gemma4" else metadata.get(Keys.Tokenizer.PRE) or "default"
    pre = PRE_TOKENIZERS.get(name) or FORK_PRE_TOKENIZERS.get(name)
    if pre is None:
        raise UnsupportedError(
            f"{source}: pre-tokenizer {Keys.Tokenizer.PRE} = {name!r} is not supported "
            f"(llmrun knows the {len(PRE_TOKENIZERS)} values llama.cpp knows for BPE, "
            "as of llama-cpp-python 0.3.36; they are listed in llmrun/pretokenizers.py)"
        )
    return pre


@_gc_paused()
def tokenizer_args(metadata: dict[str, Any], source: str) -> dict[str, Any]:
    """Keyword arguments of `Tokenizer` for GGUF metadata, as llama.cpp reads it; `source`
    names the file in errors."""
    pre = check_metadata(metadata, source)
    tokens = metadata[Keys.Tokenizer.LIST]
    n = len(tokens)
    types = _gguf_array(metadata, Keys.Tokenizer.TOKEN_TYPE, n, source, TokenType.NORMAL)

    def token_id(key: str, default: int | None = None) -> int | None:
        value = metadata.get(key, default)
        # Files write 0xFFFFFFFF (or any id past the end) for "no such token".
        return value if isinstance(value, int) and 0 <= value < n else None

    wpm = metadata[Keys.Tokenizer.MODEL] == WPM_MODEL
    ugm = metadata[Keys.Tokenizer.MODEL] == UGM_MODEL
    rwkv = metadata[Keys.Tokenizer.MODEL] == RWKV_MODEL
    plamo2 = metadata[Keys.Tokenizer.MODEL] == PLAMO2_MODEL
    spm = pre is None and not wpm and not ugm and not rwkv and not plamo2
    vocab = _gguf_vocab(tokens)
    add_eos = bool(metadata.get(Keys.Tokenizer.ADD_EOS, False))
    if wpm:
        add_prefix = False
        unk = token_id(Keys.Tokenizer.UNK_ID, WPM_DEFAULTS[Keys.Tokenizer.UNK_ID])
        backend = wordpiece_backend(metadata, tokens, types, unk)
        add_bos_default = True
        # [CLS] before a text, [SEP] after it (llama.cpp's add_sep; it reads no add_eos here).
        bos = token_id(Keys.Tokenizer.BOS_ID, WPM_DEFAULTS[Keys.Tokenizer.BOS_ID])
        eos = token_id(Keys.Tokenizer.SEP_ID, WPM_DEFAULTS[Keys.Tokenizer.SEP_ID])
        add_eos = bool(metadata.get(Keys.Tokenizer.ADD_SEP, True))
    elif ugm:
        add_prefix = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, False))
        # llama.cpp's UGM ids where the file names none: unk 2, eos 1, no bos; and it
        # appends eos, adding no bos, unless the file says otherwise.
        unk = token_id(Keys.Tokenizer.UNK_ID, 2)
        if unk is None:
            raise TokenizerError(f"{source}: {Keys.Tokenizer.UNK_ID} names no token")
        scores = _gguf_array(metadata, Keys.Tokenizer.SCORES, n, source, 0.0)
        backend = unigram_backend(metadata, tokens, types, scores, unk, add_prefix, source)
        add_bos_default = False
        bos, eos = token_id(Keys.Tokenizer.BOS_ID), token_id(Keys.Tokenizer.EOS_ID, 1)
        add_eos = bool(metadata.get(Keys.Tokenizer.ADD_EOS, True))
    elif rwkv:
        # llama.cpp's RWKV defaults: no space prefix, no BOS or EOS added.
        add_prefix = False
        backend = RwkvBackend(tokens, token_id(Keys.Tokenizer.UNK_ID))
        add_bos_default = False
        bos, eos = token_id(Keys.Tokenizer.BOS_ID), token_id(Keys.Tokenizer.EOS_ID)
    elif plamo2:
        # llama.cpp's PLaMo 2 ids where the file names none (unk 0, bos 1, eos 2); its
        # tokenize adds no BOS or EOS, whatever the file says.
        add_prefix = False
        scores = _gguf_array(metadata, Keys.Tokenizer.SCORES, n, source, 0.0)
        backend = Plamo2Backend(tokens, types, scores)
        add_bos_default = False
        bos, eos = token_id(Keys.Tokenizer.BOS_ID, 1), token_id(Keys.Tokenizer.EOS_ID, 2)
        add_eos = False
    elif spm:
        add_prefix = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, True))
        backend = _spm_backend(metadata, tokens, vocab, n, source, add_prefix)
        add_bos_default = True
        bos, eos = token_id(Keys.Tokenizer.BOS_ID, 1), token_id(Keys.Tokenizer.EOS_ID, 2)
    else:
        add_prefix = False
        backend = _bpe_backend(metadata, vocab, n, pre, source)
        add_bos_default = pre.add_bos
        bos, eos = token_id(Keys.Tokenizer.BOS_ID), token_id(Keys.Tokenizer.EOS_ID)

    marks = _Marks.from_gguf(metadata, tokens, types, vocab, token_id, bos, eos)
    added = sorted(i for i in marks.special | marks.user if tokens[i] in vocab)
    # UGM's backend holds no control token's text (llmrun.unigram): the splitter finds them.
    if not ugm:
        backend.add_tokens(
            [AddedToken(tokens[i], special=i in marks.special, normalized=False) for i in added]
        )
    verbatim = marks.special | marks.user | marks.unused
    byte_level = pre is not None and pre.byte_level

    def spell(i: int) -> bytes:
        if i in verbatim:
            # llama.cpp prints nothing for unused tokens.
            return b"" if i in marks.unused else raw(tokens[i])
        if byte_level:
            return byte_level_bytes(tokens[i])
        if rwkv:
            return backend.spellings[i]
        if plamo2:  # a token's text as it is (no SentencePiece spaces), bytes as <0xHH>
            return spm_bytes(tokens[i], True) if types[i] == TokenType.BYTE else raw(tokens[i])
        return spm_bytes(tokens[i], types[i] == TokenType.BYTE)

    add_bos = not plamo2 and bool(metadata.get(Keys.Tokenizer.ADD_BOS, add_bos_default))
    add_bos |= pre is not None and pre.bos_always
    return dict(
        backend=backend,
        spell=spell,
        vocab_size=n,
        bos_id=bos,
        eos_id=eos,
        add_bos=add_bos,
        add_eos=add_eos,
        special_ids=marks.special,
        eog_ids=marks.eog,
        fim_ids=marks.fim,
        # WPM's word-initial pieces each begin with a space.
        strip_leading_space=((spm or ugm) and add_prefix) or wpm,
        # RWKV: special tokens cut the text where they parse, as llama.cpp cuts it, before
        # the trie (which holds them too) runs over each piece.
        split_special=_special_splitter(tokens, added, marks, vocab, always=ugm or rwkv or plamo2),
        token_ids=vocab if ugm else None,
        source=source,
    )


def fim_by_text(token_id: Callable[[str], int | None]) -> dict[str, int]:
    """The fill-in-the-middle tokens found by their text (llama.cpp's list), by FIM_NAMES'
    names, for a vocabulary whose `token_id(text)` gives a token's id or None."""
    found = {}
    for key, texts in _FIM_TEXTS.items():
        fim = next((i for i in map(token_id, texts) if i is not None), None)
        if fim is not None:
            found[FIM_NAMES[key]] = fim
    return found


def _gguf_array(metadata: dict[str, Any], key: str, n: int, source: str, default: Any) -> list:
    values = metadata.get(key)
    if values is None:
        return [default] * n
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise TokenizerError(f"{source}: {key} has {got} entries, but there are {n} tokens")
    return values


def _gguf_vocab(tokens: list[str]) -> dict[str, int]:
    """Token text -> id, the later id winning as in llama.cpp, without tokens no text can match
    (empty ones, and ones that are not valid UTF-8, which `tokenizers` cannot hold)."""
    vocab = dict(zip(tokens, range(len(tokens)), strict=False))
    vocab.pop("", None)
    try:
        "".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        for t in [t for t in vocab if not _is_utf8(t)]:
            del vocab[t]
    return vocab


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _spm_backend(
    metadata: dict[str, Any],
    tokens: list[str],
    vocab: dict[str, int],
    n: int,
    source: str,
    add_prefix: bool,
) -> Backend | MergingBackend:
    scores = _gguf_array(metadata, Keys.Tokenizer.SCORES, n, source, 0.0)
    unk = metadata.get(Keys.Tokenizer.UNK_ID, 0)
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < n else None
    unk_token = unk_token if unk_token in vocab else None

    def library() -> Backend:
        bpe = BPE(vocab, spm_merges(vocab, scores), unk_token=unk_token, byte_fallback=True)
        backend = Backend(bpe)
        escape = normalizers.Replace(" ", SPM_SPACE)
        # llama.cpp adds the space prefix to every run of text, also after a special token.
        backend.normalizer = (
            normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape]) if add_prefix else escape
        )
        return backend

    unk_id = None if unk_token is None else vocab[unk_token]
    merging = gguf_bpe.spm_backend(
        vocab, n, scores, unk=unk_id, add_prefix=add_prefix, batch_backend=library
    )
    return merging or library()


def _bpe_backend(
    metadata: dict[str, Any], vocab: dict[str, int], n: int, pre: PreTokenizer, source: str
) -> Backend | MergingBackend:
    merges = metadata.get(Keys.Tokenizer.MERGES)
    if not isinstance(merges, list):
        raise TokenizerError(f"{source}: no {Keys.Tokenizer.MERGES} in the metadata")
    normalizer = None
    if pre.escape_spaces:
        normalizer = normalizers.Replace(" ", SPM_SPACE)
    if pre.lowercase:
        normalizer = normalizers.Lowercase()

    def library() -> Backend:
        try:
            bpe = BPE(
                vocab,
                _split_merges(merges),
                ignore_merges=pre.ignore_merges,
                # Without GPT-2's byte alphabet, a character outside the vocabulary is spelled
                # with <0xXX> byte tokens.
                byte_fallback=not pre.byte_level,
            )
        except Exception as e:
            raise TokenizerError(
                f"{source}: {Keys.Tokenizer.MERGES} does not fit {Keys.Tokenizer.LIST}: {e}"
            ) from None
        backend = Backend(bpe)
        backend.normalizer = normalizer
        byte_level = pre.byte_level
        absent = "".join(c for c in BYTE_LEVEL_ALPHABET if c not in vocab) if byte_level else ""
        backend.pre_tokenizer = pre_tokenizer(pre, absent)
        return backend

    merging = gguf_bpe.bpe_backend(
        vocab,
        n,
        merges,
        normalizer=normalizer,
        # A character of the byte alphabet without a token stays in its word, where no merge
        # takes it, as in llama.cpp (the library's BPE needs the word cut there instead).
        pre_tokenizer=pre_tokenizer(pre),
        ignore_merges=pre.ignore_merges,
        newline_words=pre.newline_words,
        byte_level=pre.byte_level,
        source=source,
        batch_backend=library,
    )
    return merging or library()


@dataclass
class _Marks:
    """Token ids by the part llama.cpp gives them beyond plain text."""

    special: set[int]  # control and unknown: parsed only when asked, skipped in decode
    user: set[int]  # user-defined: always matched, always printed
    unused: set[int]  # printed as nothing
    eog: set[int]  # end generation
    lstrip: set[int]  # swallow the whitespace before them
    rstrip: set[int]  # and after them
    fim: dict[str, int]  # the fill-in-the-middle tokens, by FIM_NAMES' names

    @classmethod
    def from_gguf(
        cls,
        metadata: dict[str, Any],
        tokens: list[str],
        types: list[int],
        vocab: dict[str, int],
        token_id: Callable[[str], int | None],
        bos: int | None,
        eos: int | None,
    ) -> _Marks:
        """As llama_vocab::impl::load marks them: the file's token types, then its fixes."""
        kinds: dict[int, set[int]] = {int(t): set() for t in TokenType}
        normal = int(TokenType.NORMAL)
        marked = map(operator.ne, types, itertools.repeat(normal))
        for i in itertools.compress(range(len(types)), marked):
            if types[i] in kinds:
                kinds[types[i]].add(i)
        control = kinds[TokenType.CONTROL] | kinds[TokenType.UNKNOWN]
        user = kinds[TokenType.USER_DEFINED]
        eog = {i for i in (eos, token_id(Keys.Tokenizer.EOT_ID), token_id(Keys.Tokenizer.EOM_ID))}
        fim_ids, by_text = {}, fim_by_text(vocab.get)
        for key, name in FIM_NAMES.items():
            fim = token_id(key)
            if fim is None and key in _FIM_OLD_KEYS:
                fim = token_id(_FIM_OLD_KEYS[key])
            if fim is None:
                fim = by_text.get(name)
                control |= {fim} if fim is not None else set()
            if fim is not None:
                fim_ids[name] = fim
            if key in _FIM_ENDS:
                eog.add(fim)
        ends = {vocab[t] for t in END_OF_GENERATION if t in vocab}
        control |= ends
        eog |= ends
        eog.discard(None)
        shown = {vocab[t] for t in _ALWAYS_SHOWN if t in vocab}
        control -= shown
        user |= shown
        text = {i: tokens[i] for i in eog}
        # gpt-oss (and Solar Open): <|end|> ends a message, not the generation.
        if "<|end|>" in text.values() and (
            {"<|return|>", "<|call|>"} <= set(text.values())
            or {"<|calls|>", "<|flush|>"} <= set(text.values())
        ):
            end = next(i for i, t in text.items() if t == "<|end|>")
            eog.discard(end)
            control.discard(end)
            user.add(end)
        # Gemma 4 (and PLaMo 2): </s> is a plain token.
        if "</s>" in text.values() and {"<|tool_response>", "<|plamo:eos|>"} & set(text.values()):
            plain = next(i for i, t in text.items() if t == "</s>")
            eog.discard(plain)
            control.discard(plain)
            user.discard(plain)
        user -= control
        lstrip, rstrip = _stripped(metadata, vocab, control | user)
        unused = kinds[TokenType.UNUSED] - control - user
        return cls(control, user, unused, eog, lstrip, rstrip, fim_ids)


def _stripped(
    metadata: dict[str, Any], vocab: dict[str, int], ids: set[int]
) -> tuple[set[int], set[int]]:
    """Special tokens that swallow the whitespace before or after them: llama.cpp sets this by
    model, recognised by pre-tokenizer, architecture or general.name, as their tokenizer.json
    files do."""
    pre = str(metadata.get(Keys.Tokenizer.PRE, ""))
    arch = str(metadata.get(Keys.General.ARCHITECTURE, ""))
    name = str(metadata.get(Keys.General.NAME, "")).lower()

    def ids_of(*texts: str) -> set[int]:
        return {vocab[t] for t in texts if t in vocab and vocab[t] in ids}

    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        return ids_of("<mask>"), set()
    if "phi-3" in name or "phi3" in name:
        return set(), ids - ids_of("<unk>", "<s>", "<|endoftext|>")
    if "modern-bert" in name:
        return ids_of("[MASK]"), set()
    return set(), set()


# What C's isspace() calls space: the whitespace llama.cpp's lstrip and rstrip take.
_C_SPACE = " \t\n\v\f\r"


def _special_splitter(
    tokens: list[str],
    added: list[int],
    marks: _Marks,
    vocab: dict[str, int],
    always: bool = False,
) -> Callable[[str, bool], list[str | int]] | None:
    """(text, parse_special) -> the text cut into plain text and special-token ids as
    llama.cpp cuts it (tokenizer_st_partition), for a vocabulary where the tokenizers
    library's own matching of added tokens would cut it otherwise, or `always`; else None.

    llama.cpp takes the longest special token first, wherever it is in the text, and each
    one's lstrip/rstrip swallows ASCII whitespace (what C's isspace() takes). The library
    takes the leftmost longest token, and strips Unicode's whitespace. The two agree unless
    a token strips, or one token can end with the start of another."""
    texts = {i: tokens[i] for i in added}
    strips = marks.lstrip | marks.rstrip
    if not always and not strips & set(texts) and not _overlapping(list(texts.values())):
        return None
    # Longest first; among equal lengths (llama.cpp's std::sort leaves their order open)
    # by id. A text held by two ids is the later one's, as in the vocabulary.
    order = sorted(texts, key=lambda i: (-len(texts[i]), i))
    rules = [(texts[i], vocab[texts[i]], i in marks.lstrip, i in marks.rstrip) for i in order]
    # Control tokens are matched only where special tokens parse; user-defined ones always.
    matched = {
        True: rules,
        False: [r for r, i in zip(rules, order, strict=True) if i not in marks.special],
    }

    def split(text: str, parse_special: bool) -> list[str | int]:
        parts: list[str | int] = [text]
        for token, token_id, lstrip, rstrip in matched[parse_special]:
            if not any(isinstance(p, str) and token in p for p in parts):
                continue
            cut: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or token not in part:
                    cut.append(part)
                    continue
                *before, last = part.split(token)
                for n, piece in enumerate(before):
                    piece = piece.lstrip(_C_SPACE) if n and rstrip else piece
                    piece = piece.rstrip(_C_SPACE) if lstrip else piece
                    cut += [piece, token_id] if piece else [token_id]
                last = last.lstrip(_C_SPACE) if rstrip else last
                cut += [last] if last else []
            parts = cut
        return parts

    return split


def _overlapping(texts: list[str]) -> bool:
    """Whether one text can end with the start of another (">>TITLE<<", "<|endoftext|>"),
    where matching the longest first and matching the leftmost differ. Runs of one
    character ("   ", "  ") do not count: both ways cut a run alike."""
    starts: dict[str, list[str]] = {}
    for text in texts:
        for k in range(1, len(text)):
            starts.setdefault(text[:k], []).append(text)
    return any(
        other != text and len(set(text + other)) > 1
        for text in texts
        for k in range(1, len(text))
        for other in starts.get(text[k:], ())
    )


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """Cut each merge "a b" at the first space after its first character, as llama.cpp does; a
    merge without one can never apply there, and is left out. A merge the list repeats keeps
    its first rank, as in llama.cpp (the tokenizers library would give it its last)."""
    # One text is one pair, so the texts show repeats; a set of them costs far less than the
    # BPE built from them, and a list without repeats (the usual case) stays as it is.
    if len(set(merges)) < len(merges):
        merges = list(dict.fromkeys(merges))
    # Byte-level tokens hold no spaces, so splitting the joined list at once is the fast path.
    parts = " ".join(merges).split(" ")
    if (
        len(parts) == 2 * len(merges)
        and "" not in parts
        and all(map(str.__contains__, merges, itertools.repeat(" ")))
    ):
        pairs = iter(parts)  # every merge has one space
        return list(zip(pairs, pairs, strict=False))
    cuts = ((m, m.find(" ", 1)) for m in merges)
    return [(m[:cut], m[cut + 1 :]) for m, cut in cuts if cut > 0]

"""Reranking: a query and documents -> each (query, document) pair's relevance score from a
cross-encoder, the documents sorted by it.

A pair is one sequence. From an HF folder it is what transformers' tokenizer makes of
`tokenizer(query, document)`: the tokenizer.json post-processor's pair template (BERT's
[CLS] q [SEP] d [SEP] with token types 0 then 1, XLM-RoBERTa's <s> q </s></s> d </s>).
From a GGUF it is what llama.cpp's server builds (format_prompt_rerank): BOS where the
vocabulary adds it, the query, EOS where it adds EOS, SEP where it adds SEP, the document,
EOS where it adds EOS (EOS falling back to SEP); its types follow BERT's (llama.cpp passes
type 0 everywhere, which moves a BERT cross-encoder's score). A model whose token-type
table has one row gets type 0 everywhere.

The score is the classifier's raw logit, as llama.cpp's /rerank returns it; `sigmoid`
maps it to (0, 1), as sentence-transformers' CrossEncoder and vLLM do for one label.

A causal reranker (Qwen3-Reranker, as llama.cpp converts it) scores a prompt instead: its
GGUF's rerank template around the query and the document, the probability of "yes"
against "no" at the last token, as llama.cpp computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gguf import Keys
from torch import nn

from llmrun.errors import ContextOverflowError, UnsupportedError, UsageError
from llmrun.models.base import final_hidden_states
from llmrun.quant.blocks import dequantize
from llmrun.tokenizer import Tokenizer
from llmrun.tokenizer_gguf import WPM_DEFAULTS, WPM_MODEL

DEFAULT_BATCH_SIZE = 32  # pairs per forward
# llama.cpp's vocabularies that add SEP between a pair unless the file says (llama-vocab.cpp):
# WordPiece ones, and byte-level BPE ones of these pre-tokenizers.
_SEP_PRE_TOKENIZERS = ("jina-v1-en", "jina-v2-code", "roberta-bpe")
_EOS_MODELS = ("t5",)  # Unigram: EOS after a text, no BOS


@dataclass
class Pair:
    """One (query, document) sequence: token ids and their token types."""

    ids: list[int]
    types: list[int]


@dataclass
class Ranked:
    """A document's place: its index in the request and its score."""

    index: int
    score: float


@dataclass
class Reranked:
    """Every document's score (by index) and each pair's token count."""

    scores: list[float]
    tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)

    def ranked(self, top_n: int | None = None) -> list[Ranked]:
        """The documents by score, highest first (ties in their order), the first `top_n`."""
        order = sorted(range(len(self.scores)), key=lambda i: -self.scores[i])
        return [Ranked(i, self.scores[i]) for i in order[:top_n]]


def encode_pairs(
    tokenizer: Tokenizer,
    gguf_metadata: dict[str, Any] | None,
    query: str,
    documents: Sequence[str],
    limit: int,
    truncate: bool = False,
    token_types: bool = True,
) -> list[Pair]:
    """Each document's pair with `query` (the module's docstring: a GGUF's way where
    `gguf_metadata` is given, else the tokenizer.json's), at most `limit` tokens: a longer
    pair is an error, or with `truncate` has its document cut to fit. Without
    `token_types`, every type is 0."""
    if gguf_metadata is None:
        pieces = _hf_pieces(tokenizer, query, documents)
    else:
        pieces = _gguf_pieces(tokenizer, gguf_metadata, query, documents)
    pairs = []
    for i, (before, document, after, second) in enumerate(pieces):
        room = limit - len(before) - len(after)
        if len(document) > room:
            if not truncate or room < 0:
                raise ContextOverflowError(
                    f"document {i}: its pair with the query is "
                    f"{len(before) + len(document) + len(after)} tokens long, more than the "
                    f"context of {limit} tokens: shorten it, raise --ctx-size up to the "
                    "model's length" + (", or cut it with --truncate" if room >= 0 else "")
                )
            document = document[:room]
        ids = before + document + after
        if not ids:
            raise UsageError(f"document {i}: its pair with the query has no tokens to score")
        types = [0] * len(ids)
        if token_types:
            types[second:] = [1] * (len(ids) - second)
        pairs.append(Pair(ids, types))
    return pairs


def _hf_pieces(
    tokenizer: Tokenizer, query: str, documents: Sequence[str]
) -> list[tuple[list[int], list[int], list[int], int]]:
    """(ids before the document, the document's, ids after it, where type 1 begins) of
    each pair, by the tokenizer.json's post-processor as transformers applies it."""
    parts = tokenizer.pair_parts(query, documents)
    if parts is None:
        raise UnsupportedError(
            f"{tokenizer.source}: no tokenizer.json post-processor to join a query and a "
            "document (llmrun reranks with tokenizer.json or GGUF vocabularies)"
        )
    return parts


def _gguf_pieces(
    tokenizer: Tokenizer, metadata: dict[str, Any], query: str, documents: Sequence[str]
) -> list[tuple[list[int], list[int], list[int], int]]:
    """The pieces of each pair (as _hf_pieces) as llama.cpp's server joins them, with the
    vocabulary's flags and special tokens as llama.cpp reads them (llama-vocab.cpp)."""
    model = metadata.get(Keys.Tokenizer.MODEL)

    def token(key: str, default: int | None = None) -> int | None:
        value = metadata.get(key, default)
        return value if isinstance(value, int) and 0 <= value < tokenizer.vocab_size else None

    wpm = model == WPM_MODEL
    add_sep = wpm or (model == "gpt2" and metadata.get(Keys.Tokenizer.PRE) in _SEP_PRE_TOKENIZERS)
    add_sep = bool(metadata.get(Keys.Tokenizer.ADD_SEP, add_sep))
    add_eos = bool(metadata.get(Keys.Tokenizer.ADD_EOS, model in _EOS_MODELS))
    sep = token(Keys.Tokenizer.SEP_ID, WPM_DEFAULTS[Keys.Tokenizer.SEP_ID] if wpm else None)
    eos = token(Keys.Tokenizer.EOS_ID)
    eos = sep if eos is None else eos
    before = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    before += tokenizer.encode(query, add_bos=False, parse_special=False)
    before += [eos] if add_eos and eos is not None else []
    before += [sep] if add_sep and sep is not None else []
    after = [eos] if add_eos and eos is not None else []
    return [
        (before, tokenizer.encode(d, add_bos=False, parse_special=False), after, len(before))
        for d in documents
    ]


@torch.inference_mode()
def score_pairs(
    model: nn.Module,
    pairs: Sequence[Pair],
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: torch.device | str = "cpu",
) -> list[float]:
    """Each pair's score (its classifier's logit): forwards of up to `batch_size` pairs,
    similar lengths together and padded on the right (a pair scores the same alone or in a
    batch: padding never reaches its real tokens)."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].ids))
    scores = [0.0] * len(pairs)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        lengths = torch.tensor([len(pairs[i].ids) for i in chosen], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(chosen), width, dtype=torch.long, device=device)
        types = torch.zeros_like(ids)
        for row, i in enumerate(chosen):
            ids[row, : len(pairs[i].ids)] = torch.tensor(pairs[i].ids, device=device)
            types[row, : len(pairs[i].types)] = torch.tensor(pairs[i].types, device=device)
        positions = torch.arange(width, device=device).expand(len(chosen), width)
        logits = model.score(ids, positions, lengths, types)[:, 0].cpu().tolist()
        for row, i in enumerate(chosen):
            scores[i] = logits[row]
    return scores


def encode_prompts(
    tokenizer: Tokenizer, template: str, query: str, documents: Sequence[str], limit: int
) -> list[list[int]]:
    """A causal reranker's prompt of each document, as llama.cpp's server makes it: the
    rerank template with {query}, then {document}, replaced, special tokens parsed, nothing
    added; one longer than `limit` tokens is an error."""
    prompts = []
    for i, document in enumerate(documents):
        text = template.replace("{query}", query).replace("{document}", document)
        ids = tokenizer.encode(text, add_bos=False)
        if len(ids) > limit:
            raise ContextOverflowError(
                f"document {i}: its prompt is {len(ids)} tokens long, more than the context of "
                f"{limit} tokens: shorten it or raise --ctx-size up to the model's length"
            )
        prompts.append(ids)
    return prompts


@torch.inference_mode()
def score_prompts(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    head: Any,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: torch.device | str = "cpu",
) -> list[float]:
    """A causal reranker's score of each prompt: its "yes" and "no" logits at the last
    token (`head`: a loader Weight of those two rows of the output head), softmaxed,
    "yes"'s share (llama.cpp's rank pooling for Qwen3). Forwards of up to `batch_size`
    prompts, padded on the right (causal attention keeps padding out)."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    rows = head.tensor
    if head.ggml_type is not None:
        rows = dequantize(rows, head.ggml_type)
    rows = rows.to(device=device, dtype=torch.float32)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    scores = [0.0] * len(prompts)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        lengths = torch.tensor([len(prompts[i]) for i in chosen], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(chosen), width, dtype=torch.long, device=device)
        for row, i in enumerate(chosen):
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i], device=device)
        positions = torch.arange(width, device=device).expand(len(chosen), width)
        hidden = final_hidden_states(model, ids, positions, lengths)
        last = hidden[torch.arange(len(chosen), device=device), lengths - 1]
        yes = torch.softmax(last @ rows.T, dim=-1)[:, 0].cpu().tolist()
        for row, i in enumerate(chosen):
            scores[i] = yes[row]
    return scores


def sigmoid(scores: Sequence[float]) -> list[float]:
    """Scores mapped to (0, 1) by the logistic function."""
    return torch.sigmoid(torch.tensor(scores, dtype=torch.float64)).tolist()

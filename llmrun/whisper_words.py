"""Whisper's word timestamps, as transformers times and groups words: each generated token's
time from the cross-attention weights of generation_config.json's alignment_heads (over the
window's audio, normalized per frame across the tokens, median-filtered along time, averaged
over the heads) by dynamic time warping, each token then spanning from the previous token's
time to its own; and the tokens grouped into words (at spaces, or at whole characters for the
languages written without them), with punctuation joined to its word.

Reference: transformers/models/whisper/generation_whisper.py (_extract_token_timestamps,
_median_filter, _dynamic_time_warping), tokenization_whisper.py (_decode_asr's word times,
_collate_word_timestamps, _combine_tokens_into_words, _split_tokens_on_unicode,
_split_tokens_on_spaces, _merge_punctuations); openai-whisper's whisper/timing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmrun.tokenizer import Tokenizer

# Seconds per encoder position (a timestamp step).
POSITION_SECONDS = 0.02
# The languages whose words are split at whole characters, not spaces.
UNSPACED = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
PREPENDED = "\"'“¡¿([{-"
APPENDED = "\"'.。,，!！?？:：”)]}、"
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


@dataclass(frozen=True)
class Word:
    """A word of a transcript (its leading space kept) and its times in seconds."""

    word: str
    start: float
    end: float


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """A median filter of odd `width` along x's last dimension, its edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = F.pad(x, (pad, pad, 0, 0), mode="reflect")
    return padded.unfold(-1, width, 1).sort()[0][..., pad]


def dynamic_time_warping(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `matrix` [tokens, positions] from its first cell
    to its last, as (token indices, position indices) along it; ties go to the step along
    time, then down the tokens (transformers' order). The costs are summed in float32 as
    transformers sums them, an anti-diagonal at a time."""
    rows, cols = matrix.shape
    cost = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    trace = np.full((rows + 1, cols + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    for diagonal in range(2, rows + cols + 1):
        i = np.arange(max(1, diagonal - cols), min(rows, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cheapest = np.choose(step, [c0, c1, c2])
        cost[i, j] = matrix[i - 1, j - 1] + cheapest
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j = rows, cols
    tokens, positions = [], []
    while i > 0 or j > 0:
        tokens.append(i - 1)
        positions.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(tokens[::-1]), np.array(positions[::-1])


def token_times(weights: torch.Tensor, frames: int, median_width: int) -> np.ndarray:
    """The times (float32 seconds from the window's start) of a window's generated tokens,
    end-of-text's included, from the alignment heads' cross-attention weights [heads, tokens
    - 1, 1500] of each generated token but the last (the last takes the time of the one
    before it), over the window's `frames` mel frames of audio."""
    weights = weights[..., : frames // 2].float()
    count = weights.shape[1] + 1
    if weights.shape[1] == 0:
        return np.zeros(count, dtype=np.float32)
    if weights.shape[-1]:
        std = torch.std(weights, dim=-2, keepdim=True, unbiased=False)
        mean = torch.mean(weights, dim=-2, keepdim=True)
        weights = median_filter((weights - mean) / std, median_width)
    # (No frames: a window past the audio's end; the path runs along none.)
    matrix = weights.mean(dim=0)
    text, time = dynamic_time_warping(-matrix.double().numpy())
    jumps = np.pad(np.diff(text), (1, 0), constant_values=1).astype(bool)
    times = (time[jumps] * POSITION_SECONDS).astype(np.float32)
    return np.append(times, times[-1])


def words(
    tokenizer: Tokenizer, tokens: list[int], spans: list[tuple[float, float]], language: str | None
) -> list[Word]:
    """The words of a segment's text `tokens`, each token spanning its `spans` (start, end)
    seconds; `language`: the transcript's code (None: English)."""
    if language in UNSPACED:
        groups = _split_on_unicode(tokenizer, tokens)
    else:
        groups = _split_on_spaces(tokenizer, tokens)
    _merge_punctuation(groups)
    return [
        Word(word, spans[indices[0]][0], spans[indices[-1]][1]) for word, indices in groups if word
    ]


def _split_on_unicode(tokenizer: Tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """The tokens cut wherever what is decoded so far ends on a whole character."""
    whole = tokenizer.decode(tokens)
    groups: list[tuple[str, list[int]]] = []
    current: list[int] = []
    offset = 0
    for index in range(len(tokens)):
        current.append(index)
        text = tokenizer.decode([tokens[i] for i in current])
        broken = text.find("\ufffd")
        if broken < 0 or offset + broken >= len(whole) or whole[offset + broken] == "\ufffd":
            groups.append((text, current))
            current = []
            offset += len(text)
    return groups


def _split_on_spaces(tokenizer: Tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """The whole-character pieces joined into words: a new word at a leading space or a
    punctuation mark."""
    groups: list[tuple[str, list[int]]] = []
    for text, indices in _split_on_unicode(tokenizer, tokens):
        # `in` a string: a blank piece counts as punctuation too, as in transformers.
        if text.startswith(" ") or text.strip() in PUNCTUATION or not groups:
            groups.append((text, indices))
        else:
            last, before = groups[-1]
            groups[-1] = (last + text, before + indices)
    return groups


def _merge_punctuation(groups: list[tuple[str, list[int]]]) -> None:
    """Opening punctuation joined to the word after it, closing punctuation to the word
    before it; the emptied groups left as ("", [])."""
    after = len(groups) - 1
    for i in range(len(groups) - 2, -1, -1):
        text, indices = groups[i]
        if text.startswith(" ") and text.strip() in PREPENDED:
            groups[after] = (text + groups[after][0], indices + groups[after][1])
            groups[i] = ("", [])
        else:
            after = i
    before = 0
    for j in range(1, len(groups)):
        text, indices = groups[j]
        if not groups[before][0].endswith(" ") and text in APPENDED:
            groups[before] = (groups[before][0] + text, groups[before][1] + indices)
            groups[j] = ("", [])
        else:
            before = j

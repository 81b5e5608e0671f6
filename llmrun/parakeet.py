"""Parakeet's speech recognition (llmrun.models.parakeet), as transformers' ParakeetProcessor
prepares a clip and ParakeetForCTC / ParakeetForRNNT / ParakeetForTDT.generate decode it: the
clip's features as ParakeetFeatureExtractor computes them (llmrun.canary.features), encoded
whole (the processor does not split a long clip), then greedily:

- CTC: each position's argmax; the text with repeats collapsed and the blank (the pad
  token) dropped, as batch_decode(skip_special_tokens=True) groups tokens.
- RNN-T and TDT: from the decoder start token (generation_config.json's, else the blank),
  each step runs the prediction network on the last token (reusing its output after a
  blank) and the joint on the current encoder position; the token is the argmax of the
  joint's vocabulary logits. RNN-T moves to the next position after a blank, or after
  max_symbols_per_step tokens at one position; TDT moves by the argmax of its duration
  logits (at least 1 after a blank). Decoding ends past the clip's last position, or at
  max_symbols_per_step times the positions in steps (generate's max_length). The text is
  the tokens but the blank and the pad token, decoded without special tokens.

transformers' generate takes a TDT token's argmax over the whole joint row, durations
included (a duration's column is no token id): a folder's generation_config.json then
suppresses the durations' columns, which llmrun never picks. Parakeet predicts no language
and takes no prompt.

A transducer's token times are ParakeetProcessor.decode's (with generate's durations): a
token starts at the encoder position it was emitted at (the steps' moves summed) and lasts
its duration (TDT) or one position (RNN-T), a position being the feature hop times the
encoder's subsampling (0.08 s); a TDT punctuation mark starts and ends where the token
before it ends. Words and segments as NeMo's timestamp_utils makes them: a word starts at a
token spelled with SentencePiece's "▁" (a leading space) unless it is a punctuation mark,
which joins the word before it; it spans its first token's start to its last token's end. A
segment ends at a word ending in ".", "?" or "!" (NeMo's segment separators), the rest
being the last one. CTC's times are not given (transformers gives none).

Reference: transformers/models/parakeet/generation_parakeet.py (ParakeetRNNTGenerationMixin,
ParakeetTDTGenerationMixin), modeling_parakeet.py (ParakeetForCTC.generate,
ParakeetRNNTDecoder), processing_parakeet.py (decode, _refine_timestamps),
tokenization_parakeet.py (_decode); NeMo's nemo/collections/asr/parts/utils/timestamp_utils.py
(get_words_offsets, get_segment_offsets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmrun import audio, canary, nemotron_omni_clips, seq2seq, wav2vec2, whisper
from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading.safetensors_io import read_json
from llmrun.models.parakeet import TDT
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Segment, Transcription
from llmrun.whisper_words import Word

FAMILY = "Parakeet"
# The marks NeMo's (and ParakeetProcessor's) timestamps treat as punctuation.
PUNCTUATION = frozenset(["?", "'", "¡", "¿", "-", ":", ",", "%", "/", ".", "!"])
SENTENCE_ENDS = ".?!"  # NeMo's default segment separators


def ctc_ids(model: Any, encoded: torch.Tensor, valid: int) -> list[int]:
    """The CTC head's argmax at each of the first `valid` positions of an encoding."""
    return model.ctc_logits(encoded[:valid]).argmax(-1).tolist()


def transducer_steps(
    model: Any, encoded: torch.Tensor, valid: int, start: int
) -> tuple[list[int], list[int], list[float]]:
    """Greedy RNN-T or TDT decoding of an encoding whose first `valid` positions are the
    clip's: every step's token (blanks included), the positions it moved by after it (TDT's
    duration, generate's `durations`) and the token's log-probability among the vocabulary's."""
    args = model.args
    blank, vocab = args.blank_token_id, args.vocab_size
    projected = model.project(encoded)
    # generate's max_length, counting the start token: positions of the whole encoding
    most = args.max_symbols_per_step * encoded.shape[0] - 1
    tokens: list[int] = []
    moves: list[int] = []
    logprobs: list[float] = []
    predicted, state = model.predict(start, None)
    position = symbols = 0
    while len(tokens) < most:
        logits = model.joint(projected[position], predicted)
        token = int(logits[:vocab].argmax())
        logprobs.append(float(logits[:vocab].float().log_softmax(-1)[token]))
        if args.model_type == TDT:
            move = int(logits[vocab:].argmax())
            move = max(move, 1) if token == blank else move
        else:
            symbols = 0 if token == blank else symbols + 1
            move = int(token == blank or symbols >= args.max_symbols_per_step)
            symbols = 0 if move else symbols
        tokens.append(token)
        moves.append(move)
        position += move
        if position >= valid:
            break
        if token != blank:
            predicted, state = model.predict(token, state)
    return tokens, moves, logprobs


def position_seconds(model: Any) -> float:
    """An encoder position's seconds: the feature hop times the encoder's subsampling,
    computed as ParakeetProcessor.decode computes its frame_rate."""
    return nemotron_omni_clips.HOP / audio.SAMPLE_RATE * model.args.encoder.subsampling_factor


def token_spans(
    tokenizer: Tokenizer,
    steps: list[int],
    moves: list[int],
    dropped: set[int | None],
    tdt: bool,
    seconds: float,
) -> list[tuple[float, float]]:
    """The (start, end) seconds of each of the transducer's `steps` tokens not `dropped`,
    each step having moved `moves` positions of `seconds` each: a TDT token lasts its
    duration (its punctuation marks none, from where the token before ends), an RNN-T
    token one position."""
    spans: list[tuple[float, float]] = []
    position = 0
    for token, move in zip(steps, moves, strict=True):
        if token not in dropped:
            start, end = position * seconds, (position + (move if tdt else 1)) * seconds
            if tdt and spans and _text(tokenizer, [token]) in PUNCTUATION:
                start = end = spans[-1][1]
            spans.append((start, end))
        position += move
    return spans


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The ids' text, each token's leading space ("▁") kept, special tokens dropped."""
    pieces = (tokenizer.token_bytes(i) for i in ids if i not in tokenizer.special_ids)
    return b"".join(pieces).decode("utf-8", "replace")


def word_groups(tokenizer: Tokenizer, ids: list[int]) -> list[list[int]]:
    """The indices of a transcript's `ids` grouped into words: a word starts at a token with
    a leading space (SentencePiece's "▁") that is no punctuation mark, unless the word before
    is a lone space so far (a "▁" piece of its own, which starts the word after it); words of
    spaces alone are left out."""
    groups: list[list[int]] = []
    for index, token in enumerate(ids):
        text = _text(tokenizer, [token])
        starts = text.startswith(" ") and text.strip() not in PUNCTUATION
        if not groups or (starts and _text(tokenizer, [ids[i] for i in groups[-1]]).strip()):
            groups.append([index])
        else:
            groups[-1].append(index)
    return [g for g in groups if _text(tokenizer, [ids[i] for i in g]).strip()]


def timed_words(
    tokenizer: Tokenizer, ids: list[int], spans: list[tuple[float, float]]
) -> tuple[Word, ...]:
    """The words of a transcript's `ids`, each id spanning its `spans` (start, end) seconds:
    a word from its first token's start to its last token's end, its leading space kept."""
    return tuple(
        Word(
            _text(tokenizer, [ids[i] for i in group]),
            round(spans[group[0]][0], 3),  # to the millisecond: 0.08 s multiples
            round(spans[group[-1]][1], 3),
        )
        for group in word_groups(tokenizer, ids)
    )


def timed_segments(
    tokenizer: Tokenizer,
    ids: list[int],
    spans: list[tuple[float, float]],
    logprobs: list[float],
) -> tuple[Segment, ...]:
    """A transcript's segments: its words (of `ids`, spanning `spans`, with log-probabilities
    `logprobs`) cut after each word that ends in a sentence's end, as OpenAI's
    verbose_json holds them (avg_logprob: the mean of their tokens'; no no_speech_prob)."""
    cut: list[list[int]] = [[]]
    for group in word_groups(tokenizer, ids):
        cut[-1] += group
        if _text(tokenizer, [ids[i] for i in group]).endswith(tuple(SENTENCE_ENDS)):
            cut.append([])
    made = []
    for indices in (c for c in cut if c):
        tokens = [ids[i] for i in indices]
        text = _text(tokenizer, tokens)
        made.append(
            Segment(
                id=len(made),
                seek=0,
                start=spans[indices[0]][0],
                end=spans[indices[-1]][1],
                text=text,
                tokens=tokens,
                temperature=0.0,
                avg_logprob=sum(logprobs[i] for i in indices) / len(indices),
                compression_ratio=whisper.compression_ratio(text),
                no_speech_prob=None,
            )
        )
    return tuple(made)


def check_folder(model: Any, folder: Path, generation: dict[str, Any]) -> tuple[int, int]:
    """The features' mel bins (checked against the encoder's) and the transducer's start
    token."""
    mel_bins = canary.feature_size(folder)
    if mel_bins != model.args.encoder.num_mel_bins:
        raise ModelFormatError(
            f"{folder}: the feature extractor's feature_size {mel_bins}, and the encoder "
            f"takes {model.args.encoder.num_mel_bins} mel bins"
        )
    start = generation.get("decoder_start_token_id", model.args.blank_token_id)
    if not isinstance(start, int) or not 0 <= start < model.args.vocab_size:
        raise ModelFormatError(f"{folder}: decoder_start_token_id {start!r}")
    return mel_bins, start


def pad_id(folder: Path, tokenizer: Tokenizer) -> int | None:
    """The id of tokenizer_config.json's pad_token, which ParakeetTokenizer drops."""
    file = folder / "tokenizer_config.json"
    pad = read_json(file).get("pad_token") if file.is_file() else None
    pad = pad.get("content") if isinstance(pad, dict) else pad
    return tokenizer.token_id(pad) if isinstance(pad, str) else None


def transcribe(
    model: Any,
    tokenizer: Tokenizer,
    folder: Path,
    generation: dict[str, Any],
    config: dict[str, Any],
    clip: audio.Clip,
    language: str | None = None,
    task: str | None = None,
    prompt: str | None = None,
    timestamps: bool = False,
    words: bool = False,
) -> Transcription:
    """A clip's transcript by a Parakeet `model` loaded from `folder`; a transducer's with
    its segments (`timestamps`) and its words' times (`words`) where asked for."""
    if language is not None:
        raise UsageError(f"{FAMILY} takes no language (it transcribes the language it hears)")
    seq2seq.only_transcribes(task, prompt, FAMILY)
    mel_bins, start = check_folder(model, folder, generation)
    args = model.args
    weight = model.encoder.subsampling.linear.weight
    with torch.inference_mode():
        x = canary.features(clip.samples, mel_bins)
        valid = args.encoder.tokens(x.shape[0] - 1)
        encoded = model.encode(x.to(weight.device, weight.dtype), x.shape[0] - 1)
        if args.transducer:
            steps, moves, logprobs = transducer_steps(model, encoded, valid, start)
        else:
            steps = wav2vec2.ctc_collapse(ctc_ids(model, encoded, valid))
    dropped = {args.blank_token_id, pad_id(folder, tokenizer)}
    ids = [token for token in steps if token not in dropped]
    text = tokenizer.decode(ids, skip_special=True)
    if not args.transducer or not (timestamps or words):
        return Transcription(text, ids, None, 0)
    spans = token_spans(
        tokenizer, steps, moves, dropped, args.model_type == TDT, position_seconds(model)
    )
    kept = [p for token, p in zip(steps, logprobs, strict=True) if token not in dropped]
    return Transcription(
        text,
        ids,
        None,
        0,
        timed_segments(tokenizer, ids, spans, kept) if timestamps else None,
        timed_words(tokenizer, ids, spans) if words else None,
    )

"""Beam search over an encoder-decoder's decoder (text-to-text: llmrun.text_to_text; speech
recognition: llmrun.seq2seq, llmrun.whisper), after its decoder prompt, as transformers 5's
generate searches with num_beams > 1 and no sampling (GenerationMixin._beam_search): the
beams decode as the rows of one batch, each step's log-softmax goes through the logits
processors per beam, then the best (EOS ids + 1, at least 2) x num_beams continuations of
all beams are ranked by their summed log-probabilities. Those that end (an EOS id, or
max_length reached) among the top num_beams join the finished hypotheses, scored sum /
generated_length ** length_penalty (generated_length: the tokens after the decoder prompt);
the best num_beams of the rest run on, their KV cache rows reordered to the beams they
continue. Decoding stops when every continuation ends, or with early_stopping True once
num_beams hypotheses are finished, or (False, "never") when no running beam can beat the
worst finished one by transformers' heuristic. Ties, the -1e9 offsets and float32
arithmetic are as transformers has them, so the same scores choose the same tokens.

Reference: transformers/generation/utils.py (_beam_search, _get_top_k_continuations,
_get_running_beams_for_next_iteration, _update_finished_beams, _check_early_stop_heuristic,
_beam_search_has_unfinished_sequences).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError

MAX_BEAMS = 32  # each beam is a decoder cache row: a bound on what a request may allocate
_FAR = -1.0e9  # transformers' offset of hypotheses that must not be chosen


@dataclass(frozen=True)
class Beams:
    """generation_config.json's beam search: how many beams, the exponent of the length
    that divides a finished hypothesis's score, and when to stop (True: num_beams
    hypotheses finished; False or "never": no running beam can beat them)."""

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @classmethod
    def of(cls, generation: dict[str, Any], config: dict[str, Any]) -> Beams:
        """From generation_config.json, else (an older folder without one) config.json."""
        merged = generation or config
        beams = merged.get("num_beams", 1)
        penalty = merged.get("length_penalty", 1.0)
        early = merged.get("early_stopping", False)
        if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
            raise ModelFormatError(f"generation_config.json: num_beams {beams!r}")
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)):
            raise ModelFormatError(f"generation_config.json: length_penalty {penalty!r}")
        if early not in (True, False, "never"):
            raise ModelFormatError(f"generation_config.json: early_stopping {early!r}")
        if beams > MAX_BEAMS:
            raise UnsupportedError(
                f"generation_config.json asks for {beams} beams; llmrun searches with up to "
                f"{MAX_BEAMS}"
            )
        return cls(beams, float(penalty), early)

    def requested(self, num_beams: int | None) -> Beams:
        """These beams, `num_beams` of them where a request asks (None: the file's)."""
        if num_beams is None:
            return self
        if not 1 <= num_beams <= MAX_BEAMS:
            raise UsageError(
                f"the number of beams must be between 1 and {MAX_BEAMS}, got {num_beams}"
            )
        return dataclasses.replace(self, num_beams=num_beams)


class Hypothesis(NamedTuple):
    """A finished hypothesis: its tokens after the decoder prompt (its EOS id kept where it
    ended with one), and its score, the sum of its tokens' processed log-probabilities
    divided by their count ** length_penalty (transformers' sequences_scores)."""

    tokens: list[int]
    score: float


def search(
    step: Callable[[torch.Tensor, int], torch.Tensor],
    reorder: Callable[[torch.Tensor], None],
    process: Callable[[torch.Tensor, torch.Tensor], None],
    prompt: Sequence[int],
    beams: Beams,
    max_length: int,
    eos_ids: Sequence[int],
) -> list[Hypothesis]:
    """The num_beams finished hypotheses, best first. `step(tokens [num_beams, t],
    position)`: each beam's float32 logits [num_beams, vocab] for its next token after
    `tokens` at `position`.. (the whole prompt at 0 first, then one token a step), through
    its cache row; `reorder(rows [num_beams])`: row i's cache becomes row rows[i]'s;
    `process(log_probs, sequences)`: the logits processors, in place, on each beam's
    log-probabilities given its tokens so far [num_beams, length]; `max_length`: the most
    decoder tokens, the prompt's included."""
    n, lp, early = beams.num_beams, beams.length_penalty, beams.early_stopping
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
    keep = max(2, 1 + len(eos)) * n
    top_n = torch.arange(keep) < n
    begin = len(prompt)  # transformers' decoder_prompt_len
    running = torch.zeros((1, n, max_length), dtype=torch.long)
    running[:, :, :begin] = torch.tensor(list(prompt), dtype=torch.long)
    running_scores = torch.zeros(1, n)
    running_scores[:, 1:] = _FAR  # the beams start alike: only the first one's tokens count
    finished = running.clone()
    scores = torch.full((1, n), _FAR)
    done = torch.zeros(1, n, dtype=torch.bool)
    lengths = torch.full((1, n), begin, dtype=torch.long)  # each finished slot's tokens
    improvable = torch.ones(1, 1, dtype=torch.bool)
    length = begin
    while True:
        fed = 0 if length == begin else length - 1
        log_probs = torch.log_softmax(step(running[0, :, fed:length], fed), dim=-1)
        process(log_probs, running[0, :, :length])
        vocab = log_probs.shape[-1]
        totals = (log_probs[None] + running_scores[:, :, None]).reshape(1, -1)
        top_scores, top_indices = torch.topk(totals, k=keep)
        origin = top_indices // vocab
        candidates = torch.take_along_dim(running, origin[..., None], dim=1)
        candidates[:, :, length] = top_indices % vocab
        ends = torch.isin(candidates[:, :, length], eos) | (length + 1 >= max_length)

        # The best num_beams that did not end run on.
        held_back = top_scores + ends.to(torch.float32) * _FAR
        chosen = torch.topk(held_back, k=n)[1]
        running = torch.take_along_dim(candidates, chosen[..., None], dim=1)
        running_scores = torch.take_along_dim(held_back, chosen, dim=1)
        rows = torch.take_along_dim(origin, chosen, dim=1)[0]

        # Those of the top num_beams that ended join the finished, if they score higher.
        ended = ends & top_n[None, :]
        final = top_scores / ((length + 1 - begin) ** lp)
        final += (done.all(dim=-1, keepdim=True) & (early is True)).to(torch.float32) * _FAR
        final += (~improvable).to(torch.float32) * _FAR
        final += (~ended) * _FAR
        best = torch.topk(torch.cat((scores, final), dim=1), k=n)[1]
        finished = torch.take_along_dim(
            torch.cat((finished, candidates), dim=1), best[..., None], 1
        )
        scores = torch.take_along_dim(torch.cat((scores, final), dim=1), best, dim=1)
        done = torch.take_along_dim(torch.cat((done, ended), dim=1), best, dim=1)
        grown = torch.full((1, keep), length + 1, dtype=torch.long)
        lengths = torch.take_along_dim(torch.cat((lengths, grown), dim=1), best, dim=1)

        if not torch.equal(rows, torch.arange(n)):
            reorder(rows)
        length += 1
        # Whether a running beam could still beat the worst finished hypothesis.
        hoped = (max_length if early == "never" and lp > 0.0 else length) - begin
        possible = running_scores[:, :1] / (hoped**lp)
        worst = torch.where(done, torch.min(scores, dim=1, keepdim=True)[0], _FAR)
        improvable = improvable & torch.any(possible > worst, dim=-1, keepdim=True)
        open_beam = not (bool(done.all()) and early is True)
        if not (bool(improvable.any()) and open_beam and not bool(ends.all())):
            break
    ends, final_scores = lengths[0].tolist(), scores[0].tolist()
    return [
        Hypothesis(row[begin:end].tolist(), score)
        for row, end, score in zip(finished[0], ends, final_scores, strict=True)
    ]

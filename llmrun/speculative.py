"""Speculative decoding: a small draft model (Draft), Gemma 4's assistant reading the
model's own state (Assistant), or the context itself (Lookup, prompt lookup), proposes the
next tokens, the model checks them all in one forward, and each token it agrees with saves
a decode step.

A round: up to `max_tokens` tokens are drafted after the sequence; the model runs the
pending token and the drafts as one forward (on a memory-bound CPU it costs about one
decode step) and gets the logits after each; the drafts it accepts and one token of its
own are the round's output; the caches drop the rejected positions.
Greedy accepts a draft where it is the model's argmax, so the output is plain greedy
decoding's. Sampling uses the speculative sampling rule (Leviathan et al. 2023, Chen
et al. 2023): a draft d drawn from the draft's distribution q is accepted with
probability min(1, p(d) / q(d)), where p is the model's; at the first rejection the
token is drawn from max(0, p - q), normalized; after all are accepted, from p. The
tokens are then distributed as the model's own. p and q are both what the sampler
draws from: logit biases, repetition penalties over the tokens so far (the drafts
before included), then top-k, top-p, min-p and temperature (Sampler.distribution).

serve's scheduler (llmrun.batching) runs the same rounds (Speculator.round) through its
paged KV cache while one request runs (Draft's and Lookup's; not Assistant's).

Only a cache that can drop positions can take drafts back: a hybrid or state-space
model's recurrent state cannot, and is refused. Sliding-window rings keep the slots a
round overwrites (KVCache.save_span) and put back those of rejected positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from llmrun.errors import UnsupportedError, UsageError
from llmrun.generate import KVState, Stats, decode, prefill
from llmrun.models import gemma3n, gemma4_assistant
from llmrun.models.cache import KVCache
from llmrun.sampling import Sampler, argmax
from llmrun.tokenizer import Tokenizer

# Tokens drafted a round: llama.cpp's --draft-max and mlx-lm's --num-draft-tokens
# default. On a CPU a verify forward grows with its tokens, and a long draft's tail is
# rarely accepted.
DEFAULT_DRAFT_MAX = 3
# A draft's lowest confidence to go on drafting (--draft-p-min): llama.cpp's
# --spec-draft-p-min, 0 (off) by default since it drafts --draft-max tokens regardless.
DEFAULT_DRAFT_P_MIN = 0.0
# Vocabulary sizes may differ by padding (Qwen2.5's 0.5B and 7B), as llama.cpp allows.
VOCAB_SIZE_SLACK = 128
VOCAB_SAMPLE = 1000  # token ids compared at the start, the end and spread over the middle
# Prompt lookup's n-grams, the longest first. Single tokens match almost anywhere and
# predict little, while each draft costs a position of the verify forward: 128 greedy
# tokens of stories260K after a prompt that repeats a function drafted 322 tokens and
# had 53 accepted matching down to 1 token, 116 and 47 down to 2.
LOOKUP_NGRAM_MAX = 3
LOOKUP_NGRAM_MIN = 2


def check_vocab(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft whose token ids stand for other text than the model's (as llama.cpp's
    common_speculative_are_compatible): vocabulary sizes, BOS/EOS ids and whether BOS is
    added, and the bytes of a sample of ids (the first and last VOCAB_SAMPLE and as many
    spread between) must agree."""
    problem = None
    if abs(target.vocab_size - draft.vocab_size) > VOCAB_SIZE_SLACK:
        problem = f"{draft.vocab_size} tokens, the model {target.vocab_size}"
    elif draft.add_bos != target.add_bos:
        problem = "no BOS added, the model adds one" if target.add_bos else "a BOS added"
    elif (draft.bos_id, draft.eos_id) != (target.bos_id, target.eos_id):
        problem = f"BOS/EOS ids {draft.bos_id}/{draft.eos_id}, the model's "
        problem += f"{target.bos_id}/{target.eos_id}"
    else:
        shared = min(target.vocab_size, draft.vocab_size)
        step = max(1, shared // VOCAB_SAMPLE)
        ids = sorted({*range(min(VOCAB_SAMPLE, shared)), *range(0, shared, step)})
        ids += range(max(ids[-1] + 1, shared - VOCAB_SAMPLE), shared)
        differ = next((i for i in ids if target.token_bytes(i) != draft.token_bytes(i)), None)
        if differ is not None:
            problem = (
                f"token {differ} is {draft.token_bytes(differ)!r}, the model's "
                f"{target.token_bytes(differ)!r}"
            )
    if problem is not None:
        raise UsageError(
            f"--draft {draft_name}: its vocabulary is not the model's ({problem}); a draft "
            "must share the model's tokenizer (a smaller model of the same family)"
        )


def check_cache(cache: KVCache, name: str) -> None:
    """Refuse a model whose cache cannot drop rejected drafts (a recurrent state)."""
    if cache.recurrent is not None:
        raise UnsupportedError(
            f"{name}: speculative decoding needs a cache that can drop rejected tokens, and "
            "this model's recurrent state cannot go back (a hybrid or state-space model)"
        )


class Speculator:
    """Speculative decoding's loop (generate_step); a subclass proposes the drafts."""

    def __init__(self, max_tokens: int, flag: str) -> None:
        if max_tokens < 1:
            raise UsageError(f"{flag} must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens

    def start(self, sequence: Sequence[int], capacity: int) -> None:
        """Before the first round, with the prompt prefilled (`sequence`) in a cache of
        `capacity` positions."""

    def room(self) -> int | None:
        """The sliding window of the proposer's own cache, which a round's drafts must
        not wrap (None: no limit)."""
        return None

    def propose(
        self,
        sequence: Sequence[int],
        history: Sequence[int],
        count: int,
        sampler: Sampler,
        vocab: int,
    ) -> tuple[list[int], list[torch.Tensor], Any]:
        """Up to `count` tokens to follow `sequence`, the distributions [vocab] they were
        drawn from (none for greedy), and what take_back needs."""
        raise NotImplementedError

    def take_back(self, saved: Any, keep: int) -> None:
        """After a round: the sequence is now its first `keep` tokens."""

    @torch.inference_mode()
    def generate_step(
        self,
        model: nn.Module,
        state: KVState,
        tokens: Sequence[int],
        sampler: Sampler,
        history: list[int],
        stats: Stats,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """llmrun.generate.generate_step with drafts: prefill `tokens` after the cached
        ones, then yield (token, the model's raw logits it was drawn from) until the
        caller stops or the context is full; `stats` counts the drafts and those accepted."""
        check_cache(state.cache, "the model")
        if sampler.constraint is not None:
            raise UsageError("speculative decoding does not combine with --grammar or --format")
        logits = prefill(model, state, tokens)
        self.start(state.tokens, state.capacity)
        token = sampler(logits, history)
        yield token, logits
        history.append(token)

        def forward(fed: list[int]) -> torch.Tensor:
            if len(fed) == 1:
                return decode(model, state, fed[0])[None]
            return verify(model, state, state.cache, fed)

        while len(state.tokens) < state.capacity:
            count = min(self.max_tokens, state.capacity - len(state.tokens) - 1)
            for room in (state.cache.window, self.room()):
                if room is not None:  # a round's writes must not wrap a ring
                    count = min(count, room - 1)
            tokens, rows = self.round(
                state, token, sampler, history, stats, count, model.args.vocab_size, forward
            )
            for token, row in zip(tokens, rows, strict=True):
                yield token, row
                history.append(token)

    def round(
        self,
        state: KVState,
        token: int,
        sampler: Sampler,
        history: Sequence[int],
        stats: Stats,
        count: int,
        vocab: int,
        forward: Callable[[list[int]], torch.Tensor],
    ) -> tuple[list[int], torch.Tensor]:
        """One round after `state`'s tokens and the pending `token` (sampled, not yet
        fed): up to `count` drafts over `vocab` ids; forward(fed) feeds the pending token
        and the drafts after state's tokens (extending them) and returns the model's
        logits [len(fed), V] after each. The rejected positions are dropped; the round's
        tokens (the drafts accepted and the model's own after them) and the logits each
        was drawn from."""
        start = len(state.tokens)
        drafts, dists, draft_saved = [], [], None
        if count > 0:
            drafts, dists, draft_saved = self.propose(
                [*state.tokens, token], history, count, sampler, vocab
            )
        saved = state.cache.save_span(start, len(drafts) + 1) if drafts else None
        rows = forward([token, *drafts])
        accepted, last = judge(rows, drafts, dists, sampler, history)
        keep = start + 1 + accepted
        del state.tokens[keep:]
        if drafts:
            state.cache.restore_span(saved, keep)
        if count > 0:
            self.take_back(draft_saved, keep)
        stats.drafted += len(drafts)
        stats.accepted += accepted
        return [*drafts[:accepted], last], rows[: accepted + 1]


class Draft(Speculator):
    """Drafts by a draft model with a KV cache of its own that follows the model's
    sequence (its shared prefix kept between calls, as a chat's turns keep theirs).
    A round stops drafting where the draft's most likely next token has a probability
    below `p_min` (llama.cpp's --draft-p-min, which measures it among the draft's 10 best
    tokens at temperature 1; here, in the distribution the draft samples from, or for
    greedy in the softmax of its penalized logits)."""

    def __init__(
        self,
        model: nn.Module,
        new_cache: Callable[[int], KVCache],
        max_tokens: int,
        p_min: float = DEFAULT_DRAFT_P_MIN,
    ) -> None:
        super().__init__(max_tokens, "--draft-max")
        if not 0.0 <= p_min <= 1.0:
            raise UsageError(f"--draft-p-min must be between 0 and 1, got {p_min}")
        self.p_min = p_min
        self.model = model
        self.new_cache = new_cache
        self.state: KVState | None = None

    def _follow(self, sequence: Sequence[int]) -> torch.Tensor:
        """Bring the draft's cache to `sequence` (keeping what it shares with it); the
        draft's logits after it."""
        state = self.state
        n = min(len(state.tokens), len(sequence) - 1)
        if state.tokens[:n] != list(sequence[:n]):
            n = next(i for i in range(n) if state.tokens[i] != sequence[i])
        n = state.cache.reusable(n)
        del state.tokens[n:]
        return prefill(self.model, state, sequence[n:])

    def start(self, sequence: Sequence[int], capacity: int) -> None:
        """Before the first round: a cache of `capacity` positions (the model's), and the
        prompt prefilled (but its last token), so its time counts as the prompt's."""
        if self.state is None or self.state.capacity != capacity:
            self.state = KVState(self.new_cache(capacity))
            check_cache(self.state.cache, "the draft model")
        if len(sequence) > 1:
            self._follow(sequence[:-1])

    def propose(
        self,
        sequence: Sequence[int],
        history: Sequence[int],
        count: int,
        sampler: Sampler,
        vocab: int,
    ) -> tuple[list[int], list[torch.Tensor], tuple | None]:
        """Up to `count` tokens after `sequence`, each drawn as `sampler` would from the
        draft's logits (penalties over `history` and the drafts before it) over the
        model's `vocab` ids, fewer where the draft's confidence falls below p_min; their
        distributions (none for greedy); what restore_span needs to take back the drafts
        fed."""
        logits = self._follow(sequence)
        saved = self.state.cache.save_span(len(sequence), count - 1)
        seen, drafts, dists = list(history), [], []
        for i in range(count):
            if i:
                logits = decode(self.model, self.state, drafts[-1])
            if not choose(_padded(logits, vocab), sampler, seen, self.p_min, drafts, dists):
                break
        return drafts, dists, saved

    def take_back(self, saved: tuple | None, keep: int) -> None:
        del self.state.tokens[keep:]
        self.state.cache.restore_span(saved, keep)

    def room(self) -> int | None:
        return self.state.cache.window


class Assistant(Speculator):
    """Drafts by Gemma 4's assistant (llmrun.models.gemma4_assistant), which reads the
    model's own state instead of keeping a cache: each draft of a round after a token t at
    position p takes t's embedding (the model's) and a hidden state (the model's final
    normed one at p - 1, then the assistant's own projected output), and attends, at
    position p for every draft of the round, to the model's cached keys and values of
    positions before p in its last layer of each type (of the sliding one, the last
    sliding_window positions the model's ring holds). transformers' candidate generator
    and llama.cpp agree on all that (transformers' sliding layers see one position more,
    llama.cpp's one fewer), but transformers also lets the assistant see the keys of the
    first rejected draft after a rejection; here a rejection leaves no trace, as in
    llama.cpp. The model's hidden states are taken as its forward computes them (hooks
    on its final norm while generate_step runs), so only generate_step drives it; serve's
    paged rounds do not."""

    def __init__(self, assistant: nn.Module, max_tokens: int, p_min: float = DEFAULT_DRAFT_P_MIN):
        super().__init__(max_tokens, "--draft-max")
        if not 0.0 <= p_min <= 1.0:
            raise UsageError(f"--draft-p-min must be between 0 and 1, got {p_min}")
        self.assistant, self.p_min = assistant, p_min
        self.dtype = assistant.pre_projection.weight.dtype
        self.model: nn.Module | None = None
        self.cache: KVCache | None = None
        self.hidden: torch.Tensor | None = None  # [T, hidden] of the model's last forward
        self.positions: torch.Tensor | None = None  # [T] their positions

    @torch.inference_mode()
    def generate_step(
        self,
        model: nn.Module,
        state: KVState,
        tokens: Sequence[int],
        sampler: Sampler,
        history: list[int],
        stats: Stats,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Speculator.generate_step, with the model's hidden states watched."""
        if state.cache.paged or state.cache.rows is not None:
            raise UnsupportedError("Gemma 4's assistant drafts for one sequence in its own cache")
        self.model, self.cache = model, state.cache

        def called(_module, args, kwargs) -> None:
            self.positions = (args[1] if len(args) > 1 else kwargs["positions"])[0]

        def normed(_module, _args, out: torch.Tensor) -> None:
            self.hidden = out[0]

        hooks = [
            model.register_forward_pre_hook(called, with_kwargs=True),
            model.model.norm.register_forward_hook(normed),
        ]
        try:
            yield from super().generate_step(model, state, tokens, sampler, history, stats)
        finally:
            for hook in hooks:
                hook.remove()

    def _hidden_at(self, position: int) -> torch.Tensor:
        """The model's final normed hidden state [hidden] at `position`, of its last
        forward (which normed its last rows alone where it kept only the last logits)."""
        positions = self.positions[-self.hidden.shape[0] :]
        row = position - int(positions[0])
        if not 0 <= row < len(positions) or int(positions[row]) != position:
            raise RuntimeError(f"the model's last forward did not compute position {position}")
        return self.hidden[row]

    def _keys_values(self, position: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, the keys and values [1, Hkv, L, D] a query at `position` reads:
        the model's of positions before it, in its last cached layer of the type (the last
        sliding_window of them for the sliding type)."""
        cache, target = self.cache, self.model.args
        window = self.assistant.args.text.sliding_window
        out = {}
        for kind in set(self.assistant.args.text.layer_types):
            layer = max(
                i for i, t in enumerate(target.layer_types[: target.kv_layers]) if t == kind
            )
            group, index = cache.where[layer]
            keys, values = (stored[index, :1] for stored in cache.buffers[group])
            first = max(0, position - window) if kind == gemma4_assistant.SLIDING else 0
            if cache.windowed(layer):
                slots = torch.arange(cache.window, device=keys.device)
                held = position - 1 - (position - 1 - slots) % cache.window
                slots = slots[held >= first]
                keys, values = keys[:, :, slots], values[:, :, slots]
            else:
                keys, values = keys[:, :, first:position], values[:, :, first:position]
            out[kind] = (cache.decode(keys, self.dtype), cache.decode(values, self.dtype))
        return out

    def propose(
        self,
        sequence: Sequence[int],
        history: Sequence[int],
        count: int,
        sampler: Sampler,
        vocab: int,
    ) -> tuple[list[int], list[torch.Tensor], None]:
        """Up to `count` tokens after `sequence`, each drawn as `sampler` would from the
        assistant's logits (penalties over `history` and the drafts before it), fewer
        where its confidence falls below p_min; their distributions (none for greedy)."""
        position = len(sequence) - 1
        hidden = self._hidden_at(position - 1)
        kv = self._keys_values(position)
        embed = self.model.model.embed_tokens
        device = hidden.device
        positions = torch.tensor([[position]], device=device)
        seen, drafts, dists = list(history), [], []
        token = sequence[-1]
        for _ in range(count):
            x = embed(torch.tensor([[token]], device=device))
            x = x * gemma3n.scale_like(self.model.args.hidden_size**0.5, x)
            inputs = torch.cat([x[0, 0], hidden]).to(self.dtype)[None, None]
            logits, projected = self.assistant(inputs, positions, kv)
            if not choose(_padded(logits[0, -1], vocab), sampler, seen, self.p_min, drafts, dists):
                break
            token, hidden = drafts[-1], projected[0, -1].to(hidden.dtype)
        return drafts, dists, None


class Lookup(Speculator):
    """Drafts without a model (prompt lookup decoding, vLLM's "ngram" method): where the
    sequence's last n tokens (n from LOOKUP_NGRAM_MAX down to LOOKUP_NGRAM_MIN) occurred
    before, the tokens that followed them there, at the latest such place. Answers that
    quote or edit their context (code, documents) repeat long spans of it."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(max_tokens, "--lookup")

    def propose(
        self,
        sequence: Sequence[int],
        history: Sequence[int],
        count: int,
        sampler: Sampler,
        vocab: int,
    ) -> tuple[list[int], list[torch.Tensor], None]:
        """The continuation of the last n-gram's latest earlier occurrence; each draft's
        distribution one-hot (it is certain), so a sampled draft is accepted with the
        model's probability of it and a rejected one drawn again without it."""
        drafts = [d for d in lookup(sequence, count) if d < vocab]
        if sampler.params.temperature == 0:
            return drafts, [], None
        dists = []
        for draft in drafts:
            dists.append(torch.zeros(vocab, dtype=torch.float64))
            dists[-1][draft] = 1.0
        return drafts, dists, None


def choose(
    logits: torch.Tensor,
    sampler: Sampler,
    seen: list[int],
    p_min: float,
    drafts: list[int],
    dists: list[torch.Tensor],
) -> bool:
    """Draw a draft from the drafter's `logits` [vocab] as `sampler` would (penalties over
    `seen`) and append it to `drafts` and `seen`, its distribution to `dists` (none for
    greedy); False, drawing nothing, where the drafter's top probability is below
    `p_min` (for greedy, in the softmax of its penalized logits)."""
    if sampler.params.temperature == 0:
        scores = sampler.penalize(sampler.biased(logits), seen)
        if p_min and torch.softmax(scores.float(), -1).max() < p_min:
            return False
        token = argmax(scores)
    else:
        dist = sampler.distribution(logits, seen)
        if dist.max() < p_min:
            return False
        dists.append(dist)
        token = sampler.pick(dist)
    drafts.append(token)
    seen.append(token)
    return True


def lookup(sequence: Sequence[int], count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of `sequence`'s
    last n tokens, for the largest n from LOOKUP_NGRAM_MAX to LOOKUP_NGRAM_MIN that
    occurs; none where none does."""
    tokens = np.asarray(sequence, dtype=np.int64)
    for n in range(min(LOOKUP_NGRAM_MAX, len(tokens) - 1), LOOKUP_NGRAM_MIN - 1, -1):
        # Every n-gram with a token after it but the sequence's own last one.
        grams = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        found = np.flatnonzero((grams == tokens[-n:]).all(axis=1))
        if len(found):
            after = int(found[-1]) + n
            return tokens[after : after + count].tolist()
    return []


def _padded(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [V'] over the model's `vocab` ids: cut, or padded with -inf (the
    vocabularies may differ by padding: see VOCAB_SIZE_SLACK)."""
    if logits.shape[-1] >= vocab:
        return logits[:vocab]
    return torch.cat([logits, logits.new_full((vocab - logits.shape[-1],), float("-inf"))])


def verify(model: nn.Module, state: KVState, cache: Any, fed: list[int]) -> torch.Tensor:
    """Feed `fed` (the pending token and the drafts) after the cached tokens in one
    forward through `cache` (state's, or a paged cache's view of its row): the model's
    logits [len(fed), V] after each."""
    start, device = len(state.tokens), cache.k.device
    ids = torch.tensor([fed], device=device)
    positions = torch.arange(start, start + len(fed), device=device)[None]
    rows = model(ids, positions, cache)[0]
    state.tokens.extend(fed)
    return rows


def judge(
    rows: torch.Tensor,
    drafts: Sequence[int],
    dists: Sequence[torch.Tensor],
    sampler: Sampler,
    history: Sequence[int],
) -> tuple[int, int]:
    """How many of `drafts` the model accepts, and its token after them: rows [n + 1, V]
    are its logits after the pending token and each draft, `dists` the draft's
    distributions (none for greedy), `history` the tokens before the drafts."""
    seen = list(history)
    if sampler.params.temperature == 0:
        for i, draft in enumerate(drafts):
            best = argmax(sampler.penalize(sampler.biased(rows[i]), seen))
            if best != draft:
                return i, best
            seen.append(draft)
        return len(drafts), argmax(sampler.penalize(sampler.biased(rows[-1]), seen))
    for i, (draft, q) in enumerate(zip(drafts, dists, strict=True)):
        p = sampler.distribution(rows[i], seen)
        # Accepted with probability min(1, p / q): u * q < p for u uniform in [0, 1).
        u = torch.rand((), dtype=torch.float64, generator=sampler.generator)
        if u * q[draft] < p[draft]:
            seen.append(draft)
            continue
        residual = (p - q).clamp_(min=0)
        return i, sampler.pick(residual if residual.sum() > 0 else p)
    return len(drafts), sampler.pick(sampler.distribution(rows[-1], seen))

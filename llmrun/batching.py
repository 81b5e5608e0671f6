"""Continuous batching: concurrent requests decoded together by one scheduler thread.

The thread owns the model and a paged KV cache (llmrun.models.paged): one pool of
blocks, each sequence holding the blocks of its own positions (llmrun.kv_blocks).
Each step it admits waiting requests, oldest first, while fewer than `parallel`
run and the blocks of the next one's prompt can be allocated, after reusing the
cached blocks its prompt starts with (automatic prefix caching: the blocks of
finished and running sequences are named by their tokens and kept until their
space is needed; sliding-window layers have a pool of their own, where a
sequence holds only the blocks of its window; a hybrid model's recurrent layers get a
state row per running sequence, and a prefix is reused only up to a block end where a
state was kept: the prompt's last and the sequence's last, see _keep_state). It prefills up to PREFILL_BUDGET of their prompt tokens (the
chunks of several requests in one padded forward; a long prompt takes several
steps, so it delays the others by one chunk at a time), then advances every
decoding sequence by one token in a single batched forward, each row at its own
position. A sequence that needs a block the pool no longer has takes it from the
most recently admitted one, which is preempted: it lets go of its blocks (its full
ones stay cached) and waits at the front of the queue to be prefilled again, with
the tokens it has generated, and goes on where it stopped. Each sequence samples
with its own Sampler and becomes text through its own TokenStream, as
stream_generate does for one, and runs with its own LoRA adapter scales (each row's
delta scaled by its own, llmrun.loading.lora.scaled; its blocks' names start from
them, so no prefix is shared across scales), so its tokens do not depend on what it
was batched with or what the cache held (float rounding aside: batched logits differ
from single-row ones by ~1e-5). Finished and cancelled sequences leave between steps.
A prompt with images (Gemma 3's, llmrun.multimodal; Mistral 3's and Qwen2-VL's, spans
of a length by the image's size) prefills with their embeddings in place of their
placeholder tokens: a chunk never ends inside an image, and a chunk that holds image
tokens goes in a forward of its own (one row: Gemma 3's image tokens attend to each
other both ways), while the decode steps batch as ever. Qwen2-VL's images take M-RoPE
positions and shift the text after them, so each row of a forward without image tokens
carries its own shift (PagedView.rope_shifts). The blocks an
image's tokens begin in are salted with its digest (llmrun.kv_blocks), so a prefix is
reused across prompts only where they hold the same image; a reused prefix may end
inside an image, whose rest is then fed whole (the cached part was computed with all of
it, and the rest attends to the cached part as the whole image's forward did). Llama 3.2
Vision's image takes no tokens: the prompt up to its <|image|> goes in one forward of its
own, which computes the image's cross-attention keys and values; the sequence keeps them
(Job.image_state) and every later forward gives its row them (llmrun.models.mllama). Every
token of such a prompt attends to the image, so its blocks are salted from the first, and
it takes none from the prefix cache (the blocks do not hold the image's state).
While a single sequence runs, a speculator (the engine's --draft or --lookup,
llmrun.speculative) drafts its next tokens and the model checks them all in one
forward, through the same blocks: greedy output stays the batched step's, sampling
follows the speculative sampling rule. A grammar, or another sequence arriving, means
the batched step again; the draft model's cache catches up with the accepted tokens
when drafting resumes.
Events reach the caller through a callback on the scheduler thread; it must
return quickly.
"""

from __future__ import annotations

import itertools
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from llmrun.api import Engine
from llmrun.errors import ContextOverflowError, LlmrunError, ServerBusyError, UsageError
from llmrun.generate import (
    CHECKPOINT_MARGIN,
    KVState,
    Response,
    Stats,
    TokenLogprob,
    TokenStream,
    check_fits,
)
from llmrun.kv_blocks import BLOCK_SIZE, KVBlocks, SequenceBlocks, blocks_for
from llmrun.loading import lora
from llmrun.loading.loader import free_bytes
from llmrun.models.paged import PagedKVCache, window_layers
from llmrun.models.recurrent import StateSnapshots, copy_row
from llmrun.multimodal import PromptImages
from llmrun.sampling import Sampler, SamplingParams
from llmrun.speculative import verify
from llmrun.text_to_text import Options

# Prompt tokens prefilled per step: smaller than a one-shot run's chunk, since
# every decoding sequence waits for it, but room for several new chat turns at once:
# at 128, turns arriving together were split over steps, and the split put their
# sequences out of step with each other, so every later turn's prefill stalled the
# others (8 users x 8 turns: inter-token P99 188-228 ms at 128, 60-67 at 256).
PREFILL_BUDGET = 256
# A request waits while a running one computes at least this many tokens of their
# shared prompt prefix, then reuses them (a wait of a step or more: not worth it for
# less, such as a chat template's header).
FOLLOW_MIN = PREFILL_BUDGET // 2
# Without --kv-memory the pool holds this many whole contexts per --parallel
# sequence: each one's full context, and as much again for cached prefixes; at most
# MEMORY_SHARE of the memory free at start.
CONTEXTS_PER_SEQUENCE = 2
MEMORY_SHARE = 0.5
# A hybrid model's prefix cache keeps this many recurrent states per --parallel sequence
# (each as big as one sequence's state: see llmrun.models.recurrent.StateSnapshots).
SNAPSHOTS_PER_SEQUENCE = 2

Event = Response | Exception


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    # Report each prompt token's logprob, with this many top ones (completions' echo):
    # the prompt is then computed whole, not taken from the prefix cache.
    prompt_logprobs: int | None = None
    # Where the conversation ends in the prompt, before the generation prompt: a hybrid
    # model keeps its state at the last block end up to there (see _step).
    history_end: int | None = None
    # Each LoRA adapter's scale for this request (None: the model's scales at submit).
    lora: tuple[float, ...] | None = None
    # The prompt's images, encoded (Engine.encoded_prompt), and a digest of each one's
    # content, which salts the names of the KV blocks it begins in (see kv_blocks).
    images: PromptImages | None = None
    image_digests: Sequence[bytes] = ()
    # A text-to-text model's beams and languages (llmrun.server.serial runs its requests).
    text_to_text: Options | None = None


@dataclass(eq=False)
class Job:
    """A request in the scheduler: waiting, then running, then finished (a preempted
    one waits again, with what it had generated)."""

    request: Request
    on_event: Callable[[Event], None]
    state: KVState | None = None
    table: SequenceBlocks | None = None  # its blocks while running
    slot: int | None = None  # its row of a hybrid model's recurrent state, while running
    target: list[int] = field(default_factory=list)  # what the cache must hold before decoding
    order: int = 0  # admission order, for preemption
    sampler: Sampler | None = None
    stream: TokenStream | None = None
    history: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed to the model
    cancelled: bool = False
    finished: bool = False
    scored: dict[int, TokenLogprob] = field(default_factory=dict)  # prompt logprobs by position
    prompt_scored: bool = False  # its prompt's logprobs were sent
    lora: tuple[float, ...] = ()  # its adapters' scales, which its rows run with
    root: bytes = b""  # its blocks' names start here: its keys depend on its scales too
    salts: dict[int, bytes] = field(default_factory=dict)  # its images' digests, by block
    # Its image's state beside its blocks, where the model keeps one per sequence (Llama
    # 3.2 Vision's cross-attention keys and values: llmrun.models.mllama), once computed.
    image_state: Any = None

    @property
    def prefilling(self) -> bool:
        return self.state is not None and len(self.state.tokens) < len(self.target)

    @property
    def scoring(self) -> bool:
        """Whether the prompt's logprobs are still to be computed and sent."""
        return self.request.prompt_logprobs is not None and not self.prompt_scored


class Scheduler:
    """Up to `parallel` sequences decoded together over one pool of KV blocks of
    `kv_memory` bytes (default: see CONTEXTS_PER_SEQUENCE); up to `queue` more
    requests wait. `prefix_cache`: reuse the blocks of earlier prompts."""

    def __init__(
        self,
        engine: Engine,
        parallel: int = 4,
        queue: int = 64,
        prefill_budget: int = PREFILL_BUDGET,
        kv_memory: int | None = None,
        prefix_cache: bool = True,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be positive, got {parallel}")
        self.engine = engine
        self.parallel = parallel
        self.queue_size = queue
        self.prefill_budget = prefill_budget
        # The model's own one-position cache: its layers, KV heads and cache type.
        like = engine.new_cache(1, 1)
        n_blocks, window, window_blocks = self._pool_size(like, kv_memory)
        self.cache = PagedKVCache(like, n_blocks, BLOCK_SIZE, engine.ctx_size, window_blocks)
        # A model that keeps each sequence's image beside its KV cache (`images`, by row):
        # each forward's view gets its rows' (see _view).
        self.holds_images = hasattr(like, "images")
        # Unlimited-OCR's reference sliding window: each row's attention follows its
        # prompt's length (see _view and _commit).
        self.reference_window = like.reference_window
        # A hybrid model's recurrent layers: a state row per running sequence, and for
        # its prefix cache the states at some block ends (see _keep_state).
        self.states = self.pending = self.snapshots = None
        if like.recurrent is not None:
            self.states = like.recurrent.empty_like(parallel)
            self.pending = like.recurrent.empty_like(parallel)
            if prefix_cache:
                self.snapshots = StateSnapshots(like.recurrent, SNAPSHOTS_PER_SEQUENCE * parallel)
        self.pending_names: list[bytes | None] = [None] * parallel
        self.free_slots = list(range(parallel))
        self.blocks = KVBlocks(n_blocks, BLOCK_SIZE, prefix_cache, window, window_blocks)
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []  # touched by the scheduler thread only
        self.speculator = engine.speculator
        self._drafting: Job | None = None  # the sequence the speculator last drafted for
        self._admissions = itertools.count()
        self.preemptions = 0
        self._cond = threading.Condition()
        self._closed = False
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="llmrun-scheduler", daemon=True)

    def _pool_size(self, like, kv_memory: int | None) -> tuple[int, int | None, int]:
        """The full layers' blocks, and the sliding-window layers' window and blocks
        (0: no pool of their own). A windowed pool gets, per --parallel sequence,
        CONTEXTS_PER_SEQUENCE times the blocks one sequence can hold at once there (its
        window and a prefill chunk), so running sequences never wait for it; the
        full layers get the rest of the memory."""
        windowed, window = window_layers(like, self.engine.ctx_size)
        full_layers = [i for i, w in enumerate(windowed) if not w]
        full_bytes = PagedKVCache.block_bytes(like, BLOCK_SIZE, full_layers)
        if full_bytes == 0:  # no attention layer (Mamba): blocks hold nothing, cost nothing
            return CONTEXTS_PER_SEQUENCE * self.parallel * blocks_for(self.engine.ctx_size), None, 0
        window_blocks = window_bytes = 0
        if window is not None:
            held = blocks_for(min(window + self.prefill_budget, self.engine.ctx_size)) + 1
            window_blocks = CONTEXTS_PER_SEQUENCE * self.parallel * held
            window_bytes = window_blocks * PagedKVCache.block_bytes(
                like, BLOCK_SIZE, [i for i, w in enumerate(windowed) if w]
            )
        if kv_memory is None:
            wanted = CONTEXTS_PER_SEQUENCE * self.parallel * blocks_for(self.engine.ctx_size)
            share = int(free_bytes(self.engine.device) * MEMORY_SHARE) - window_bytes
            return max(min(wanted, share // full_bytes), 1), window, window_blocks
        n_blocks = (kv_memory - window_bytes) // full_bytes
        if n_blocks < 1:
            windows = (
                f" after {window_bytes} bytes for the sliding-window layers' blocks "
                f"({window_blocks} blocks for {self.parallel} sequences)"
                if window is not None
                else ""
            )
            raise UsageError(
                f"--kv-memory {kv_memory} bytes holds no KV block{windows}: one block of "
                f"{BLOCK_SIZE} tokens takes {full_bytes} bytes for this model"
            )
        return n_blocks, window, window_blocks

    @property
    def capacity(self) -> int:
        return self.engine.ctx_size

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop after the current step; unfinished requests get an error event. Safe to
        call again, from any thread (serve closes on its exit signal and at the end)."""
        with self._closing:
            with self._cond:
                self._closed = True
                self._cond.notify()
            if self._thread.is_alive():
                self._thread.join()
            gone = ServerBusyError("the server is shutting down")
            for job in [*self.waiting, *self.active]:
                self._finish(job, gone)
            self.waiting.clear()

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Job:
        """Queue a request; raises ContextOverflowError for a prompt that does not
        fit (the context, or the whole KV pool) and ServerBusyError when the queue
        is full."""
        if not request.prompt:
            raise LlmrunError("the prompt is empty")
        check_fits(len(request.prompt), self.capacity)
        needed, pool = blocks_for(len(request.prompt)), self.blocks.n_blocks
        if needed > pool:
            raise ContextOverflowError(
                f"the prompt is {len(request.prompt)} tokens, {needed} KV blocks of "
                f"{BLOCK_SIZE}, but the KV pool holds {pool} blocks ({pool * BLOCK_SIZE} "
                "tokens); shorten the prompt or raise --kv-memory"
            )
        job = Job(request, on_event)
        job.lora, job.root = self._lora_of(request)
        job.salts = _image_salts(request)
        no_tokens = request.max_tokens is not None and request.max_tokens <= 0
        if no_tokens and request.prompt_logprobs is None:
            stats = Stats(prompt_tokens=len(request.prompt))
            self._finish(job, Response("", None, stats, finish_reason="length"))
            return job
        with self._cond:
            if self._closed:
                raise ServerBusyError("the server is shutting down")
            if len(self.waiting) >= self.queue_size + self.parallel - len(self.active):
                # (waiting counts the requests not yet admitted to a free slot too)
                raise ServerBusyError(
                    f"all {self.parallel} slots are busy and the queue of {self.queue_size} is full"
                )
            self.waiting.append(job)
            self._cond.notify()
        return job

    def _lora_of(self, request: Request) -> tuple[tuple[float, ...], bytes]:
        """A request's adapter scales, and the root of its blocks' names (b"" without
        adapters, so the names are the same as ever)."""
        adapters = self.engine.lora
        if adapters is None:
            if request.lora:
                raise UsageError("the model has no LoRA adapters (serve's --lora)")
            return (), b""
        if request.lora is None and self.engine.audio_lora:
            # The audio's own adapter (Granite Speech's) runs for prompts with audio alone.
            scales: tuple[float, ...] = (float(request.images is not None),)
        else:
            scales = tuple(adapters.scales if request.lora is None else request.lora)
        if len(scales) != len(adapters):
            raise UsageError(f"{len(scales)} LoRA scales for the model's {len(adapters)} adapters")
        return scales, b"lora" + struct.pack(f"<{len(scales)}d", *scales)

    def cancel(self, job: Job) -> None:
        """Drop a request (its client went away); its blocks are free at the next step."""
        with self._cond:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
            self._cond.notify()

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._closed or self.waiting or self.active):
                        self._cond.wait()
                    if self._closed:
                        return
                    self._admit()
                try:
                    self._step()
                except Exception as e:  # a bug fails the requests in flight, not the scheduler
                    for job in list(self.active):
                        self._finish(job, e)

    def _admit(self) -> None:
        """Under the lock: let go of cancelled sequences, then admit waiting requests
        in order while a sequence may start and the next one's blocks can be had."""
        for job in [j for j in self.active if j.cancelled]:
            job.finished = True
            self._release(job)
        followers = []  # waiting for a running sequence to compute their prompt's prefix
        while len(self.active) < self.parallel and self.waiting:
            job = self.waiting[0]
            if job.stream is None and not self._begin(job):
                self.waiting.popleft()
                continue
            if self._follows(job):
                followers.append(self.waiting.popleft())
                continue
            images = job.request.images
            got = self.blocks.allocate(
                job.target,
                len(job.target),
                reuse=not job.scoring and (images is None or images.prefix_cached),
                ends=self.snapshots,
                root=job.root,
                salts=job.salts,
            )
            if got is None:
                break  # first come, first served: the next waits for blocks too
            self.waiting.popleft()
            job.table, reused = got
            if self.states is not None:
                job.slot = self.free_slots.pop()
                self.pending_names[job.slot] = None
                if reused:
                    name = job.table.full.names[reused // BLOCK_SIZE - 1]
                    self.snapshots.take(name, self.states, job.slot, reused)
            job.state = KVState(self.cache, job.target[:reused])
            if job.order == 0:  # its first admission: the prompt tokens it reuses
                job.stream.stats.prompt_processed = len(job.request.prompt) - reused
            job.order = next(self._admissions) + 1
            self.active.append(job)
        self.waiting.extendleft(reversed(followers))

    def _follows(self, job: Job) -> bool:
        """Whether `job` should wait while a running sequence computes the prefix their
        prompts share (at least FOLLOW_MIN tokens): then it finds those blocks in the
        prefix cache rather than computing them again. Requests arriving together with
        one long system prompt, and `n` choices, are prefilled once, not once each."""
        if not self.blocks.full.prefix_cache or job.scoring or self.states is not None:
            # A hybrid model keeps no state at the running one's chunk ends to take.
            return False
        if job.request.images is not None and not job.request.images.prefix_cached:
            return False  # it would find blocks it does not take
        size = self.blocks.block_size
        for other in self.active:
            if not other.prefilling or other.cancelled or other.root != job.root:
                continue
            done = len(other.state.tokens) // size * size  # blocks it has computed
            # Blocks still to come, while they match (a prompt's last token is always fed).
            last = min(len(job.target) - 1, len(other.target)) // size * size
            # From a block whose salt differs (another image), they share nothing.
            salts = job.salts, other.salts
            differ = [i for i in {*salts[0], *salts[1]} if salts[0].get(i) != salts[1].get(i)]
            if differ:
                last = min(last, min(differ) * size)
            shared = done
            while (
                shared < last
                and job.target[shared : shared + size] == other.target[shared : shared + size]
            ):
                shared += size
            if shared - done >= FOLLOW_MIN and job.target[:done] == other.target[:done]:
                return True
        return False

    def _begin(self, job: Job) -> bool:
        """A request's sampler and token stream; False (and its error sent) if they fail."""
        request = job.request
        try:
            job.sampler = Sampler(request.params)
            job.stream = TokenStream(
                self.engine.tokenizer,
                request.prompt,
                Stats(prompt_tokens=len(request.prompt), prompt_processed=len(request.prompt)),
                request.max_tokens,
                () if request.ignore_eos else self.engine.eos_ids,
                request.stop,
                request.logprobs,
            )
        except Exception as e:
            self._finish(job, e)
            return False
        job.target = list(request.prompt)
        job.history = list(request.prompt)
        return True

    def _step(self) -> None:
        parts, budget = [], self.prefill_budget
        for job in self.active:
            if budget <= 0:
                break
            if job.prefilling and not job.cancelled:
                done = len(job.state.tokens)
                # Chunks end at multiples of the budget, so they are the same however busy
                # the server is and whatever the cache held.
                end = min(len(job.target), (done // self.prefill_budget + 1) * self.prefill_budget)
                if self.snapshots is not None and end == len(job.target):
                    # A chunk ends at the last block end before the conversation's end (or
                    # the prompt's last few tokens), where its state is kept for the next
                    # turn (generate.CHECKPOINT_MARGIN says why).
                    keep = job.request.history_end or end - CHECKPOINT_MARGIN
                    aligned = keep // BLOCK_SIZE * BLOCK_SIZE
                    end = aligned if aligned > done else end
                if job.request.images is not None:
                    end = _whole_images(job.request.images, done, end)
                parts.append((job, job.target[done:end]))
                budget -= len(parts[-1][1])
        # The windowed layers' blocks come as the chunks need them (their pool is sized
        # for every running sequence's window: see _pool_size).
        parts = [
            (j, p) for j, p in parts if self.blocks.grow(j.table, len(j.state.tokens) + len(p))
        ]
        if parts:
            self._prefill(parts)
        decoding = self._grow(
            [j for j in self.active if j.next_token is not None and not j.prefilling]
        )
        if not decoding:
            return
        if len(self.active) == 1 and len(decoding) == 1 and self._speculate(decoding[0]):
            return
        device = self.cache.k.device
        ids = torch.tensor([[j.next_token] for j in decoding], device=device)
        positions = torch.tensor([[len(j.state.tokens)] for j in decoding], device=device)
        try:
            view = self._view(decoding)
            with lora.scaled(self.engine.lora, [j.lora for j in decoding], device):
                logits = self.engine.model(ids, positions, view)
        except Exception as e:
            for job in decoding:
                self._finish(job, e)
            return
        for row, job in enumerate(decoding):
            job.state.tokens.append(job.next_token)
            self._commit(job, job.state.tokens)
            self._keep_state(job)
            try:
                self._advance(job, logits[row, -1])
            except Exception as e:
                self._finish(job, e)

    def _speculate(self, job: Job) -> bool:
        """A round of speculative decoding for the only running sequence: its drafts and
        pending token fed in one forward, the tokens accepted and the model's own after
        them passed on. False, having done nothing, where it does not apply: no
        speculator, a grammar, no room for a draft, or no blocks for the drafts."""
        speculator, state = self.speculator, job.state
        if speculator is None or job.sampler.constraint is not None:
            return False
        count = min(speculator.max_tokens, state.capacity - len(state.tokens) - 1)
        if job.request.max_tokens is not None:  # drafts past the last token asked are wasted
            count = min(count, job.request.max_tokens - job.stream.stats.completion_tokens - 1)
        if count < 1:
            return False
        model, device = self.engine.model, self.cache.k.device

        def forward(fed: list[int]) -> torch.Tensor:
            with lora.scaled(self.engine.lora, [job.lora], device):
                return verify(model, state, self._view([job]), fed)

        start = len(state.tokens)
        try:
            if self._drafting is not job:  # the draft's cache follows this sequence now
                speculator.start([*state.tokens, job.next_token], state.capacity)
                self._drafting = job
            if speculator.room() is not None:  # the draft's ring must not wrap in a round
                count = min(count, speculator.room() - 1)
            if not self.blocks.grow(job.table, start + 1 + count):
                return False
            tokens, rows = speculator.round(
                state,
                job.next_token,
                job.sampler,
                job.history,
                job.stream.stats,
                count,
                model.args.vocab_size,
                forward,
            )
        except Exception as e:
            self._finish(job, e)
            return True
        self._commit(job, state.tokens)
        for i, (token, row) in enumerate(zip(tokens, rows, strict=True)):
            if job.finished or job.cancelled:
                break
            try:
                self._take(job, token, row, start + 1 + i)
            except Exception as e:
                self._finish(job, e)
        return True

    def _grow(self, decoding: list[Job]) -> list[Job]:
        """Give each decoding sequence, oldest first, a block for its next token where
        it needs one, preempting the most recently admitted sequences as needed; the
        sequences still decoding. One that cannot grow with the pool to itself ends
        ("length": the pool is its context)."""
        for job in sorted(decoding, key=lambda j: j.order):
            if job.cancelled or job.finished or job not in self.active:
                continue
            while not self.blocks.grow(job.table, len(job.state.tokens) + 1):
                victim = max(self.active, key=lambda j: j.order)
                if victim is job and len(self.active) == 1:
                    self._finish(job, job.stream.close())
                    break
                self._preempt(victim)
                if victim is job:
                    break
        return [j for j in decoding if j in self.active and not (j.cancelled or j.finished)]

    def _preempt(self, job: Job) -> None:
        """Free a running sequence's blocks and queue it first, to be prefilled again
        with every token it has fed (its full blocks stay cached, for it to find)."""
        if job.cancelled:  # nobody waits for it: it just goes
            self._finish(job, LlmrunError("cancelled"))
            return
        if not job.prefilling:  # past its prompt: what it fed is what to prefill again
            job.target = list(job.state.tokens)
        self.preemptions += 1
        self.blocks.release(job.table)
        self._publish_state(job)
        self._free_slot(job)
        job.table = job.state = None
        with self._cond:
            self.active.remove(job)
            self.waiting.appendleft(job)

    def _prefill(self, parts: list[tuple[Job, list[int]]]) -> None:
        """Feed each job its chunk, those without image tokens in one forward, each with
        them in one of its own (the model places one row's images)."""
        plain, imaged = [], []
        for job, part in parts:
            images = job.request.images
            done = len(job.state.tokens)
            soft = None
            if images is not None:
                soft = _images_from(images, done).tokens(
                    done, done + len(part), self.cache.k.device
                )
            if soft is None:
                plain.append((job, part))
            else:
                imaged.append(((job, part), soft))
        if plain:
            self._prefill_group(plain)
        for part, soft in imaged:
            self._prefill_group([part], soft)

    def _prefill_group(self, parts: list[tuple[Job, list[int]]], images=None) -> None:
        """Feed each job its chunk in one forward (with `images`, the ImageTokens of a
        single job's chunk); a job whose prompt is then complete gets its first token (a
        preempted one already has its next token)."""
        try:
            logits = self._forward_chunks(parts, images)
        except Exception as e:  # a failed forward fails its requests, not the server
            for job, _ in parts:
                self._finish(job, e)
            return
        for (job, _), row in zip(parts, logits, strict=True):
            self._commit(job, job.state.tokens)
            self._keep_state(job)
            if not job.prefilling:
                self._publish_state(job)
            if not job.prefilling and job.next_token is None:
                try:
                    if job.scoring:
                        self._send_prompt_logprobs(job)
                    if job.request.max_tokens == 0:  # only the prompt's logprobs asked for
                        self._finish(job, job.stream.close())
                    else:
                        self._advance(job, row)
                except Exception as e:
                    self._finish(job, e)

    def _send_prompt_logprobs(self, job: Job) -> None:
        scored = [None, *(job.scored[i] for i in range(1, len(job.request.prompt)))]
        job.scored, job.prompt_scored = {}, True
        self._send(job, Response("", None, job.stream.stats, prompt_logprobs=tuple(scored)))

    def _forward_chunks(self, parts: list[tuple[Job, list[int]]], images=None) -> torch.Tensor:
        """One forward for the chunks, rows padded on the right; each row's last
        logits. A padded token repeats its row's last position and is never stored,
        so no real query sees it. `images`: a single chunk's image tokens."""
        width = max(len(part) for _, part in parts)
        ids, positions, counts = [], [], []
        for job, part in parts:
            start = len(job.state.tokens)
            ids.append(part + [part[-1]] * (width - len(part)))
            positions.append([start + min(i, len(part) - 1) for i in range(width)])
            counts.append(len(part))
        device = self.cache.k.device
        padded = any(c < width for c in counts)
        view = self._view([job for job, _ in parts], counts if padded else None)
        last = torch.tensor([c - 1 for c in counts], device=device)
        scoring = any(job.scoring for job, _ in parts)
        extra = {} if images is None else {"images": images}
        with lora.scaled(self.engine.lora, [job.lora for job, _ in parts], device):
            logits = self.engine.model(
                torch.tensor(ids, device=device),
                torch.tensor(positions, device=device),
                view,
                last=None if scoring else last,  # every position's logits, to score prompts
                **extra,
            )
        if images is not None and self.holds_images:
            parts[0][0].image_state = view.images.get(0)  # what the image's forward kept
        for row, (job, part) in enumerate(parts):
            if job.scoring:
                self._score(job, logits[row, : len(part)])
            job.state.tokens.extend(part)
        if scoring:
            return logits[torch.arange(len(parts), device=device), last]
        return logits[:, -1]

    @staticmethod
    def _score(job: Job, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens that `logits` (of the chunk after the
        cached tokens) predict, kept by position until the prompt is done."""
        prompt, start = job.request.prompt, len(job.state.tokens)
        count = min(len(logits), len(prompt) - 1 - start)  # the last predicts no prompt token
        if count <= 0:
            return
        logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
        tokens = torch.tensor(prompt[start + 1 : start + 1 + count], device=logits.device)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        k = min(job.request.prompt_logprobs, logprobs.shape[-1])
        values, ids = torch.topk(logprobs, k) if k else (logprobs[:, :0], logprobs[:, :0])
        for i, (value, top_ids, top_values) in enumerate(
            zip(chosen, ids.tolist(), values.tolist(), strict=True)
        ):
            position = start + 1 + i
            top = list(zip(top_ids, top_values, strict=True))
            job.scored[position] = TokenLogprob(prompt[position], value, top)

    def _view(self, jobs: list[Job], counts: list[int] | None = None):
        """The paged cache as the jobs' rows see it."""
        windows = None
        if self.blocks.window_manager is not None:
            windows = [j.table.window.blocks for j in jobs]
        view = self.cache.view([j.table.full.blocks for j in jobs], counts, windows)
        if self.states is not None:
            view.recurrent = self.states.select([j.slot for j in jobs])
        if self.holds_images:
            view.images = {
                r: j.image_state for r, j in enumerate(jobs) if j.image_state is not None
            }
        # Text after Qwen2-VL's images turns by shifted positions; each row feeds text
        # from its next position on (a chunk with image tokens brings their own).
        shifts = [
            0 if j.request.images is None else j.request.images.shift_at(len(j.state.tokens))
            for j in jobs
        ]
        if any(shifts):
            view.rope_shifts = torch.tensor(shifts, device=self.cache.k.device)
        if self.reference_window is not None:
            ends = [len(j.request.prompt) for j in jobs]
            view.prompt_ends = torch.tensor(ends, device=self.cache.k.device)
        return view

    def _commit(self, job: Job, tokens: list[int]) -> None:
        """Name the job's full blocks of `tokens` for the prefix cache; with a reference
        window only those before its prompt's end plus the window: past it, keys and
        values were computed seeing the window alone, which another prompt's prefill of
        the same tokens does not."""
        if self.reference_window is not None:
            tokens = tokens[: len(job.request.prompt) + self.reference_window]
        self.blocks.commit(job.table, tokens)

    def _advance(self, job: Job, logits: torch.Tensor) -> None:
        """Sample the job's next token from its logits and pass on the text it makes."""
        self._take(job, job.sampler(logits, job.history), logits, len(job.state.tokens))

    def _take(self, job: Job, token: int, logits: torch.Tensor, fed: int) -> None:
        """Pass on the job's next token (drawn from `logits` after `fed` tokens) and the
        text it makes; it ends the job, or is the one to feed next."""
        job.history.append(token)
        response = job.stream.add(token, logits)
        if response is not None:
            self._send(job, response)
        if job.stream.done or fed >= job.state.capacity:
            self._finish(job, job.stream.close())
        else:
            job.next_token = token

    def _send(self, job: Job, event: Event) -> None:
        try:
            job.on_event(event)
        except Exception:  # nobody is listening any more
            job.cancelled = True

    def _finish(self, job: Job, event: Event) -> None:
        if job.finished:
            return
        job.finished = True
        job.next_token = None
        with self._cond:
            self._release(job)
        self._send(job, event)

    def _release(self, job: Job) -> None:
        if job.table is not None:
            self.blocks.release(job.table)
            job.table = None
            self._publish_state(job)
        self._free_slot(job)
        if job in self.active:
            self.active.remove(job)

    def _free_slot(self, job: Job) -> None:
        if job.slot is not None:
            self.free_slots.append(job.slot)
            job.slot = None

    def _keep_state(self, job: Job) -> None:
        """At a block end, copy a hybrid model's sequence state aside, to be kept under
        that block's name for the prefix cache when its prompt is done or it leaves
        (_publish_state): a later prompt that starts with its tokens goes on from there.
        Two states per sequence are kept so, the prompt's and the last one, since a chat
        template may write the answer back otherwise (without its reasoning) next turn."""
        if self.snapshots is None:
            return
        n, names = len(job.state.tokens), job.table.full.names
        if n == 0 or n % BLOCK_SIZE or len(names) < n // BLOCK_SIZE:
            return
        copy_row(self.states, job.slot, self.pending, job.slot)
        self.pending_names[job.slot] = names[n // BLOCK_SIZE - 1]

    def _publish_state(self, job: Job) -> None:
        if self.snapshots is None or job.slot is None:
            return
        name = self.pending_names[job.slot]
        if name is not None:
            self.snapshots.put(name, self.pending, job.slot)
            self.pending_names[job.slot] = None


def _image_salts(request: Request) -> dict[int, bytes]:
    """The salts of a request's blocks: each image's digest at the block its span begins
    in (several in one block: joined in order)."""
    images = request.images
    if images is None:
        if request.image_digests:
            raise ValueError("image digests without images")
        return {}
    if len(request.image_digests) != len(images.embeds):
        raise ValueError(
            f"{len(request.image_digests)} image digests for {len(images.embeds)} images"
        )
    salts: dict[int, bytes] = {}
    begins = [a for a, _ in images.spans()]  # Llama 3.2 Vision's spans begin before it
    for begin, digest in zip(begins, request.image_digests, strict=True):
        index = begin // BLOCK_SIZE
        salts[index] = salts.get(index, b"") + digest
    salt = images.salt()  # what else the images' keys and values depend on
    if salt:
        salts[begins[0] // BLOCK_SIZE] += salt
    return salts


def _whole_images(images: PromptImages, done: int, end: int) -> int:
    """A chunk's end (`done` tokens fed) moved out of an image it would split: back to
    the image's start where the chunk keeps a token, else on to its end."""
    for a, b in images.wholes():
        if a < end < b:
            return a if a > done else b
    return end


def _images_from(images: PromptImages, begin: int) -> PromptImages:
    """The images from prompt position `begin` on, one that began before cut to its rest
    (a reused prefix may end inside an image); of the same kind (Qwen2-VL's keep their
    prompt's M-RoPE positions)."""
    if all(a >= begin for a, _ in images.spans()):
        return images  # none began before
    embeds, starts = [], []
    for (a, b), embed in zip(images.spans(), images.embeds, strict=True):
        if b > begin:
            cut = max(begin - a, 0)
            embeds.append(embed[cut:])
            starts.append(a + cut)
    return replace(images, embeds=embeds, starts=starts)

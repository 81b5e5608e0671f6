"""The scheduler over a paged KV pool, on the bundled stories260K: prefix hits and
misses, results identical with and without the prefix cache and to the
single-sequence loop, pool exhaustion and preemption, cancellation, refusals, and
block accounting that returns to zero after every test."""

import queue
import threading
import time

import pytest
import torch

from llmrun import api
from llmrun.batching import FOLLOW_MIN, Request, Scheduler
from llmrun.errors import ContextOverflowError, UsageError
from llmrun.kv_blocks import BLOCK_SIZE
from llmrun.models.paged import PagedKVCache
from llmrun.sampling import SamplingParams

ENGINE = api.load(None, device="cpu", ctx_size=256)
GREEDY = SamplingParams(temperature=0)
BLOCK_BYTES = PagedKVCache.block_bytes(ENGINE.new_cache(1, 1), BLOCK_SIZE)
STORY = (
    "Once upon a time there was a little girl named Lily. She liked to play in the park "
    "with her dog Max. One day"
)


def encode(text):
    return ENGINE.tokenizer.encode(text)


NO_EOS = api.Engine(**{**ENGINE.__dict__, "eos_ids": []})


def alone(prompt, params, max_tokens, ignore_eos=False):
    """Text and finish reason of `llmrun run`'s single-sequence loop."""
    engine = NO_EOS if ignore_eos else ENGINE
    responses = list(engine.generate(prompt, params, max_tokens))
    return "".join(r.text for r in responses), responses[-1].finish_reason


class Collector:
    def __init__(self):
        self.events = queue.Queue()
        self.first = threading.Event()

    def __call__(self, event):
        self.events.put(event)
        self.first.set()

    def result(self, timeout=600):
        """(text, finish reason, final stats, the tokens that made the text). The
        first request of a session may build the native kernels: minutes on a busy
        machine."""
        pieces, tokens = [], []
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, Exception):
                raise event
            pieces.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
            if event.finish_reason is not None:
                return "".join(pieces), event.finish_reason, event.stats, tokens


def run(scheduler, prompt, max_tokens, params=GREEDY, **options):
    collector = Collector()
    scheduler.submit(Request(prompt, params, max_tokens, **options), collector)
    return collector.result()


def idle(scheduler):
    deadline = time.monotonic() + 600
    while scheduler.active or scheduler.waiting:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def make():
    """Started schedulers; each must end with every block free and nothing running."""
    made = []

    def start(**options):
        s = Scheduler(ENGINE, **{"parallel": 4, "queue": 8, **options})
        s.start()
        made.append(s)
        return s

    yield start
    for s in made:
        idle(s)
        assert s.blocks.used == 0
        s.close()


def test_a_repeated_prompt_reuses_its_full_blocks(make):
    s = make()
    prompt = encode(STORY)
    assert len(prompt) > 2 * BLOCK_SIZE
    first = run(s, prompt, 20)
    second = run(s, prompt, 20)
    assert first[2].prompt_processed == len(prompt)  # a miss: nothing cached yet
    cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second[2].prompt_processed == len(prompt) - cached
    assert first[:2] == second[:2] == alone(prompt, GREEDY, 20)


def test_a_prompt_that_differs_early_misses(make):
    s = make()
    prompt = encode(STORY)
    run(s, prompt, 5)
    other = encode("Twice " + STORY)
    assert other[:3] != prompt[:3]
    assert run(s, other, 5)[2].prompt_processed == len(other)


def test_a_conversation_gives_the_same_text_with_and_without_the_prefix_cache(make):
    """Three turns, each prompt the whole conversation so far: turn 2 and 3 reuse
    the blocks of the previous turn's prompt and reply (which was decoded one token
    at a time), and every reply is the one a cold cache gives, and `run`'s."""
    cached, cold = make(), make(prefix_cache=False)
    conversation = encode(STORY)
    hits = []
    for turn in range(3):
        warm = run(cached, conversation, 24)
        assert warm[:2] == run(cold, conversation, 24)[:2] == alone(conversation, GREEDY, 24)
        hits.append(len(conversation) - warm[2].prompt_processed)
        user = ENGINE.tokenizer.encode(f" Then {turn} more.", add_bos=False)
        conversation = conversation + warm[3] + user
    assert hits[0] == 0 and hits[1] > 2 * BLOCK_SIZE and hits[2] > hits[1]
    assert cold.blocks.cached_blocks == 0


def test_a_prefix_shared_by_running_requests(make):
    s = make()
    system = encode(STORY)
    holder = Collector()
    job = s.submit(Request(system, GREEDY, 150, ignore_eos=True), holder)
    assert holder.first.wait(600)  # its prompt's blocks are named now, and held
    suffixes = [ENGINE.tokenizer.encode(t, add_bos=False) for t in (" The dog ran.", " A cat.")]
    results = [run(s, system + suffix, 15) for suffix in suffixes]
    assert not job.finished  # the blocks were shared with a running sequence
    shared = len(system) // BLOCK_SIZE * BLOCK_SIZE
    for suffix, (reply, finish, stats, _) in zip(suffixes, results, strict=True):
        prompt = system + suffix
        assert stats.prompt_processed == len(prompt) - shared
        assert (reply, finish) == alone(prompt, GREEDY, 15)
    assert holder.result()[:2] == alone(system, GREEDY, 150, ignore_eos=True)


def test_requests_arriving_together_prefill_their_shared_prefix_once():
    """Three requests with one long prefix arrive at once (as `n` choices, or agents
    with one system prompt): the first computes it, the others wait a step and reuse
    its blocks (before, all three computed it). An unrelated request does not wait."""
    s = Scheduler(ENGINE, parallel=4, queue=8)
    prefix = encode(STORY * 4)
    assert len(prefix) - len(prefix) % BLOCK_SIZE >= FOLLOW_MIN
    prompts = [prefix + ENGINE.tokenizer.encode(t, add_bos=False) for t in (" A", " B", " A")]
    prompts.insert(1, encode("Tom and his dog went to the park."))
    collectors = [Collector() for _ in prompts]
    jobs = [s.submit(Request(p, GREEDY, 10), c) for p, c in zip(prompts, collectors, strict=True)]
    s.start()
    try:
        results = [c.result() for c in collectors]
    finally:
        idle(s)
        s.close()
    processed = [stats.prompt_processed for _, _, stats, _ in results]

    def reused(prompt):  # the whole blocks it shares with the first prompt
        pairs = enumerate(zip(prompt, prompts[0], strict=False))
        same = next((i for i, (a, b) in pairs if a != b), len(prompt))
        return min(same, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE

    assert reused(prompts[2]) >= len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    assert processed == [len(prompts[0]), len(prompts[1])] + [
        len(p) - reused(p) for p in prompts[2:]
    ]
    assert [job.order for job in jobs] == [1, 2, 3, 4]  # the unrelated one went first
    for prompt, (text, finish, _, _) in zip(prompts, results, strict=True):
        assert (text, finish) == alone(prompt, GREEDY, 10)


def test_prompt_logprobs_over_several_chunks_and_a_cached_prefix(make):
    """Prompt logprobs (echo) of a prompt prefilled in chunks of 32, whose prefix is
    cached by another request: computed whole, equal to transformers' within 1e-4."""
    transformers = pytest.importorskip("transformers")
    from helpers import STORIES_HF

    s = make(prefill_budget=32)
    prompt = encode(STORY * 2)
    run(s, prompt, 2)  # caches the prompt's blocks, which scoring must not take
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    collector = Collector()
    s.submit(Request(prompt, GREEDY, 0, prompt_logprobs=0), collector)
    scored = collector.events.get(timeout=600)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    got = [lp.logprob for lp in scored.prompt_logprobs[1:]]
    want = [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)
    assert all(lp.top == [] for lp in scored.prompt_logprobs[1:])
    _, finish, stats, tokens = collector.result()
    assert (finish, stats.completion_tokens, tokens) == ("length", 0, [])
    assert stats.prompt_processed == len(prompt)


def test_an_exhausted_pool_preempts_the_latest_and_recomputes_it(make):
    # 10 blocks (160 positions) for four sequences that grow to ~90 positions each.
    s = make(kv_memory=10 * BLOCK_BYTES)
    prompts = [encode(text) for text in ("Once upon a time", "The little dog", "Lily saw", "Tom")]
    collectors = []
    for prompt in prompts:
        collectors.append(Collector())
        s.submit(Request(prompt, GREEDY, 80, ignore_eos=True), collectors[-1])
    for prompt, collector in zip(prompts, collectors, strict=True):
        text, finish, stats, _ = collector.result()
        assert (text, finish) == alone(prompt, GREEDY, 80, ignore_eos=True)
        assert stats.completion_tokens == 80
    assert s.preemptions > 0


def test_a_sequence_alone_in_a_full_pool_ends_with_length(make):
    s = make(kv_memory=4 * BLOCK_BYTES, parallel=1)  # 64 positions
    prompt = encode("Once upon a time")
    text, finish, stats, _ = run(s, prompt, None, ignore_eos=True)
    assert finish == "length" and stats.completion_tokens == 4 * BLOCK_SIZE - len(prompt) + 1
    assert s.preemptions == 0


def test_a_prompt_larger_than_the_pool_is_refused_with_the_sizes(make):
    s = make(kv_memory=2 * BLOCK_BYTES)
    prompt = encode(STORY)
    with pytest.raises(ContextOverflowError) as e:
        s.submit(Request(prompt, GREEDY, 5), Collector())
    blocks = -(-len(prompt) // BLOCK_SIZE)
    assert str(e.value) == (
        f"the prompt is {len(prompt)} tokens, {blocks} KV blocks of {BLOCK_SIZE}, but the KV "
        f"pool holds 2 blocks ({2 * BLOCK_SIZE} tokens); shorten the prompt or raise --kv-memory"
    )


def test_too_little_kv_memory_for_one_block_is_refused():
    with pytest.raises(UsageError, match=f"one block of 16 tokens takes {BLOCK_BYTES} bytes"):
        Scheduler(ENGINE, kv_memory=BLOCK_BYTES - 1)


def test_cancelling_frees_the_blocks(make):
    s = make()
    collector = Collector()
    job = s.submit(Request(encode(STORY), GREEDY, 200, ignore_eos=True), collector)
    assert collector.first.wait(600)
    assert s.blocks.used > 0
    s.cancel(job)
    idle(s)
    assert s.blocks.used == 0 and s.blocks.cached_blocks > 0  # its prompt stays cached


def test_the_default_pool_holds_two_contexts_per_sequence():
    s = Scheduler(ENGINE, parallel=3)
    assert s.blocks.n_blocks == 2 * 3 * 256 // BLOCK_SIZE
    assert s.cache.nbytes == s.blocks.n_blocks * BLOCK_BYTES

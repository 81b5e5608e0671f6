"""A Gemma chat end to end: Gemma's template around the conversation, <end_of_turn>
ending generation, and a second turn that reuses the KV cache of the first past the
sliding window (5 here) replying exactly as a fresh session does."""

import pytest
import torch
from helpers import GEMMA_TURN_TOKENS, gemma_chat_model_dir, needs_templates

from llmrun import api
from llmrun.chat import ChatSession, Turn
from llmrun.generate import Stats, TokenStream
from llmrun.sampling import SamplingParams

pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = gemma_chat_model_dir(tmp_path_factory.mktemp("gemma") / "chat")
    return api.load(str(path), device="cpu")


@needs_templates
def test_the_template_and_end_of_turn(engine):
    start, end = (engine.tokenizer.encode(t) for t in GEMMA_TURN_TOKENS)
    assert (start, end) == ([512], [513])
    assert 513 in engine.eos_ids  # the tokenizer's end-of-turn, beside eos_token_id 2
    text = engine.render([{"role": "user", "content": " Hi there \n"}])
    assert text == "<s><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    stream = TokenStream(engine.tokenizer, [1], Stats(), eos_ids=engine.eos_ids)
    assert stream.add(513, torch.zeros(514)) is None and stream.done
    assert stream.close().finish_reason == "stop"


@needs_templates
def test_a_second_turn_reuses_the_cache_and_replies_as_a_fresh_session(engine):
    # No newlines (stories260K's <0x0A>, id 13): Gemma's template trims the reply, so a
    # reply of newlines is not what the cache holds, and with 6 stale tokens past the
    # shared prefix the window of 5 has nothing left to reuse (KVCache.reusable).
    greedy = SamplingParams(temperature=0.0, logit_bias=((13, -100.0),))
    session = ChatSession(engine, greedy, max_tokens=6)
    first = "".join(session.send("Once upon a time there was a little dog"))
    turn = Turn()
    second = "".join(session.send("What did the dog do next?", turn))
    stats = turn.response.stats
    assert stats.prompt_tokens > 30  # far past the window of 5
    assert stats.prompt_processed < stats.prompt_tokens - 20  # the first turn came from the cache
    fresh = ChatSession(engine, greedy, max_tokens=6)
    fresh.messages = [
        {"role": "user", "content": "Once upon a time there was a little dog"},
        {"role": "assistant", "content": first},
    ]
    assert "".join(fresh.send("What did the dog do next?")) == second


def drain(events) -> tuple[list[int], object]:
    """A served request's tokens and its last event, from the queue its events go to."""
    tokens = []
    while True:
        event = events.get(timeout=120)
        if isinstance(event, Exception):
            raise event
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            return tokens, event


@needs_templates
def test_served_requests_batched_past_the_window_reply_as_alone(engine):
    """serve's scheduler: several prompts longer than the window, prefilled in chunks
    of 4 (several rows padded together) and decoded together in recycled slots, each
    replying what it replies alone."""
    import queue

    from llmrun.batching import Request, Scheduler

    prompts = [
        engine.tokenizer.encode(engine.render([{"role": "user", "content": text}]))
        for text in ("Once upon a time", "The little dog ran", "Lily and Tom went to the park")
    ] * 2
    alone = [
        [r.token for r in engine.generate(p, GREEDY, 8) if r.token is not None] for p in prompts
    ]
    scheduler = Scheduler(engine, parallel=2, queue=8, prefill_budget=4)
    scheduler.start()
    try:
        results = []
        for prompt in prompts:
            events = queue.Queue()
            scheduler.submit(Request(prompt, GREEDY, 8), events.put)
            results.append(events)
        batched = [drain(events)[0] for events in results]
    finally:
        scheduler.close()
    assert batched == alone


def test_served_turns_reuse_the_prefix_and_the_windowed_pool_holds_only_windows(engine):
    """serve's scheduler with the sliding-window layers in a pool of their own: each
    turn of a conversation (the whole conversation as its prompt) reuses the previous
    one's blocks and replies as a cold cache and `run` do, while each running
    sequence holds at most its window (and a prefill chunk) of windowed blocks."""
    import queue

    from llmrun.batching import Request, Scheduler
    from llmrun.kv_blocks import blocks_for

    def serve(scheduler, prompt):
        events, held = queue.Queue(), []

        def on_event(event):
            held.append(scheduler.blocks.window_manager.used)
            events.put(event)

        scheduler.submit(Request(prompt, GREEDY, 40, ignore_eos=True), on_event)
        tokens, last = drain(events)
        return tokens, last.stats, max(held)

    no_eos = api.Engine(**{**engine.__dict__, "eos_ids": []})
    warm = Scheduler(engine, parallel=2, queue=8, prefill_budget=8)
    cold = Scheduler(engine, parallel=2, queue=8, prefill_budget=8, prefix_cache=False)
    assert warm.blocks.window == 5 and warm.cache.window_k is not None
    warm.start()
    cold.start()
    try:
        conversation = engine.tokenizer.encode("Once upon a time there was a little dog")
        hits = []
        for _ in range(3):
            tokens, stats, held = serve(warm, conversation)
            assert held <= blocks_for(5 + 8) + 1  # one sequence's window and a chunk
            alone = [r.token for r in no_eos.generate(conversation, GREEDY, 40)]
            assert tokens == serve(cold, conversation)[0] == [t for t in alone if t is not None]
            hits.append(stats.prompt_tokens - stats.prompt_processed)
            conversation = conversation + tokens + engine.tokenizer.encode(" Then", add_bos=False)
        assert hits[0] == 0 and hits[1] >= 32 and hits[2] > hits[1]
    finally:
        warm.close()
        cold.close()
    assert warm.blocks.used == warm.blocks.window_manager.used == 0


def test_kv_memory_too_small_for_the_windows_is_refused_with_the_sizes(engine):
    from llmrun.batching import Scheduler
    from llmrun.errors import UsageError

    with pytest.raises(UsageError) as refused:
        Scheduler(engine, parallel=2, kv_memory=1 << 20)
    assert str(refused.value) == (
        "--kv-memory 1048576 bytes holds no KV block after 2785280 bytes for the "
        "sliding-window layers' blocks (68 blocks for 2 sequences): one block of 16 "
        "tokens takes 8192 bytes for this model"
    )


def test_served_requests_preempted_for_blocks_reply_as_alone(engine):
    """Three requests of 50-odd positions over 7 blocks of 16 for the full layer: the
    latest is preempted as the others grow, prefilled again past its window (what its
    windowed layers let go of comes back from its cached blocks or is recomputed), and
    each replies what it replies alone."""
    import queue
    import time

    from llmrun.batching import Request, Scheduler
    from llmrun.models.paged import PagedKVCache

    no_eos = api.Engine(**{**engine.__dict__, "eos_ids": []})
    texts = ("Once upon a time there was a little dog named Max who",
             "The little dog ran to the park and saw", "Lily and Tom went to the park to play with")  # fmt: skip
    prompts = [engine.tokenizer.encode(t) for t in texts]
    alone = [[r.token for r in no_eos.generate(p, GREEDY, 40)] for p in prompts]
    like = engine.new_cache(1, 1)
    full, windowed = (PagedKVCache.block_bytes(like, 16, range(n)) for n in (1, 5))
    # The windowed pool: 2 x 3 sequences x (blocks of a window and a chunk, and one).
    scheduler = Scheduler(
        engine, parallel=3, queue=8, prefill_budget=8, kv_memory=12 * windowed + 7 * full
    )
    assert (scheduler.blocks.n_blocks, scheduler.blocks.window_manager.n_blocks) == (7, 12)
    scheduler.start()
    try:
        events = []
        for prompt in prompts:
            events.append(queue.Queue())
            scheduler.submit(Request(prompt, GREEDY, 40, ignore_eos=True), events[-1].put)
        replies = [drain(e)[0] for e in events]
        deadline = time.monotonic() + 60
        while scheduler.active and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.close()
    assert scheduler.preemptions > 0
    assert replies == [[t for t in a if t is not None] for a in alone]
    assert scheduler.blocks.used == scheduler.blocks.window_manager.used == 0

"""The batching scheduler on the bundled stories260K: batched decoding gives each
sequence what it gets alone, slots are freed and reused, the queue is bounded."""

import queue
import threading

import pytest
import torch
from helpers import STORY_PROMPTS

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.errors import ContextOverflowError, ServerBusyError
from llmrun.sampling import SamplingParams

ENGINE = api.load(None, device="cpu", ctx_size=256)
GREEDY = SamplingParams(temperature=0)


def encode(text):
    return ENGINE.tokenizer.encode(text)


def alone(prompt, params, max_tokens, **options):
    """Text and finish reason of `llmrun run`'s single-sequence loop."""
    responses = list(ENGINE.generate(prompt, params, max_tokens, **options))
    return "".join(r.text for r in responses), responses[-1].finish_reason


class Collector:
    """Events of one request, gathered from the scheduler thread."""

    def __init__(self):
        self.events = queue.Queue()

    def __call__(self, event):
        self.events.put(event)

    def result(self, timeout=60):
        pieces = []
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, Exception):
                raise event
            pieces.append(event.text)
            if event.finish_reason is not None:
                return "".join(pieces), event.finish_reason


@pytest.fixture
def scheduler():
    s = Scheduler(ENGINE, parallel=4, queue=8)
    s.start()
    yield s
    s.close()


def test_batched_decode_gives_each_row_its_own_logits():
    # Three sequences of different lengths in scattered slots of a 5-row cache,
    # decoded in one forward, against each decoded alone in a cache of its own.
    model = ENGINE.model
    cache = model.new_cache(5, 64, torch.float32, "cpu")
    slots = [4, 1, 2]
    prompts = [encode(p) for p in STORY_PROMPTS[:3]]
    with torch.inference_mode():
        for slot, prompt in zip(slots, prompts, strict=True):
            ids, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
            model(ids, positions, cache.select([slot]))
        next_ids = torch.tensor([[7], [8], [9]])
        positions = torch.tensor([[len(p)] for p in prompts])
        batched = model(next_ids, positions, cache.select(slots))[:, -1]
        for row, prompt in enumerate(prompts):
            own = model.new_cache(1, 64, torch.float32, "cpu")
            sequence = prompt + [7 + row]
            single = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], own)
            torch.testing.assert_close(batched[row], single[0, -1], atol=1e-4, rtol=0)


def test_concurrent_requests_equal_single_sequence_runs():
    # Greedy and seeded sampling, stop strings and penalties: each request's text is
    # what the single-sequence loop makes of it, whatever it was batched with. All
    # are queued before the scheduler starts, so the first four prompts (of different
    # lengths) are prefilled together in one padded forward; the others join as
    # slots free up.
    scheduler = Scheduler(ENGINE, parallel=4, queue=8)
    cases = [
        (encode(p), GREEDY if i % 2 else SamplingParams(seed=i, temperature=0.9), 30 + 5 * i)
        for i, p in enumerate(STORY_PROMPTS)
    ]
    cases.append((encode("Once upon a time"), GREEDY, 100, ["girl named"]))
    penalized = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5)
    cases.append((encode("The cat sat"), penalized, 40))
    collectors = []
    for prompt, params, max_tokens, *stop in cases:
        collectors.append(Collector())
        request = Request(prompt, params, max_tokens, stop[0] if stop else ())
        scheduler.submit(request, collectors[-1])
    scheduler.start()
    try:
        for (prompt, params, max_tokens, *stop), collector in zip(cases, collectors, strict=True):
            expected = alone(prompt, params, max_tokens, stop=stop[0] if stop else ())
            assert collector.result() == expected
        assert scheduler.blocks.used == 0 and not scheduler.active
    finally:
        scheduler.close()


def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding():
    s = Scheduler(ENGINE, parallel=2, prefill_budget=16)
    s.start()
    try:
        long_prompt = encode(" ".join(["Once upon a time there was a cat."] * 12))
        assert len(long_prompt) > 4 * s.prefill_budget
        short, long_ = Collector(), Collector()
        s.submit(Request(encode("The dog"), GREEDY, 40), short)
        s.submit(Request(long_prompt, GREEDY, 10), long_)
        assert short.result() == alone(encode("The dog"), GREEDY, 40)
        assert long_.result() == alone(long_prompt, GREEDY, 10)
    finally:
        s.close()


def test_cancel_frees_the_slot_for_the_next_request():
    s = Scheduler(ENGINE, parallel=1, queue=1)
    s.start()
    try:
        first_token = threading.Event()
        events = []

        def on_event(event):
            events.append(event)
            first_token.set()

        job = s.submit(Request(encode("Once upon a time"), GREEDY, 200, ignore_eos=True), on_event)
        assert first_token.wait(30)
        s.cancel(job)
        nxt = Collector()
        s.submit(Request(encode("The dog"), GREEDY, 20), nxt)
        assert nxt.result() == alone(encode("The dog"), GREEDY, 20)
        assert len(events) < 200 and all(e.finish_reason is None for e in events)
    finally:
        s.close()


def test_the_queue_is_bounded():
    s = Scheduler(ENGINE, parallel=2, queue=1)  # not started: nothing leaves the queue
    for _ in range(3):
        s.submit(Request(encode("Hi"), GREEDY, 5), Collector())
    with pytest.raises(ServerBusyError, match="all 2 slots are busy and the queue of 1 is full"):
        s.submit(Request(encode("Hi"), GREEDY, 5), Collector())
    s.close()


def test_a_prompt_over_the_context_is_refused():
    s = Scheduler(ENGINE, parallel=1)
    with pytest.raises(ContextOverflowError, match="300 tokens, but the context holds 256"):
        s.submit(Request(list(range(1, 301)), GREEDY, 5), Collector())


def test_a_full_context_ends_with_length(scheduler):
    prompt = encode("Once upon a time")
    collector = Collector()
    scheduler.submit(Request(prompt, GREEDY, None, ignore_eos=True), collector)
    no_eos = api.Engine(**{**ENGINE.__dict__, "eos_ids": []})
    responses = list(no_eos.generate(prompt, GREEDY, None))
    assert collector.result() == ("".join(r.text for r in responses), "length")
    assert responses[-1].stats.completion_tokens == 256 - len(prompt) + 1

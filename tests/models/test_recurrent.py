"""Recurrent layers' state (llmrun.models.recurrent) and where it meets the KV cache,
`run`'s prefix reuse and the server's scheduler, on a toy hybrid model: the bundled
stories260K with every other layer's attention swapped for a running average, a
recurrence whose output depends on every token before it. Whatever path a sequence
takes (whole, chunked, continued, restarted, batched and padded, served beside others),
its logits are those of one whole forward."""

import queue

import pytest
import torch
from helpers import STORY_PROMPTS, TEMPLATES_DIR, needs_templates
from torch import nn

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.chat import ChatSession, Turn
from llmrun.chat_template import ChatTemplate
from llmrun.generate import CHECKPOINT_MARGIN, KVState, prefill, reuse_prefix, stream_generate
from llmrun.models.cache import KVCache
from llmrun.models.recurrent import RecurrentState
from llmrun.sampling import Sampler, SamplingParams

ENGINE = api.load(None, device="cpu", ctx_size=256)


class RunningAverage(nn.Module):
    """s_t = a * s_{t-1} + (1 - a) * x_t per feature, out = proj(s): a state of [hidden]."""

    def __init__(self, hidden: int, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.decay = nn.Parameter(torch.rand(hidden) * 0.8 + 0.1)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, frame, cache):
        batch, tokens, hidden = x.shape
        if cache is None:
            state, counts = x.new_zeros(batch, hidden), torch.full((batch,), tokens)
        else:
            (state,), counts = cache.recurrent.read(self.layer), frame.counts
        outputs = []
        for t in range(tokens):
            moved = self.decay * state + (1 - self.decay) * x[:, t]
            state = torch.where((t < counts)[:, None], moved, state)  # padding: unchanged
            outputs.append(state)
        if cache is not None:
            cache.recurrent.write(self.layer, [state])
        return self.proj(torch.stack(outputs, dim=1))


class Hybrid(type(ENGINE.model)):
    """stories260K with the attention of layers 1, 3, ... replaced by RunningAverage."""

    def __init__(self, source: nn.Module) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(source.__dict__)
        self.decode_step = None  # the native step runs attention in every layer
        torch.manual_seed(0)
        self.attention_layers = []
        for i, layer in enumerate(self.model.layers):
            if i % 2:
                layer.self_attn = RunningAverage(self.args.hidden_size, i)
            else:
                layer.self_attn.layer = len(self.attention_layers)
                self.attention_layers.append(i)

    def new_cache(self, batch, max_seq_len, dtype, device):
        args = self.args
        cache = KVCache(
            len(self.attention_layers), batch, args.num_key_value_heads, max_seq_len,
            args.head_dim, dtype, device,
        )  # fmt: skip
        recurrent = [i for i in range(args.num_hidden_layers) if i % 2]
        shapes = {i: [(args.hidden_size,)] for i in recurrent}
        cache.recurrent = RecurrentState(shapes, batch, torch.float32, device)
        return cache

    def frame(self, positions, cache, dtype, last=None):
        frame = super().frame(positions, cache, dtype, last)
        if cache is not None:
            frame.counts = cache.recurrent.begin(positions)
        return frame


MODEL = Hybrid(api.load(None, device="cpu").model).eval()
HYBRID = api.Engine(**{**ENGINE.__dict__, "model": MODEL})
GREEDY = SamplingParams(temperature=0)
IDS = ENGINE.tokenizer.encode(STORY_PROMPTS[0] + " and then the dog ran to the park")


def whole(ids):
    """Logits [T, V] of one forward without a cache."""
    with torch.inference_mode():
        return MODEL(torch.tensor([ids]), torch.arange(len(ids))[None])[0]


def test_the_toy_recurrence_matters():
    # A token early in the sequence changes the last logits through the state alone
    # (the attention layers see it too, so compare against the model without state).
    changed = [IDS[0] + 1] + IDS[1:]
    assert not torch.allclose(whole(IDS)[-1], whole(changed)[-1])


def test_chunked_prefill_and_decode_continue_the_state():
    reference = whole(IDS)
    state = HYBRID.new_state(64)
    with torch.inference_mode():
        logits = prefill(MODEL, state, IDS[:5], chunk=2)
        torch.testing.assert_close(logits, reference[4], atol=1e-4, rtol=0)
        for i in range(5, len(IDS)):
            positions = torch.tensor([[i]])
            out = MODEL(torch.tensor([[IDS[i]]]), positions, state.cache)[0, -1]
            torch.testing.assert_close(out, reference[i], atol=1e-4, rtol=0)
            state.tokens.append(IDS[i])


def test_a_prefix_is_reused_only_where_the_state_ends_there():
    state = HYBRID.new_state(64)
    with torch.inference_mode():
        prefill(MODEL, state, IDS[:8])
        # The next turn continues exactly where the state ends: all 8 are kept.
        assert reuse_prefix(state, IDS[:8] + [5, 6]) == 8
        # A shorter shared prefix: the state has taken in more than it, start again.
        assert reuse_prefix(state, IDS[:6] + [5, 6]) == 0
        assert state.tokens == []
        prompt = IDS[:6] + [5, 6]
        logits = prefill(MODEL, state, prompt)
    torch.testing.assert_close(logits, whole(prompt)[-1], atol=1e-4, rtol=0)


def test_a_chat_turn_goes_on_from_the_state_kept_before_the_prompt_end():
    # The next prompt agrees with the last one up to a few tokens before its end (a
    # template that writes the answer back without what its generation prompt added):
    # it goes on from the state kept there, CHECKPOINT_MARGIN tokens before the end.
    state = HYBRID.new_state(96)
    sampler = Sampler(GREEDY)
    first = (IDS * 2)[:20]
    replies = list(stream_generate(MODEL, ENGINE.tokenizer, state, first, sampler, 8))
    assert len(state.tokens) > 20  # the prompt and the answer it fed
    follow_up = first[: 20 - CHECKPOINT_MARGIN] + ENGINE.tokenizer.encode(" The end. Then")
    replies = list(stream_generate(MODEL, ENGINE.tokenizer, state, follow_up, sampler, 8))
    assert replies[-1].stats.prompt_processed == len(follow_up) - (20 - CHECKPOINT_MARGIN)
    assert "".join(r.text for r in replies) == alone(follow_up, 8)
    # A prompt that agrees with neither starts again from position 0, and drops the
    # state kept of the tokens it held before: a prompt too short to keep one of its
    # own, then one that agrees with what it held past where that state was kept.
    other = IDS[:3] + [9]
    replies = list(stream_generate(MODEL, ENGINE.tokenizer, state, other, sampler, 24))
    assert replies[-1].stats.prompt_processed == len(other)
    assert len(state.tokens) > 20
    again = state.tokens[:20] + [5]
    replies = list(stream_generate(MODEL, ENGINE.tokenizer, state, again, sampler, 8))
    assert replies[-1].stats.prompt_processed == len(again)
    assert "".join(r.text for r in replies) == alone(again, 8)


@needs_templates
def test_a_chat_turn_goes_on_from_the_end_of_the_conversation_so_far():
    # Qwen3.5's template without thinking ends its generation prompt with
    # `<think>\n\n</think>\n\n`, which it does not write back with the answer: the next
    # prompt agrees with this one only up to the conversation's end before that prompt,
    # further back than CHECKPOINT_MARGIN tokens (of stories260K's plain-text pieces here).
    # The session keeps the state there.
    template = ChatTemplate((TEMPLATES_DIR / "Qwen3.5-4B.jinja").read_text())
    engine = api.Engine(**{**HYBRID.__dict__, "template": template})
    session = ChatSession(engine, GREEDY, max_tokens=6, switches={"enable_thinking": False})
    list(session.send("Tell me a story."))
    first = session.prompt_ids(session.conversation(session.messages[:1]))
    kept = engine.history_end(session.messages[:1], first, enable_thinking=False)
    assert kept is not None and kept < len(first) - CHECKPOINT_MARGIN
    turn = Turn()
    reply = "".join(session.send("And then?", turn))
    prompt = session.prompt_ids(session.conversation(session.messages[:-1]))
    assert turn.response.stats.prompt_processed == len(prompt) - kept
    assert reply == alone(prompt, 6)


def test_a_forward_that_skips_ahead_is_refused():
    state = HYBRID.new_state(64)
    with torch.inference_mode():
        prefill(MODEL, state, IDS[:4])
        with pytest.raises(RuntimeError, match="recurrent state row 0 holds 4 tokens"):
            MODEL(torch.tensor([[1]]), torch.tensor([[6]]), state.cache)


def test_padded_rows_in_scattered_slots_keep_their_own_state():
    # Three sequences of different lengths padded on the right as the server pads them
    # (a padded token repeats its row's last position), in slots 3, 0, 2 of a 4-row
    # cache, then one decode step each.
    prompts = [IDS[:9], IDS[:4], IDS[2:8]]
    slots = [3, 0, 2]
    cache = MODEL.new_cache(4, 64, torch.float32, "cpu")
    width = max(len(p) for p in prompts)
    ids = [p + [p[-1]] * (width - len(p)) for p in prompts]
    positions = [[min(i, len(p) - 1) for i in range(width)] for p in prompts]
    with torch.inference_mode():
        view = cache.select(slots)
        MODEL(torch.tensor(ids), torch.tensor(positions), view)
        step = MODEL(torch.tensor([[7]] * 3), torch.tensor([[len(p)] for p in prompts]), view)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(step[row, -1], whole(prompt + [7])[-1], atol=1e-4, rtol=0)


def serve(scheduler, prompts, max_tokens=20):
    """Each prompt's greedy (text, tokens, stats), served together by `scheduler`."""
    sinks = [queue.Queue() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):
        scheduler.submit(Request(prompt, GREEDY, max_tokens), sink.put)
    results = []
    for sink in sinks:
        events = []
        while not events or events[-1].finish_reason is None:
            events.append(sink.get(timeout=60))
            assert not isinstance(events[-1], Exception), events[-1]
        text = "".join(e.text for e in events)
        results.append((text, [e.token for e in events if e.token is not None], events[-1].stats))
    return results


def alone(prompt, max_tokens=20):
    return "".join(r.text for r in HYBRID.generate(prompt, GREEDY, max_tokens))


@pytest.fixture
def scheduler():
    s = Scheduler(HYBRID, parallel=2, queue=8)
    s.start()
    yield s
    s.close()


def test_served_requests_equal_single_sequence_runs(scheduler):
    # More requests than rows, of different lengths: each gets a state row while it
    # runs, and its greedy text is what `run` makes of its prompt alone.
    prompts = [ENGINE.tokenizer.encode(p) for p in STORY_PROMPTS[:4]] + [IDS]
    for prompt, (text, _, _) in zip(prompts, serve(scheduler, prompts), strict=True):
        assert text == alone(prompt)
    assert sorted(scheduler.free_slots) == [0, 1]


def test_the_next_turn_goes_on_from_a_kept_state(scheduler):
    # A conversation's next turn starts with the last one's prompt and answer: it goes
    # on from the state kept at the last block end the sequence reached (64). One that
    # leaves the answer sooner (a template that drops the reasoning) goes on from the
    # prompt's last (32), though the blocks of 48 tokens are cached: no state of 48.
    first = (IDS * 3)[:40]
    ((_, answer, _),) = serve(scheduler, [first], max_tokens=30)
    fed = first + answer[:-1]  # the last token was sampled, never fed
    assert len(fed) == 69
    follow_up = fed + ENGINE.tokenizer.encode(" The end.")
    other = fed[:50] + ENGINE.tokenizer.encode(" Then a cat came.")
    results = serve(scheduler, [follow_up])[0], serve(scheduler, [other])[0]
    for prompt, (text, _, stats), kept in zip((follow_up, other), results, (64, 32), strict=True):
        assert stats.prompt_processed == len(prompt) - kept
        assert text == alone(prompt)


def test_a_served_turn_keeps_its_state_at_the_conversations_end(scheduler):
    # A request that says where its conversation ends (before the generation prompt)
    # keeps its prompt's state at the last block end up to there (16), not 4 tokens
    # before the prompt's end (32): the next turn agrees with it up to 20 tokens only.
    first = (IDS * 3)[:40]
    sink = queue.Queue()
    scheduler.submit(Request(first, GREEDY, 4, history_end=20), sink.put)
    while getattr(sink.get(timeout=60), "finish_reason", "error") is None:
        pass
    follow_up = first[:20] + ENGINE.tokenizer.encode(" Then a cat came.")
    ((text, _, stats),) = serve(scheduler, [follow_up])
    assert stats.prompt_processed == len(follow_up) - 16
    assert text == alone(follow_up)


def test_a_benchmark_restores_the_state_of_its_depth():
    state = HYBRID.new_state(64)
    with torch.inference_mode():
        prefill(MODEL, state, IDS[:5])
        saved = state.cache.save_windows()
        first = prefill(MODEL, state, IDS[5:9])
        del state.tokens[5:]
        state.cache.restore_windows(saved)
        again = prefill(MODEL, state, IDS[5:9])
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert isinstance(state, KVState)

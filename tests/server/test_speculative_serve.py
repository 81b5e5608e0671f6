"""serve's speculative decoding (--draft, --lookup: llmrun.batching's single-sequence
rounds) as a client sees it, on the bundled stories260K: greedy output streamed over
/v1/completions (with logprobs) and /v1/chat/completions is the plain server's token for
token, with the model as its own draft (every draft accepted), a tiny random Llama of the
same vocabulary as the draft (nearly all rejected) and prompt lookup; usage reports the
drafts as OpenAI's predicted-output tokens; two greedy requests at once each get their
solo output, the one left alone going on with drafts (the draft's cache catching up with
what the batched steps fed); seeded sampling through the scheduler (a tiny random Llama
drafted for by a noisy copy of itself) follows the model's own distribution; `llmrun serve
--draft` runs it all; the flags are checked before loading.

Tolerances: tokens and text exact; logprobs within 1e-4 (a verify forward's rows against
single-token decode steps); sampled frequencies within 0.09 total variation of the exact
distribution of the first three tokens (top-k 2: 8 outcomes; 800 seeded draws, about 60%
of the drafts accepted: the rule as written measures 0.046, accepting every draft 0.51).
"""

import collections
import copy
import dataclasses
import json
import queue

import httpx
import pytest
import torch
from helpers import STORIES_GGUF, tiny_hf_model, write_gguf
from serving import Server
from starlette.testclient import TestClient
from typer.testing import CliRunner

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.cli import app
from llmrun.errors import UsageError
from llmrun.sampling import Sampler, SamplingParams
from llmrun.server import Service, create_app

PLAIN = api.load(None, device="cpu", ctx_size=256)
NOISE = 0.01  # on the noisy draft's weights (see `tiny`)
GREEDY = SamplingParams(temperature=0)
TWICE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. Once upon a time"
)  # the bundled model retells it: prompt lookup drafts from it


def speculating(draft=None, draft_max=4, lookup=None):
    """PLAIN drafting with `draft` (an Engine), or by prompt lookup."""
    engine = dataclasses.replace(PLAIN, speculator=None)
    if lookup is not None:
        engine.use_lookup(lookup)
    else:
        engine.use_draft(draft, draft_max)
    return engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Engines of a tiny random Llama over stories260K's 512 ids ("random": as a draft
    for stories260K its guesses are nearly all wrong) and of a copy with noise on its
    weights ("noisy": a draft for it that is often right, often not)."""
    hf, config = tiny_hf_model("llama")
    folder = tmp_path_factory.mktemp("drafts")
    noisy = copy.deepcopy(hf)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * NOISE)
    engines = {}
    for name, model in (("random", hf), ("noisy", noisy)):
        path = write_gguf(folder / f"{name}.gguf", config, model.state_dict())
        engines[name] = api.load(str(path), device="cpu", ctx_size=256)
    return engines


def stream(engine, path, body):
    """The streamed chunks of a POST to serve's app over `engine` (a server of its own),
    and the usage chunk."""
    service = Service("stories260K", set(), None, parallel=2, queue=2)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as client:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            response = client.post(path, json=body)
    finally:
        service.close()
    assert response.status_code == 200, response.text
    events = [e[6:] for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return chunks[:-1], chunks[-1]["usage"]


def completion_steps(chunks):
    """Each streamed completion chunk's (text, tokens with their logprobs, finish)."""
    out = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        logprobs = choice["logprobs"] or {"tokens": [], "token_logprobs": []}
        out.append(
            (
                choice["text"],
                logprobs["tokens"],
                logprobs["token_logprobs"],
                choice["finish_reason"],
            )
        )
    return out


@pytest.mark.parametrize("drafts", ["the model itself", "a random model", "prompt lookup"])
def test_greedy_streams_are_the_plain_servers(drafts, tiny):
    engine = {
        "the model itself": lambda: speculating(PLAIN),
        "a random model": lambda: speculating(tiny["random"]),
        "prompt lookup": lambda: speculating(lookup=4),
    }[drafts]()
    body = {"prompt": TWICE, "max_tokens": 40, "temperature": 0, "logprobs": 2}
    plain, plain_usage = stream(PLAIN, "/v1/completions", body)
    drafted, usage = stream(engine, "/v1/completions", body)
    expected, got = completion_steps(plain), completion_steps(drafted)
    assert len(got) == len(expected) > 30
    for (text, tokens, values, finish), want in zip(got, expected, strict=True):
        assert (text, tokens, finish) == (want[0], want[1], want[3])
        assert values == pytest.approx(want[2], abs=1e-4)
    assert "completion_tokens_details" not in plain_usage
    details = usage.pop("completion_tokens_details")
    assert usage == plain_usage
    accepted, rejected = (
        details["accepted_prediction_tokens"],
        details["rejected_prediction_tokens"],
    )
    if drafts == "the model itself":
        assert accepted >= 30 and rejected == 0
    elif drafts == "a random model":
        assert rejected > 5 * accepted
    else:
        assert accepted >= 10  # the retold part came drafted

    messages = [{"role": "user", "content": "Tell me a story about a dog"}]
    chat = {"messages": messages, "max_tokens": 30, "temperature": 0}
    plain, _ = stream(PLAIN, "/v1/chat/completions", chat)
    drafted, usage = stream(engine, "/v1/chat/completions", chat)
    assert [c["choices"] for c in drafted] == [c["choices"] for c in plain]
    if drafts != "prompt lookup":  # (the chat does not repeat itself)
        assert sum(usage["completion_tokens_details"].values()) > 0


class Collector:
    """One request's events from the scheduler thread: its text, finish and stats."""

    def __init__(self):
        self.events = queue.Queue()

    def __call__(self, event):
        self.events.put(event)

    def responses(self):
        while True:
            event = self.events.get(timeout=60)
            if isinstance(event, Exception):
                raise event
            yield event
            if event.finish_reason is not None:
                return

    def result(self):
        """The request's text, finish reason and stats."""
        responses = list(self.responses())
        text = "".join(r.text for r in responses)
        return text, responses[-1].finish_reason, responses[-1].stats

    def tokens(self):
        """The request's tokens and stats."""
        responses = list(self.responses())
        return [r.token for r in responses if r.token is not None], responses[-1].stats


def run(engine, requests):
    """(text, finish, stats) of `requests` admitted together by a scheduler over `engine`."""
    scheduler = Scheduler(engine, parallel=4, queue=4)
    try:
        collectors = []
        for request in requests:
            collectors.append(Collector())
            scheduler.submit(request, collectors[-1])
        scheduler.start()  # (after the submissions: its first step admits them all)
        return [c.result() for c in collectors]
    finally:
        scheduler.close()


def test_two_requests_at_once_each_get_their_solo_output(tiny):
    short = Request(PLAIN.tokenizer.encode("Once upon a time"), GREEDY, 8)
    long = Request(PLAIN.tokenizer.encode("The little dog"), GREEDY, 40)
    solo = [run(PLAIN, [request])[0][:2] for request in (short, long)]
    for engine in (speculating(PLAIN), speculating(tiny["random"])):
        together = run(engine, [short, long])
        assert [result[:2] for result in together] == solo
        # The longer one went on alone, drafting after the batched steps.
        assert together[0][2].drafted == 0 < together[1][2].drafted


def test_seeded_sampling_follows_the_models_distribution(tiny):
    target, draft = tiny["random"], tiny["noisy"]
    engine = dataclasses.replace(target, speculator=None)
    engine.use_draft(draft, 3)
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = PLAIN.tokenizer.encode("Once upon a time")

    def logits(model, tokens):
        with torch.inference_mode():
            ids = torch.tensor([tokens])
            cache = model.new_cache(1, 64, torch.float32, "cpu")
            return model(ids, torch.arange(len(tokens))[None], cache)[0, -1]

    sampler = Sampler(params)

    def p(tokens):
        return sampler.distribution(logits(target.model, tokens), tokens)

    exact = {}
    first = p(prompt)
    for a in first.nonzero().flatten().tolist():
        second = p([*prompt, a])
        for b in second.nonzero().flatten().tolist():
            third = p([*prompt, a, b])
            for c in third.nonzero().flatten().tolist():
                weight = float(first[a] * second[b] * third[c])
                exact[a, b, c] = weight
    q = sampler.distribution(logits(draft.model, prompt), prompt)
    assert 0.5 * float((q - first).abs().sum()) > 0.2  # the draft alone would be far off

    draws = 800
    scheduler = Scheduler(engine, parallel=1, queue=draws)
    collectors = [Collector() for _ in range(draws)]
    try:
        for seed, collector in enumerate(collectors):
            scheduler.submit(Request(prompt, params.updated(seed=seed), 4), collector)
        scheduler.start()  # (after the submissions: one runs at a time, each drafted for)
        finals = [collector.tokens() for collector in collectors]
    finally:
        scheduler.close()
    counts = collections.Counter(tuple(tokens[:3]) for tokens, _ in finals)
    drafted = sum(stats.drafted for _, stats in finals)
    accepted = sum(stats.accepted for _, stats in finals)
    outcomes = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts[o] / draws - exact.get(o, 0.0)) for o in outcomes)
    assert tv < 0.09
    assert 0 < accepted < drafted


def test_llmrun_serve_with_a_draft(tmp_path):
    server = Server(tmp_path, "--draft", str(STORIES_GGUF), "--draft-max", "5", "-c", "256")
    try:
        body = {"prompt": "The little dog", "max_tokens": 30, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    expected = PLAIN.generate(PLAIN.tokenizer.encode("The little dog"), GREEDY, 30)
    assert reply["choices"][0]["text"] == "".join(r.text for r in expected)
    # 29 tokens after the prefill's: 4 rounds of 5 drafts and the model's own token, then 4
    # drafts (none drafted past max_tokens) and its own.
    details = reply["usage"]["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 24, "rejected_prediction_tokens": 0}
    log = server.log.read_text()
    assert f"speculative decoding with the draft {STORIES_GGUF}, up to 5 tokens a step" in log


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft", str(STORIES_GGUF), "--lookup", "3"], "--draft and --lookup: choose one"),
        (["--draft-p-min", "0.5"], "--draft-p-min goes with --draft"),
        (["--draft-max", "2"], "--draft-max goes with --draft"),
    ],
)
def test_serve_checks_the_draft_flags_before_loading(flags, message):
    result = CliRunner().invoke(app, ["serve", *flags])
    assert isinstance(result.exception, UsageError) and str(result.exception) == message

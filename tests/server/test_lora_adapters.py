"""serve's LoRA adapters per request (llmrun.server.lora, the scheduler's per-row
scales): llama.cpp's GET/POST /lora-adapters shapes, a request's `lora` field on the
generation endpoints, and requests at different scales batched in one step.

A tiny random Llama with a PEFT adapter (rank 8, alpha 16, A and B random: it moves the
logits by ~5) written as GGUFs, as tests/loading/test_lora.py does. A request at scale
0 picks exactly the base model's greedy tokens, one at scale 1 (and 0.5) the adapter's,
as `llmrun run` picks them alone (with --lora, --lora-scaled) and PEFT's generate (0.5:
PEFT with half the alpha); requests at different scales decoded together each get their
solo tokens; the prefix cache never gives a request KV computed at other scales."""

import queue
import socket

import gguf
import pytest
import torch
from helpers import tiny_hf_model, write_gguf
from lora_helpers import needs_peft, peft_model, write_gguf_lora
from starlette.testclient import TestClient
from typer.testing import CliRunner

from llmrun import api, batching, server
from llmrun.batching import Request, Scheduler
from llmrun.cli import app
from llmrun.errors import UsageError
from llmrun.sampling import SamplingParams
from llmrun.server import Service, create_app

pytestmark = needs_peft
ALPHA = 16.0
STEPS = 8
GREEDY = SamplingParams(temperature=0)
STORY = (
    "Once upon a time there was a little girl named Lily. She liked to play in the park "
    "with her dog Max. One day"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Paths, PEFT models (alpha 16 and 8: scales 1 and 0.5) and engines as `llmrun run`
    loads them: the base alone, with the adapter at 1 and at 0.5, and one more with the
    adapter for the server (whose scales the tests change)."""
    hf, config = tiny_hf_model("llama")
    folder = tmp_path_factory.mktemp("loraserve")
    base, adapter = folder / "base.gguf", folder / "lora.gguf"
    write_gguf(base, config, hf.state_dict())
    peft = peft_model(hf, rank=8, alpha=ALPHA)

    def named(writer):
        writer.add_string(gguf.Keys.Adapter.LORA_TASK_NAME, "stories")
        writer.add_string(gguf.Keys.Adapter.LORA_PROMPT_PREFIX, "Once upon a time")

    write_gguf_lora(adapter, peft, config, ALPHA, extra=named)

    def load(*lora):
        return api.load(str(base), device="cpu", ctx_size=256, lora=lora)

    return {
        "base": base,
        "adapter": adapter,
        "peft": {1.0: peft, 0.5: peft_model(hf, rank=8, alpha=ALPHA / 2)},
        "run": {0.0: load(), 1.0: load((adapter, 1.0)), 0.5: load((adapter, 0.5))},
        "served": load((adapter, 1.0)),
    }


def run_tokens(tiny, scale, prompt, steps=STEPS):
    """`llmrun run` alone: the base (scale 0) or --lora-scaled ADAPTER:scale."""
    responses = tiny["run"][scale].generate(prompt, GREEDY, steps)
    return [r.token for r in responses if r.token is not None]


def peft_tokens(tiny, scale, prompt, steps=STEPS):
    with torch.no_grad():
        out = tiny["peft"][scale].generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
            eos_token_id=None,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def http(tiny):
    """A TestClient on serve's app over the adapter's engine, its scales back at 1 after."""
    engine = tiny["served"]
    service = Service("tiny", set(), None, parallel=4, queue=8)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as client:
            yield client
    finally:
        service.close()
        engine.lora.scales = [1.0]


def completion(http, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json={**body, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def text_of(engine, prompt, tokens):
    """The text `tokens` add after `prompt`, as serve answers it."""
    whole = engine.tokenizer.decode(prompt + tokens)
    return whole[len(engine.tokenizer.decode(prompt)) :]


def test_get_and_post_lora_adapters(http, tiny):
    """llama.cpp's shapes: a list of {id, path, scale, task_name, prompt_prefix} (the
    last two from the GGUF adapter); POST sets scales, and an adapter it leaves out gets 0."""
    assert http.get("/lora-adapters").json() == [
        {
            "id": 0,
            "path": str(tiny["adapter"]),
            "scale": 1.0,
            "task_name": "stories",
            "prompt_prefix": "Once upon a time",
        }
    ]
    posted = http.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])
    assert (posted.status_code, posted.json()) == (200, {"success": True})
    assert http.get("/lora-adapters").json()[0]["scale"] == 0.5
    assert http.post("/lora-adapters", json=[]).json() == {"success": True}
    assert http.get("/lora-adapters").json()[0]["scale"] == 0.0


def test_global_and_per_request_scales_pick_the_base_or_the_adapters_tokens(http, tiny):
    """Scale 0 gives exactly the base model's greedy tokens, scale 1 (and 0.5) the
    adapter's, whether set by POST /lora-adapters or by the request's `lora` (which
    overrides the global scales for that request alone)."""
    engine = tiny["served"]
    prompt = engine.tokenizer.encode("Once upon a time")
    expected = {}
    for scale in (0.0, 1.0, 0.5):
        tokens = run_tokens(tiny, scale, prompt)
        if scale:
            assert tokens == peft_tokens(tiny, scale, prompt)
        expected[scale] = text_of(engine, prompt, tokens)
    assert len(set(expected.values())) == 3  # the scales change the answer
    assert completion(http, prompt) == expected[1.0]  # serve's --lora: scale 1
    for scale, text in expected.items():
        assert completion(http, prompt, lora=[{"id": 0, "scale": scale}]) == text
    http.post("/lora-adapters", json=[{"id": 0, "scale": 0}])
    assert completion(http, prompt) == expected[0.0]
    assert completion(http, prompt, lora=[]) == expected[0.0]  # empty: the global scales
    assert completion(http, prompt, lora=[{"id": 0, "scale": 1}]) == expected[1.0]


def test_chat_takes_the_requests_scales(http, tiny):
    """/v1/chat/completions (and /v1/responses) take `lora` too: scale 0 answers as the
    base model's server does."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    body = {"messages": messages, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    base = Service("base", set(), None, parallel=1, queue=1)
    base.start(tiny["run"][0.0])
    try:
        with TestClient(create_app(base)) as client:
            plain = client.post("/v1/chat/completions", json=body).json()
    finally:
        base.close()
    answer = plain["choices"][0]["message"]["content"]
    at_zero = {**body, "lora": [{"id": 0, "scale": 0}]}
    chat = http.post("/v1/chat/completions", json=at_zero).json()
    assert chat["choices"][0]["message"]["content"] == answer
    adapted = http.post("/v1/chat/completions", json=body).json()
    assert adapted["choices"][0]["message"]["content"] != answer
    response = http.post(
        "/v1/responses",
        json={"input": "Tell me a story", "max_output_tokens": STEPS, "temperature": 0,
              "lora": [{"id": 0, "scale": 0}]},
    )  # fmt: skip
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "Hi", "lora": [{"id": 1, "scale": 1}]},
         "lora.0.id: no LoRA adapter has id 1; this server's are 0 to 0 (GET /lora-adapters)"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "lora": [{"id": -1, "scale": 1}]},
         "lora.0.id: no LoRA adapter has id -1"),
        ("/v1/completions",
         {"prompt": "Hi", "lora": [{"id": 0, "scale": 1}, {"id": 0, "scale": 0}]},
         "lora.1.id: adapter 0 is listed twice"),
        ("/v1/completions", {"prompt": "Hi", "lora": [{"id": 0}]}, "lora.0.scale: Field required"),
        ("/lora-adapters", [{"id": 2, "scale": 1}], "0.id: no LoRA adapter has id 2"),
        ("/lora-adapters", {"id": 0, "scale": 1}, "Input should be a valid list"),
    ],
)  # fmt: skip
def test_bad_adapter_ids_are_400(http, path, body, message):
    response = http.post(path, json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert http.get("/lora-adapters").json()[0]["scale"] == 1.0  # a refused POST sets nothing


def test_a_server_without_adapters_lists_none_and_refuses_a_requests_lora(tiny):
    service = Service("base", set(), None, parallel=1, queue=1)
    service.start(tiny["run"][0.0])
    try:
        with TestClient(create_app(service)) as client:
            assert client.get("/lora-adapters").json() == []
            body = {"prompt": "Hi", "lora": [{"id": 0, "scale": 1}]}
            response = client.post("/v1/completions", json=body)
    finally:
        service.close()
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "lora.0.id: this server has no LoRA adapters (serve's --lora)"
    )


def submit(scheduler, prompt, scale, steps=STEPS):
    """A request at `scale`; its (tokens, final stats) come from the returned queue."""
    events = queue.Queue()
    request = Request(prompt, GREEDY, steps, ignore_eos=True, lora=(scale,))
    scheduler.submit(request, events.put)
    return events


def result(events):
    tokens = []
    while True:
        event = events.get(timeout=300)
        if isinstance(event, Exception):
            raise event
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            return tokens, event.stats


def test_requests_at_different_scales_in_one_step_each_get_their_solo_tokens(tiny, monkeypatch):
    """Three requests at scales 0, 1 and 0.5, admitted together (queued before the
    scheduler starts): prefilled in one padded forward and decoded in one batch, each
    row with its own scale, each equal to its solo `llmrun run`."""
    mixed = []
    scaled = batching.lora.scaled

    def recording(lora, rows, device):
        mixed.append(len({tuple(r) for r in rows}) > 1)
        return scaled(lora, rows, device)

    monkeypatch.setattr(batching.lora, "scaled", recording)
    engine = tiny["served"]
    prompts = [engine.tokenizer.encode(text) for text in (STORY, "The dog", "Lily ran to the")]
    scheduler = Scheduler(engine, parallel=4, queue=4)
    pending = [submit(scheduler, p, s) for p, s in zip(prompts, (0.0, 1.0, 0.5), strict=True)]
    scheduler.start()
    try:
        got = [result(events)[0] for events in pending]
    finally:
        scheduler.close()
    assert mixed[0] and sum(mixed) >= STEPS  # prefill and the decode steps mixed scales
    for prompt, scale, tokens in zip(prompts, (0.0, 1.0, 0.5), got, strict=True):
        assert tokens == run_tokens(tiny, scale, prompt)


def test_the_prefix_cache_is_not_shared_across_scales(tiny):
    """A prompt cached at scale 1 is prefilled whole at scale 0 (and gives the base's
    tokens), and found again at scale 1."""
    engine = tiny["served"]
    prompt = engine.tokenizer.encode(STORY)
    scheduler = Scheduler(engine, parallel=2, queue=2)
    scheduler.start()
    try:
        first, stats = result(submit(scheduler, prompt, 1.0))
        assert stats.prompt_processed == len(prompt)
        base, stats = result(submit(scheduler, prompt, 0.0))
        assert stats.prompt_processed == len(prompt)  # nothing reused from scale 1
        assert base == run_tokens(tiny, 0.0, prompt)
        again, stats = result(submit(scheduler, prompt, 1.0))
        assert stats.prompt_processed < len(prompt) and again == first  # scale 1's blocks
    finally:
        scheduler.close()


def test_lora_init_without_apply_loads_the_adapters_at_scale_0(tiny, monkeypatch):
    got = {}
    monkeypatch.setattr(server, "bind", lambda host, port: socket.socket())
    monkeypatch.setattr(server, "run", lambda *args, **options: got.update(options))
    args = ["serve", str(tiny["base"]), "--lora-scaled", f"{tiny['adapter']}:0.5"]
    result = CliRunner().invoke(app, [*args, "--lora-init-without-apply"])
    assert result.exit_code == 0, result.output
    assert got["lora"] == [(str(tiny["adapter"]), 0.0)]
    alone = CliRunner().invoke(app, ["serve", str(tiny["base"]), "--lora-init-without-apply"])
    assert isinstance(alone.exception, UsageError)
    assert str(alone.exception) == "--lora-init-without-apply needs --lora or --lora-scaled"

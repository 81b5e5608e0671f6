"""Structured outputs: the grammar engine's masks on the bundled stories260K (alone and in
batched steps), schemas it refuses, `run --format/--grammar`, and over a real server
response_format (the openai client's parse with a pydantic model) and forced tool calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Literal

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from llguidance.numpy import apply_token_bitmask_inplace  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from llmrun import api, structured  # noqa: E402
from llmrun.batching import Request, Scheduler  # noqa: E402
from llmrun.sampling import SamplingParams  # noqa: E402
from llmrun.structured import GrammarError, check_schema  # noqa: E402

ENGINE = api.load(None, device="cpu", ctx_size=512)
VOCAB = structured.vocabulary(ENGINE.tokenizer, ENGINE.eos_ids)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "happy"],
    "additionalProperties": False,
}


def generate(grammar, prompt="Once upon a time", max_tokens=120, **params):
    ids = ENGINE.tokenizer.encode(prompt)
    sampling = SamplingParams(**{"temperature": 0, **params}).updated(grammar=grammar)
    responses = list(ENGINE.generate(ids, sampling, max_tokens))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def valid_person(text):
    person = json.loads(text)
    assert set(person) == set(PERSON["required"])
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert person["pet"] in ("cat", "dog", "bird") and isinstance(person["happy"], bool)
    return person


def test_a_schema_constrains_greedy_and_sampled_decoding():
    text, finish = generate(VOCAB.json_schema(PERSON))
    valid_person(text)
    assert finish == "stop"  # the grammar ends in an end-of-text token
    for seed in range(3):
        text, finish = generate(VOCAB.json_schema(PERSON), temperature=1.0, seed=seed)
        assert finish == "stop"
        valid_person(text)
    # Unconstrained, the model tells a story.
    assert not generate(None, max_tokens=20)[0].lstrip().startswith("{")


def test_any_json_object():
    grammar = VOCAB.json_schema(None)
    text, finish = generate(grammar, max_tokens=200, temperature=0.8, seed=1)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_each_schema_is_compiled_once():
    assert VOCAB.json_schema(PERSON) is VOCAB.json_schema(json.loads(json.dumps(PERSON)))
    assert VOCAB.json_schema({"type": "object"}) is not VOCAB.json_schema(PERSON)


def test_the_mask_forbids_what_the_grammar_forbids():
    constraint = VOCAB.json_schema(PERSON).constraint()
    logits = torch.randn(ENGINE.tokenizer.vocab_size + 3)  # a padded embedding's extra rows
    masked = constraint.apply(logits)
    # llguidance's own (independent) way of applying its bitmask.
    reference = logits[None, : VOCAB.size].numpy().copy()
    apply_token_bitmask_inplace(reference, constraint.bits)
    assert np.array_equal(masked[: VOCAB.size].numpy(), reference[0])
    assert torch.isinf(masked[VOCAB.size :]).all()
    allowed = torch.isfinite(masked).nonzero().flatten().tolist()
    assert [ENGINE.tokenizer.token_bytes(i) for i in allowed] == [b"{"]
    assert torch.equal(logits, logits.clone())  # the raw logits are left alone


def test_gbnf_and_lark_grammars():
    yes_no = VOCAB.gbnf('root ::= ("yes" | "no") "!"')
    assert generate(yes_no) in (("yes!", "stop"), ("no!", "stop"))
    assert generate(VOCAB.lark('start: "Lily " ("ran" | "sat")'))[0] in ("Lily ran", "Lily sat")


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "not": {"const": "x"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
        ({"type": "string", "pattern": "(?=a)"}, "look-around"),
        ({"type": "string", "format": "colour"}, "Unknown format: colour"),
    ],
)
def test_schemas_the_engine_refuses_name_the_feature(schema, named):
    with pytest.raises(GrammarError, match="grammar engine \\(llguidance\\) cannot use it") as e:
        VOCAB.json_schema(schema, "response_format")
    assert named in str(e.value)


def test_what_is_not_a_json_schema():
    assert check_schema(PERSON) is None and check_schema(True) is None
    assert "unknown type 'text'" in check_schema({"type": "text"})
    assert "properties must be an object" in check_schema({"properties": [1]})
    assert "at properties/a" in check_schema({"properties": {"a": {"type": 3}}})
    assert "anyOf must be a list" in check_schema({"anyOf": {}})
    assert "required must be a list" in check_schema({"required": "a"})
    assert "must be an object or a boolean" in check_schema([])


def test_batched_steps_give_each_sequence_its_own_mask():
    """Constrained and free sequences decoded together get what each gets alone."""
    schemas = [PERSON, None, {"type": "object", "properties": {"ok": {"type": "boolean"}}}]
    jobs = [
        ("Once upon a time", VOCAB.json_schema(PERSON)),
        ("The little dog", None),
        ("Lily and Tom went", VOCAB.json_schema(schemas[2])),
        ("One day, a big bird", VOCAB.gbnf('root ::= "yes" | "no"')),
        ("The sun was", VOCAB.json_schema(PERSON)),
    ]
    alone = [generate(grammar, prompt, 60) for prompt, grammar in jobs]
    scheduler = Scheduler(ENGINE, parallel=4, queue=8)
    scheduler.start()
    try:
        results = [[] for _ in jobs]
        done = [False] * len(jobs)
        import threading

        finished = threading.Event()

        def collect(i):
            def on_event(event):
                if isinstance(event, Exception):
                    results[i].append(event)
                    done[i] = True
                else:
                    results[i].append(event.text)
                    if event.finish_reason is not None:
                        results[i].append(event.finish_reason)
                        done[i] = True
                if all(done):
                    finished.set()

            return on_event

        for i, (prompt, grammar) in enumerate(jobs):
            params = SamplingParams(temperature=0).updated(grammar=grammar)
            scheduler.submit(Request(ENGINE.tokenizer.encode(prompt), params, 60), collect(i))
        assert finished.wait(120)
    finally:
        scheduler.close()
    together = [("".join(r[:-1]), r[-1]) for r in results]
    assert together == alone
    valid_person(together[0][0])
    valid_person(together[4][0])
    assert together[3][0] in ("yes", "no")


# ---- run --format / --grammar --------------------------------------------------------


def llmrun(*args):
    return subprocess.run(
        [sys.executable, "-m", "llmrun", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ),
    )


def test_run_format_json_and_schema_and_grammar(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = llmrun("run", "Once upon a time", "--temperature", "0", "--format", str(schema))
    assert r.returncode == 0, r.stderr
    assert r.stdout == generate(VOCAB.json_schema(PERSON), max_tokens=None)[0]
    valid_person(r.stdout)
    r = llmrun("run", "Once", "--format", "json", "-n", "30", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("{")
    gbnf = tmp_path / "yes.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    r = llmrun("run", "Once", "--grammar", str(gbnf), "--temperature", "0")
    assert (r.returncode, r.stdout) in ((0, "yes"), (0, "no"))


def test_run_format_errors(tmp_path):
    r = llmrun("run", "Once", "--format", "yaml")
    assert r.returncode == 2 and "--format yaml" in r.stderr and "give json" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "array", "uniqueItems": true}')
    r = llmrun("run", "Once", "--format", str(bad))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: --format {bad}: the grammar engine (llguidance)")
    gbnf = tmp_path / "x.gbnf"
    gbnf.write_text("root ::= ")
    r = llmrun("run", "Once", "--grammar", str(gbnf), "--format", "json")
    assert r.returncode == 2 and "either --format or --grammar" in r.stderr


# ---- a real server -------------------------------------------------------------------


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    degrees: int = Field(ge=-40, le=50)
    sunny: bool
    note: str = Field(max_length=10)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai
    from serving import Server

    server = Server(tmp_path_factory.mktemp("serve"))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0), server
    server.stop()


def test_parse_with_a_pydantic_model(client):
    client, _ = client
    messages = [{"role": "user", "content": "The weather in Paris?"}]
    completion = client.beta.chat.completions.parse(
        model="stories260K", messages=messages, response_format=Weather, temperature=0
    )
    weather = completion.choices[0].message.parsed
    assert isinstance(weather, Weather)
    assert completion.choices[0].finish_reason == "stop"
    # Streamed, the same text (with the schema the parse helper sends: strict, no extras).
    schema = {**Weather.model_json_schema(), "additionalProperties": False}
    stream = client.chat.completions.create(
        model="stories260K",
        messages=messages,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": schema, "strict": True},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert Weather.model_validate_json(text) == weather


def test_json_object(client):
    client, _ = client
    reply = client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": "Hi"}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert reply.choices[0].message.content.startswith("{")


def test_a_schema_the_engine_refuses_is_400(client):
    import httpx

    _, server = client
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert 'Unimplemented keys: ["not"]' in error["message"]
    assert error["message"].startswith("response_format.json_schema.schema: the grammar engine")
    assert error["param"] == "response_format.json_schema.schema"

"""serve with a tiny random flan-t5 (tests/t5_helpers.py), one request at a time
(llmrun.server.serial): /v1/completions answers transformers' greedy generate text, for a
prompt alone and for two prompts with two choices each (whose four sequences run one after
the other), streamed or not, with usage counting the encoder's prompt; chat completions, and
what a T5 cannot take (echo with logprobs), are one clear 400 each. Usage counts each prompt once, as
OpenAI counts it.

Tolerances: text exact.
"""

import json

import pytest
import torch
from serving import served
from t5_helpers import PROMPT, reference, t5_folder, tokenizer_folder

from llmrun import api

transformers = pytest.importorskip("transformers")
OTHER = "summarize: she sells sea shells by the sea shore"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5-serve")
    return t5_folder(root / "flan", "flan", tokenizer_folder(root / "tokenizer"))


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder), device="cpu", generate=False), "t5")


def expected(folder, prompt: str, max_tokens: int) -> tuple[str, int]:
    """transformers' greedy text and the prompt's tokens (with </s>)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = reference(folder).generate(ids, do_sample=False, max_new_tokens=max_tokens)
    return tokenizer.decode(out[0], skip_special_tokens=True), ids.shape[1]


def test_completions_are_transformers_generate(client, folder):
    response = client.post(
        "/v1/completions",
        json={"model": "t5", "prompt": [PROMPT, OTHER], "max_tokens": 10, "temperature": 0, "n": 2},
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    (first, first_tokens), (other, other_tokens) = (
        expected(folder, p, 10) for p in (PROMPT, OTHER)
    )
    assert [c["text"] for c in answer["choices"]] == [first, first, other, other]
    assert answer["usage"]["prompt_tokens"] == first_tokens + other_tokens  # once a prompt
    streamed = client.post(
        "/v1/completions",
        json={"model": "t5", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True},
    )
    assert streamed.status_code == 200, streamed.text
    events = [
        json.loads(line.removeprefix("data: "))
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(e["choices"][0]["text"] for e in events) == first


@pytest.mark.parametrize(
    "endpoint, body, message",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            "is a text-to-text model (encoder-decoder), which has no chat template: send its prompt to "
            "/v1/completions",
        ),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo with logprobs: "),
    ],
    ids=["chat", "echo"],
)
def test_what_t5_cannot_take_is_a_400(client, endpoint, body, message):
    response = client.post(endpoint, json={"model": "t5", **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]

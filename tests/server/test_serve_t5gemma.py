"""serve with a tiny random T5Gemma -it folder (tests/t5_helpers.py), one request at a time
(llmrun.server.serial): /v1/chat/completions encodes the conversation with the chat template,
as transformers' apply_chat_template does, and answers with transformers' greedy generate
reply, streamed or not.

Tolerances: text exact.
"""

import json

import pytest
import torch
from serving import served
from t5_helpers import t5gemma_folder

from llmrun import api

transformers = pytest.importorskip("transformers")
MESSAGES = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time"},
    {"role": "user", "content": "And then?"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return t5gemma_folder(tmp_path_factory.mktemp("t5gemma-serve"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", generate=False)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "t5gemma")


def test_chat_completions_are_transformers_generate(client, folder, engine):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = ref.generate(**inputs, do_sample=False, max_new_tokens=8)
    expected = engine.tokenizer.decode(out[0, 1:].tolist())
    ask = {"model": "t5gemma", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/chat/completions", json=ask)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    streamed = client.post("/v1/chat/completions", json={**ask, "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = [
        json.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected

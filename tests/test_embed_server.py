"""serve's POST /v1/embeddings: OpenAI's request shapes (a text, texts, token ids, lists of
them), floats and base64, usage, dimensions, errors in OpenAI's shape; an embedding model
served alone (no scheduler, generation endpoints refused); a causal model with --pooling."""

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from embedding_helpers import TEXTS, hf_model, reference, write_embedding_dir
from serving import Server
from starlette.testclient import TestClient

from llmrun import api
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3():
    return hf_model()


@pytest.fixture(scope="module")
def st_engine(qwen3, tmp_path_factory):
    folder = write_embedding_dir(tmp_path_factory.mktemp("qwen3-embedding"), qwen3)
    return api.load(str(folder), device="cpu", generate=False)


@pytest.fixture(scope="module")
def http(st_engine):
    service = Service("qwen3-embedding", set(), None, parallel=2, queue=2)
    service.start(st_engine)
    try:
        with TestClient(create_app(service)) as client:
            yield client
    finally:
        service.close()


def ids_of(engine, texts):
    return [engine.tokenizer.encode_sequence(t) for t in texts]


def test_texts_of_different_lengths_equal_transformers(http, qwen3, st_engine):
    response = http.post("/v1/embeddings", json={"input": TEXTS, "model": "qwen3-embedding"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "qwen3-embedding"
    assert [(d["object"], d["index"]) for d in body["data"]] == [
        ("embedding", i) for i in range(len(TEXTS))
    ]
    ids = ids_of(st_engine, TEXTS)
    ours = torch.tensor([d["embedding"] for d in body["data"]])
    torch.testing.assert_close(ours, reference(qwen3, ids), atol=1e-4, rtol=0)
    tokens = sum(len(i) for i in ids)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_base64_is_little_endian_float32_of_the_same_vectors(http):
    floats = http.post("/v1/embeddings", json={"input": TEXTS}).json()
    packed = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    for plain, coded in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(coded["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.float32(plain["embedding"]).tolist()


@pytest.mark.parametrize(
    "given, expected",
    [
        ("hi", [[270, 417, 2]]),  # one text (its ids: stories260K's, then </s>)
        ([270, 417, 2], [[270, 417, 2]]),  # one list of token ids, taken as given
        ([[270, 417, 2], [5, 6]], [[270, 417, 2], [5, 6]]),
    ],
)
def test_a_text_token_ids_and_lists_of_them(http, qwen3, st_engine, given, expected):
    assert ids_of(st_engine, ["hi"]) == [[270, 417, 2]]
    body = http.post("/v1/embeddings", json={"input": given}).json()
    ours = torch.tensor([d["embedding"] for d in body["data"]])
    torch.testing.assert_close(ours, reference(qwen3, expected), atol=1e-4, rtol=0)


def test_raw_vectors_and_dimensions(http, qwen3):
    raw = http.post("/v1/embeddings", json={"input": [[5, 6]], "embd_normalize": -1}).json()
    theirs = reference(qwen3, [[5, 6]], normalize=False)
    torch.testing.assert_close(
        torch.tensor(raw["data"][0]["embedding"])[None], theirs, atol=1e-4, rtol=0
    )
    same = http.post("/v1/embeddings", json={"input": "hi", "dimensions": 64})
    assert same.status_code == 200
    shorter = http.post("/v1/embeddings", json={"input": "hi", "dimensions": 32})
    assert shorter.status_code == 400
    assert shorter.json()["error"]["param"] == "dimensions"
    assert "vectors have 64" in shorter.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, "input", "input: Field required"),
        ({"input": []}, "input", "input: Value error, an empty list: nothing to embed"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
        ({"input": [[1, 600]]}, None, "token ids must be in [0, 512)"),
        ({"input": " ".join(["dog"] * 100)}, "input", "more than the context of 64 tokens"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ],
)
def test_errors_in_openai_shape(http, body, param, message):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code in (400, 404)
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_long_input_is_cut_when_asked(http):
    body = http.post("/v1/embeddings", json={"input": " ".join(["dog"] * 100), "truncate": True})
    assert body.status_code == 200 and body.json()["usage"]["prompt_tokens"] == 64


def test_a_causal_model_needs_a_pooling():
    engine = api.load(None, device="cpu")
    for pooling, status in ((None, 400), ("mean", 200)):
        service = Service("stories", set(), None, parallel=1, queue=1, pooling=pooling)
        service.start(engine)
        try:
            with TestClient(create_app(service)) as http:
                response = http.post("/v1/embeddings", json={"input": "Once upon a time"})
                assert response.status_code == status, response.text
                if pooling is None:
                    assert "start serve with --pooling" in response.json()["error"]["message"]
                else:
                    mean = engine.embed(["Once upon a time"], "mean").vectors[0].tolist()
                    assert response.json()["data"][0]["embedding"] == mean
        finally:
            service.close()


def test_serve_an_embedding_model_alone(tmp_path):
    """`llmrun serve` of a model that cannot generate: /health, /v1/models and
    /v1/embeddings (through the openai client) answer; generation endpoints say 400."""
    model = hf_model(tie_word_embeddings=False)
    folder = write_embedding_dir(tmp_path / "m", model)
    server = Server(tmp_path, str(folder))
    try:
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == str(folder)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        result = client.embeddings.create(model=str(folder), input=["hi", "Once upon a time"])
        engine = api.load(str(folder), device="cpu", generate=False)
        ids = ids_of(engine, ["hi", "Once upon a time"])
        ours = torch.tensor([d.embedding for d in result.data])
        torch.testing.assert_close(ours, reference(model, ids), atol=1e-4, rtol=0)
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/responses", {"input": "hi"}),
        ):
            response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
            assert response.status_code == 400, path
            assert response.json()["error"]["message"] == (
                f"{folder} is an embedding model; use /v1/embeddings"
            )
    finally:
        server.stop()

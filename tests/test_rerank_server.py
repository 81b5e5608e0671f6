"""serve's POST /v1/rerank, /rerank and /v1/score on a reranker: Jina's and Cohere's request,
results best first with transformers' scores, top_n, return_documents, usage; vLLM's
score pairs; a reranker served alone (generation and embeddings refused with a pointer),
errors in OpenAI's shape."""

import pytest
from rerank_helpers import DOCUMENTS, QUERY, hf_reranker, reference_scores, write_reranker_dir
from starlette.testclient import TestClient

from llmrun import api
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf = hf_reranker("xlm-roberta")
    folder = write_reranker_dir(tmp_path_factory.mktemp("cross-encoder"), hf)
    service = Service("reranker", set(), None, parallel=2, queue=2)
    service.start(api.load(str(folder), device="cpu", generate=False))
    try:
        with TestClient(create_app(service)) as client:
            yield client, hf, folder
    finally:
        service.close()


def test_rerank_gives_the_documents_best_first(served):
    http, hf, folder = served
    expected = reference_scores(hf, folder)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/v1/rerank", "/rerank"):
        response = http.post(
            path, json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == "reranker"
        assert [r["index"] for r in body["results"]] == order
        for r in body["results"]:
            assert set(r) == {"index", "relevance_score"}
            assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    response = http.post(
        "/v1/rerank",
        json={
            "query": QUERY,
            "documents": [{"text": d} for d in DOCUMENTS],  # Jina's and Cohere's objects
            "top_n": 1,
            "return_documents": True,
        },
    )
    (best,) = response.json()["results"]
    assert best["index"] == order[0] and best["document"] == {"text": DOCUMENTS[order[0]]}


def test_score_pairs_one_text_with_many_and_one_to_one(served):
    http, hf, folder = served
    expected = reference_scores(hf, folder)
    response = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(d["index"], d["object"]) for d in body["data"]] == [
        (i, "score") for i in range(len(DOCUMENTS))
    ]
    assert all(abs(d["score"] - e) < 1e-4 for d, e in zip(body["data"], expected, strict=True))
    pairs = {"text_1": ["berlin", QUERY], "text_2": [DOCUMENTS[0], DOCUMENTS[1]]}
    body = http.post("/v1/score", json=pairs).json()
    assert (
        abs(body["data"][0]["score"] - reference_scores(hf, folder, "berlin", DOCUMENTS[:1])[0])
        < 1e-4
    )
    assert abs(body["data"][1]["score"] - expected[1]) < 1e-4


def test_a_reranker_is_served_alone(served):
    http, _, _ = served
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["reranker"]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
    assert chat.json()["error"]["message"] == "reranker is a reranker; use /v1/rerank"
    embeddings = http.post("/v1/embeddings", json={"input": "hi"})
    assert embeddings.status_code == 400
    assert embeddings.json()["error"]["message"] == "reranker is a reranker; use /v1/rerank"


def test_bad_requests_are_openai_errors(served):
    http, _, _ = served
    empty = http.post("/v1/rerank", json={"query": QUERY, "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
    zero = http.post("/v1/rerank", json={"query": QUERY, "documents": ["a"], "top_n": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "top_n"
    long = http.post("/v1/rerank", json={"query": QUERY, "documents": ["berlin " * 200]})
    assert long.status_code == 400
    assert long.json()["error"]["code"] == "context_length_exceeded"
    assert long.json()["error"]["param"] == "documents"
    mismatched = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]})
    assert mismatched.status_code == 400
    other = http.post("/v1/rerank", json={"model": "gpt-4", "query": QUERY, "documents": ["a"]})
    assert other.status_code == 404

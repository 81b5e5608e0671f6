"""serve's endpoints of a reranker: /v1/rerank and /rerank (Jina's, Cohere's and
llama.cpp's request and response), /v1/score (vLLM's). The score is the cross-encoder's
raw logit (a causal reranker's probability of "yes"), as llama.cpp's /rerank gives it;
results come best first."""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmrun import api
from llmrun.server.schema import ApiError, RerankBody, ScoreBody
from llmrun.server.service import Service, read_json


def _reranker(service: Service, model: str | None) -> api.Engine:
    engine = service.ready_engine(model)
    if not engine.reranks:
        use = "/v1/embeddings" if not engine.generates else "/v1/chat/completions"
        raise ApiError(
            400,
            f"{service.model_id} is not a reranker (a cross-encoder); use {use}",
            param="model",
            code="model_not_supported",
        )
    return engine


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def rerank(request: Request) -> Response:
    """POST /v1/rerank, /rerank: the documents by relevance to the query."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, RerankBody)
    engine = _reranker(service, body.model)

    def score():
        with service.embed_lock:
            return engine.rerank(body.query, body.documents, truncate=body.truncate)

    result = await asyncio.to_thread(score)
    results = []
    for ranked in result.ranked(body.top_n):
        entry = {"index": ranked.index, "relevance_score": ranked.score}
        if body.return_documents:
            entry["document"] = {"text": body.documents[ranked.index]}
        results.append(entry)
    service.metrics.requests.labels("rerank", "200").inc()
    return JSONResponse(
        {
            "object": "list",
            "model": service.model_id,
            "results": results,
            "usage": _usage(result.prompt_tokens),
        }
    )


async def score(request: Request) -> Response:
    """POST /v1/score: each (text_1, text_2) pair's score, in the pairs' order."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, ScoreBody)
    engine = _reranker(service, body.model)
    pairs = body.pairs()

    def scores():
        queries = {query: [d for q, d in pairs if q == query] for query, _ in pairs}
        with service.embed_lock:
            results = {
                q: engine.rerank(q, docs, truncate=body.truncate) for q, docs in queries.items()
            }
        seen = {q: 0 for q in queries}
        out = []
        for query, _ in pairs:
            result = results[query]
            out.append((result.scores[seen[query]], result.tokens[seen[query]]))
            seen[query] += 1
        return out

    scored = await asyncio.to_thread(scores)
    service.metrics.requests.labels("score", "200").inc()
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": service.model_id,
            "data": [
                {"index": i, "object": "score", "score": value}
                for i, (value, _) in enumerate(scored)
            ],
            "usage": _usage(sum(tokens for _, tokens in scored)),
        }
    )

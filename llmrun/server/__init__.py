"""`llmrun serve`: an OpenAI-compatible HTTP API over the batching scheduler.

app.py holds the Starlette app, its endpoints and the runner; responses.py /v1/responses;
reply.py what both chat endpoints share (the prompt with tools and history, the grammar a
request imposes, the reader of reasoning, content and tool calls); schema.py the request
bodies and OpenAI-shaped errors; metrics.py the Prometheus metrics; ollama.py and
ollama_models.py ollama's API (/api/*) over the same service. Imported only by
`serve`: its libraries are the `serve` extra.
"""

from llmrun.server.app import Service, bind, create_app, run

__all__ = ["Service", "bind", "create_app", "run"]

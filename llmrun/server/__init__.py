"""`llmrun serve`: an OpenAI-compatible HTTP API over the batching scheduler.

app.py holds the Starlette app, its endpoints and the runner; schema.py the request bodies
and OpenAI-shaped errors; metrics.py the Prometheus metrics. Imported only by `serve`: its
libraries are the `serve` extra.
"""

from llmrun.server.app import Service, bind, create_app, run

__all__ = ["Service", "bind", "create_app", "run"]

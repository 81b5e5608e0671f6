"""The served model as ollama's API describes it: /api/tags, /api/show, /api/ps, /api/version.

One model, under the name ollama lists it by ("NAME:latest" where serve's name has no
tag): its file's format, architecture, parameter count and quantization (read from the
file's headers, as `llmrun show` reads them), what it can do (capabilities), its chat
template and the sampling defaults serve applies.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from llmrun import api
from llmrun.errors import LlmrunError
from llmrun.server.ollama import listed_name, model_engine
from llmrun.server.schema import Body
from llmrun.server.service import Service, read_json

# The ollama release whose API this layer speaks (think levels, tool_name, call ids):
# clients read it to tell which fields a server takes.
OLLAMA_VERSION = "0.12.0"
# The model stays loaded for the server's life: ollama's "never unloads".
NEVER = "9999-12-31T23:59:59Z"
# serve's sampling defaults, as a Modelfile's PARAMETER names them
PARAMETERS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n")


class ShowBody(Body):
    model: str | None = None
    name: str | None = None  # ollama's older name for `model`
    verbose: bool = False


@lru_cache(maxsize=4)
def _file_facts(path: Path) -> dict[str, Any]:
    """What the model's files say (llmrun.loading.inspect.describe), and the file's
    identity: ollama's digest names a manifest, which llmrun has none of, so this one
    hashes the file's path, size and modification time (it changes when the file does)."""
    from llmrun.loading.inspect import describe

    facts = describe(path)
    stat = path.stat()
    identity = f"{path.resolve()}\0{facts['size']}\0{stat.st_mtime_ns}"
    facts["digest"] = hashlib.sha256(identity.encode()).hexdigest()
    facts["modified_at"] = datetime.fromtimestamp(stat.st_mtime, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ"
    )
    return facts


def parameter_size(n: int) -> str:
    """A parameter count as ollama writes it: 8B, 7.6B, 494.03M, 292.80K."""
    for scale, unit, digits in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 2)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{digits}f}{unit}"
    return str(n)


def details(facts: dict[str, Any]) -> dict[str, Any]:
    family = facts.get("architecture") or ""
    return {
        "parent_model": "",
        "format": facts["format"],
        "family": family,
        "families": [family] if family else None,
        "parameter_size": parameter_size(facts.get("parameters") or 0),
        "quantization_level": facts.get("quant") or "",
    }


def _listing(service: Service, facts: dict[str, Any]) -> dict[str, Any]:
    name = listed_name(service)
    return {
        "name": name,
        "model": name,
        "modified_at": facts["modified_at"],
        "size": facts["size"],
        "digest": facts["digest"],
        "details": details(facts),
    }


async def _facts(request: Request, name: str | None = None) -> tuple[Service, api.Engine, dict]:
    """The service, the engine of the model `name` (None: the served one) and its file's
    facts, for a request whose key is checked."""
    service: Service = request.app.state.service
    engine = model_engine(service, name)
    return service, engine, await asyncio.to_thread(_file_facts, engine.path)


def _authorized(request: Request) -> Service:
    service: Service = request.app.state.service
    service.authorize(request)
    return service


async def tags(request: Request) -> Response:
    """GET /api/tags: the served model."""
    _authorized(request)
    service, _, facts = await _facts(request)
    return JSONResponse({"models": [_listing(service, facts)]})


async def ps(request: Request) -> Response:
    """GET /api/ps: the served model, loaded (weights and KV cache) for the server's life."""
    _authorized(request)
    service, engine, facts = await _facts(request)
    size = facts["size"]
    if service.scheduler is not None:
        size += service.scheduler.cache.nbytes
    listing = {k: v for k, v in _listing(service, facts).items() if k != "modified_at"}
    return JSONResponse(
        {
            "models": [
                {
                    **listing,
                    "size": size,
                    "expires_at": NEVER,
                    "size_vram": size if engine.device.type != "cpu" else 0,
                    "context_length": engine.ctx_size,
                }
            ]
        }
    )


async def version(request: Request) -> Response:
    """GET /api/version."""
    return JSONResponse({"version": OLLAMA_VERSION})


async def heartbeat(request: Request) -> Response:
    """GET and HEAD /: ollama's heartbeat, which its CLI and some clients check before anything
    else; the text is the one they look for."""
    return PlainTextResponse("Ollama is running")


def capabilities(service: Service, engine: api.Engine) -> list[str]:
    """What ollama's clients may ask of the model."""
    from llmrun.infill import check_fim

    found = []
    if engine.generates:
        found.append("completion")
        if service.tool_format is not None:
            found.append("tools")
        if engine.markers is not None:
            found.append("thinking")
        if engine.vision is not None:
            found.append("vision")
        try:
            check_fim(engine.tokenizer, engine.name)
            found.append("insert")  # /api/generate's suffix
        except LlmrunError:
            pass
    if (service.pooling or engine.checkpoint.pooling) is not None and not engine.reranks:
        found.append("embedding")
    return found


def model_info(engine: api.Engine, facts: dict[str, Any]) -> dict[str, Any]:
    """The model's metadata under GGUF's key names: a GGUF file's own (its scalar values),
    else those of a config.json that GGUF names too."""
    gguf = engine.checkpoint.gguf
    if gguf is not None:
        info = {k: v for k, v in gguf.metadata.items() if not isinstance(v, (list, bytes))}
        return {"general.parameter_count": facts.get("parameters"), **info}
    arch = facts.get("architecture") or ""
    config = engine.checkpoint.config
    names = {
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "vocab_size": "vocab_size",
    }
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.parameter_count": facts.get("parameters"),
    }
    for key, field in names.items():
        if isinstance(config.get(field), (int, float)):
            info[f"{arch}.{key}"] = config[field]
    return info


def _parameters(engine: api.Engine) -> list[tuple[str, Any]]:
    defaults = engine.defaults
    return [(name, getattr(defaults, name)) for name in PARAMETERS] + [("num_ctx", engine.ctx_size)]


async def show(request: Request) -> Response:
    """POST /api/show: details, model_info, template, parameters and capabilities."""
    _authorized(request)
    body = await read_json(request, ShowBody)
    service, engine, facts = await _facts(request, body.model or body.name)
    template = engine.template.source if engine.template is not None else ""
    parameters = "\n".join(f"{k:<30} {v}" for k, v in _parameters(engine))
    modelfile = [f"# Modelfile generated by llmrun for {service.model_id}", f"FROM {engine.path}"]
    if template:
        modelfile.append(f'TEMPLATE """{template}"""')
    modelfile += [f"PARAMETER {k} {v}" for k, v in _parameters(engine)]
    shown = {
        "modelfile": "\n".join(modelfile) + "\n",
        "parameters": parameters,
        "template": template,
        "details": details(facts),
        "model_info": model_info(engine, facts),
        "capabilities": capabilities(service, engine),
        "modified_at": facts["modified_at"],
    }
    if facts.get("license"):
        shown["license"] = facts["license"]
    return JSONResponse(shown)

"""serve's LoRA adapters as llama.cpp's server exposes them: GET /lora-adapters lists
them (id, path, scale, and a GGUF adapter's task_name and prompt_prefix), POST /lora-adapters sets the scales of the requests that name
none, and a request's own `lora` field gives its scales."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import RootModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmrun import api
from llmrun.server.schema import ApiError, LoraScale, Sampling
from llmrun.server.service import Service, read_json


class LoraScales(RootModel[list[LoraScale]]):
    """POST /lora-adapters' body: a list of {id, scale}."""


def scales_of(engine: api.Engine, entries: Sequence[LoraScale], field: str) -> tuple[float, ...]:
    """Every adapter's scale: the entries' for the adapters they name, 0 for the others
    (as llama.cpp's server sets them). `field`: where the entries are in the body."""
    count = 0 if engine.lora is None else len(engine.lora)
    scales, seen = [0.0] * count, set()
    for i, entry in enumerate(entries):
        param = f"{field}.{i}.id".lstrip(".")
        if count == 0:
            raise ApiError(
                400, f"{param}: this server has no LoRA adapters (serve's --lora)", param=param
            )
        if not 0 <= entry.id < count:
            raise ApiError(
                400,
                f"{param}: no LoRA adapter has id {entry.id}; this server's are 0 to "
                f"{count - 1} (GET /lora-adapters)",
                param=param,
            )
        if entry.id in seen:
            raise ApiError(400, f"{param}: adapter {entry.id} is listed twice", param=param)
        seen.add(entry.id)
        scales[entry.id] = entry.scale
    return tuple(scales)


def request_lora(engine: api.Engine, body: Sampling) -> tuple[float, ...] | None:
    """A generation request's adapter scales; None where its `lora` names none (absent or
    empty, as llama.cpp's server reads it): then the scales POST /lora-adapters set."""
    if not body.lora:
        return None
    return scales_of(engine, body.lora, "lora")


async def lora_adapters(request: Request) -> Response:
    """GET /lora-adapters: [{id, path, scale, task_name, prompt_prefix}], an entry per
    adapter (serve's --lora, in order). POST /lora-adapters with [{id, scale}, ...]: those
    scales, 0 for the adapters it leaves out, for every later request that names none of
    its own."""
    service: Service = request.app.state.service
    service.authorize(request)
    if request.method == "POST":
        body = await read_json(request, LoraScales)
        engine = service.ready_engine(None)
        scales = scales_of(engine, body.root, "")
        if engine.lora is not None:
            engine.lora.scales = list(scales)
        return JSONResponse({"success": True})
    adapters = service.ready_engine(None).lora
    if adapters is None:
        return JSONResponse([])
    return JSONResponse(
        [
            {
                "id": i,
                "path": str(adapter.path),
                "scale": scale,
                "task_name": adapter.task_name,
                "prompt_prefix": adapter.prompt_prefix,
            }
            for i, (adapter, scale) in enumerate(
                zip(adapters.adapters, adapters.scales, strict=True)
            )
        ]
    )

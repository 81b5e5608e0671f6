"""`serve`: flags -> llmrun.server."""

from __future__ import annotations

from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import DEBUG, CacheType, CtxSize, Debug, Device, Dtype, TemplateOpt, app
from llmrun.errors import UsageError


@app.command()
def serve(
    model: Annotated[
        str | None, typer.Argument(help="MODEL (default: the bundled stories260K)")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="LLMRUN_API_KEY",
            help="Require `Authorization: Bearer KEY` on /v1 endpoints.",
        ),
    ] = None,
    parallel: Annotated[
        int, typer.Option("--parallel", help="Requests decoded together (KV cache slots).")
    ] = 4,
    queue: Annotated[
        int, typer.Option(help="Requests that may wait for a slot; more get 503.")
    ] = 64,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    cache_type: CacheType = None,
    threads: Annotated[
        int | None,
        typer.Option("--threads", "-t", help="CPU threads (default: all cores but one)."),
    ] = None,
    template: TemplateOpt = None,
    debug: Debug = False,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."""
    DEBUG["on"] = debug
    if parallel < 1:
        raise UsageError(f"--parallel must be positive, got {parallel}")
    if queue < 0:
        raise UsageError(f"--queue must be >= 0, got {queue}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    try:
        from llmrun import server
    except ImportError as e:
        raise UsageError(
            f"serve needs {e.name}, from the serve extra: pip install 'llmrun[serve]'"
        ) from None
    from llmrun import api

    with ui.download_progress() as progress:
        path = api.resolve(model, progress)
    sock = server.bind(host, port)
    name = model or path.stem
    address = sock.getsockname()
    ui.info(f"serving {name} on http://{_url_host(address[0])}:{address[1]}/v1")
    server.run(
        sock,
        model,
        path,
        name,
        api_key=api_key or None,
        parallel=parallel,
        queue=queue,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
        cache_type=cache_type,
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

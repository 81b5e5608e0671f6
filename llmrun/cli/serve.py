"""`serve`: flags -> llmrun.server."""

import re
from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import (
    DEBUG,
    Activations,
    CacheType,
    CtxSize,
    Debug,
    Device,
    DraftMax,
    DraftOpt,
    DraftPMin,
    Dtype,
    LookupOpt,
    Lora,
    LoraScaled,
    TemplateOpt,
    _adapters,
    _check_draft,
    app,
)
from llmrun.cli.generate import Mmproj
from llmrun.errors import UsageError
from llmrun.loading.embedding import POOLINGS


@app.command()
def serve(
    model: Annotated[
        str | None,
        typer.Argument(help="MODEL (default: the bundled stories260K)", metavar="MODEL"),
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
        int, typer.Option("--parallel", help="Sequences decoded together, at most.")
    ] = 4,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            "--kv-memory",
            metavar="SIZE",
            help="KV cache pool size, e.g. 4GiB or 512MB (default: 2 x --parallel "
            "contexts, at most half the free memory).",
        ),
    ] = None,
    no_prefix_cache: Annotated[
        bool,
        typer.Option("--no-prefix-cache", help="Prefill every prompt whole (no prefix reuse)."),
    ] = False,
    queue: Annotated[
        int, typer.Option(help="Requests that may wait for a slot; more get 503.")
    ] = 64,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    cache_type: CacheType = None,
    activations: Activations = "f32",
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    lora_init_without_apply: Annotated[
        bool,
        typer.Option(
            "--lora-init-without-apply",
            help="Load the LoRA adapters at scale 0 (set scales with POST /lora-adapters "
            "or a request's `lora`).",
        ),
    ] = False,
    threads: Annotated[
        int | None,
        typer.Option("--threads", "-t", help="CPU threads (default: all cores but one)."),
    ] = None,
    draft: DraftOpt = None,
    draft_max: DraftMax = None,
    draft_p_min: DraftPMin = None,
    lookup: LookupOpt = None,
    template: TemplateOpt = None,
    mmproj: Mmproj = None,
    pooling: Annotated[
        str | None,
        typer.Option(
            help=f"/v1/embeddings' pooling: {', '.join(POOLINGS)} (default: the model's own).",
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/embeddings)."""
    DEBUG["on"] = debug
    if parallel < 1:
        raise UsageError(f"--parallel must be positive, got {parallel}")
    if queue < 0:
        raise UsageError(f"--queue must be >= 0, got {queue}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    if pooling is not None and pooling not in POOLINGS:
        raise UsageError(f"unknown --pooling {pooling!r} (choose from {', '.join(POOLINGS)})")
    pool_bytes = None if kv_memory is None else parse_size(kv_memory, "--kv-memory")
    _check_draft(draft, draft_max, lookup, draft_p_min)
    adapters = _adapters(lora, lora_scaled)
    if lora_init_without_apply:
        if not adapters:
            raise UsageError("--lora-init-without-apply needs --lora or --lora-scaled")
        adapters = [(path, 0.0) for path, _ in adapters]
    try:
        from llmrun import server
    except ImportError as e:
        raise UsageError(
            f"serve needs {e.name}, from the serve extra: pip install 'llmrun[serve]'"
        ) from None
    from llmrun import api
    from llmrun.speculative import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN

    with ui.download_progress() as progress:
        path = api.resolve(model, progress)
        draft_path = None if draft is None else api.resolve(draft, progress)
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
        kv_memory=pool_bytes,
        prefix_cache=not no_prefix_cache,
        pooling=pooling,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
        cache_type=cache_type,
        activations=activations,
        lora=adapters,
        mmproj=mmproj,
        draft=None if draft is None else (draft, draft_path),
        draft_max=draft_max or DEFAULT_DRAFT_MAX,
        draft_p_min=DEFAULT_DRAFT_P_MIN if draft_p_min is None else draft_p_min,
        lookup=lookup,
    )


# SIZE suffixes: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000.
_SUFFIXES = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", 1):
    _SUFFIXES |= {_letter: 1024**_power, f"{_letter}ib": 1024**_power, f"{_letter}b": 1000**_power}


def parse_size(text: str, option: str) -> int:
    """Bytes of a SIZE such as 4GiB, 512MB, 1.5G or 1000000 (see _SUFFIXES)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match[2] not in _SUFFIXES:
        raise UsageError(f"{option} takes a size such as 4GiB or 512MB, got {text!r}")
    size = int(float(match[1]) * _SUFFIXES[match[2]])
    if size <= 0:
        raise UsageError(f"{option} must be positive, got {text!r}")
    return size


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

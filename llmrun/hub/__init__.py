"""MODEL names -> local files: resolve, pull, list, describe and remove Hugging Face models.

A MODEL is a local path (file or folder), the bundled model's name, or a Hub name (names.py).
Downloads go to llmrun's cache (paths.cache_dir()), laid out like the Hugging Face cache
(cache.py); models already in the Hugging Face cache are used in place. download.py moves the
bytes; checks.py is the one place where names from a server or a cache folder are checked
before they become paths. No torch: `list` and `show` stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import ModelNotFoundError, UsageError
from llmrun.hub.cache import (
    CachedModel,
    Removal,
    find_cached,
    list_models,
    model_name,
    model_path,
    plan_removal,
    remove,
    snapshot_files,
    touch_usage,
)
from llmrun.hub.download import FileTransfer, NoticesToStderr, Progress, fetch, offline
from llmrun.hub.names import HubName, local_path, parse_name, quant_label
from llmrun.loading.inspect import describe

__all__ = [
    "CachedModel",
    "FileTransfer",
    "HubName",
    "Progress",
    "Removal",
    "list_models",
    "model_info",
    "parse_name",
    "plan_removal",
    "pull",
    "quant_label",
    "remove",
    "resolve_model",
]


def resolve_model(spec: str, *, pull: bool = True, progress: Progress | None = None) -> Path:
    """A local .gguf file (the first part if split) or a safetensors folder for MODEL.

    Local paths are returned as they are; cached models are used without touching the
    network; anything else is pulled unless `pull` is False or HF_HUB_OFFLINE is set.
    """
    local = local_path(spec)
    if local is not None:
        return local
    name = parse_name(spec)
    progress = progress or NoticesToStderr()
    found = find_cached(name)
    if found is None:
        if offline():
            raise ModelNotFoundError(
                f"{name} is not in the cache and HF_HUB_OFFLINE=1 is set: unset it to download"
            )
        if not pull:
            raise ModelNotFoundError(f"{name} is not downloaded: run `llmrun pull {name}`")
        snap, sel = fetch(name, progress)
    else:
        _, snap, sel = found
        if sel.note:
            progress.on_notice(sel.note)
    touch_usage(model_name(name.repo, snap, sel, snapshot_files(snap)))
    return model_path(snap, sel)


def pull(spec: str, progress: Progress | None = None) -> Path:
    """Download MODEL (or bring it up to date) and return its local path, like resolve_model."""
    if local_path(spec) is not None:
        raise UsageError(f"{spec} is a local path; pull takes a Hub name like org/repo:QUANT")
    name = parse_name(spec)
    progress = progress or NoticesToStderr()
    if offline():
        found = find_cached(name)
        if found is None:
            raise ModelNotFoundError(
                f"{name} is not in the cache and HF_HUB_OFFLINE=1 is set: unset it to download"
            )
        progress.on_notice(f"HF_HUB_OFFLINE=1: using the cached {name} without checking the Hub")
        return model_path(found[1], found[2])
    snap, sel = fetch(name, progress)
    return model_path(snap, sel)


def model_info(spec: str) -> dict[str, Any]:
    """What `llmrun show` prints, for a local path or a downloaded model (no network)."""
    local = local_path(spec)
    if local is not None:
        return {"name": spec, **describe(local)}
    name = parse_name(spec)
    found = find_cached(name)
    if found is None:
        raise ModelNotFoundError(f"{name} is not downloaded: run `llmrun pull {name}`")
    source, snap, sel = found
    info = describe(model_path(snap, sel))
    return {
        "name": model_name(name.repo, snap, sel, snapshot_files(snap)),
        "source": source,
        **info,
    }

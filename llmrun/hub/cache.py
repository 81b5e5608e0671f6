"""The local caches: llmrun's own and the Hugging Face cache, read, listed and pruned.

Both are laid out like the Hugging Face cache:

    models--{org}--{repo}/
        blobs/{etag}               verified content; the etag is the sha256 (LFS) or git sha1
        blobs/{etag}.part          bytes received so far; the next pull continues it (HTTP Range)
        blobs/{etag}.lock          held by the process downloading that blob
        snapshots/{commit}/{path}  relative symlink to ../../blobs/{etag}
        refs/{revision}            the commit a revision pointed to when it was pulled
    last_used.json                 {model name: unix time} (llmrun's cache only)

What is read back passes the same checks as what a server sends (checks.py): a ref that is
not a commit id, a snapshot entry or folder that leads out of its repo, is ignored, and `rm`
deletes nothing outside the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from huggingface_hub import constants

from llmrun.errors import HubError, LlmrunError, ModelFormatError, ModelNotFoundError, UsageError
from llmrun.hub.checks import COMMIT_RE, inside, is_safe_file_name, walk
from llmrun.hub.names import (
    HubName,
    Selection,
    choice_names,
    gguf_groups,
    gguf_parts,
    parse_name,
    select,
    select_safetensors,
)
from llmrun.loading.inspect import index_shards, read_json, weight_stats
from llmrun.paths import BUNDLED_MODEL, cache_dir

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",  # Mistral's, a native folder's only one
)


@dataclass(frozen=True)
class Removal:
    """What `llmrun rm` deletes: repo folders, or snapshot entries and their blobs."""

    name: str
    repos: list[Path]
    paths: list[Path]
    freed: int


@dataclass(frozen=True)
class CachedModel:
    """One row of `llmrun list`."""

    name: str
    format: str
    quant: str | None
    parameters: int | None
    size: int
    last_used: float | None
    path: Path
    source: str

    def as_json(self) -> dict[str, Any]:
        """The row as `llmrun list --json` prints it: path as text, last use as ISO 8601."""
        used = self.last_used
        return {
            **dataclasses.asdict(self),
            "path": str(self.path),
            "last_used": None
            if used is None
            else datetime.fromtimestamp(used, timezone.utc).isoformat(timespec="seconds"),
        }


def hf_cache_dir() -> Path:
    """The standard Hugging Face cache, read from the environment at call time."""
    # huggingface_hub reads these once at import; reading them per call follows later changes.
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def roots() -> list[tuple[str, Path]]:
    """(name, folder) of each cache, llmrun's first."""
    return [("llmrun", cache_dir()), ("huggingface", hf_cache_dir())]


def repo_path(root: Path, repo: str) -> Path:
    """The folder of `repo` in the cache at `root`."""
    return root / ("models--" + repo.replace("/", "--"))


def snapshot(repo_dir: Path, revision: str | None) -> Path | None:
    """The snapshot folder a revision (a ref or a commit; default main) names, if it is here."""
    rev = revision or "main"
    ref = repo_dir / "refs" / rev
    if ref.is_file() and not ref.is_symlink():
        commit = ref.read_text(errors="replace").strip()
    else:
        commit = rev
    snap = repo_dir / "snapshots" / commit
    if not COMMIT_RE.fullmatch(commit) or not snap.is_dir() or not inside(snap, repo_dir):
        return None
    return snap


def snapshot_files(snap: Path) -> dict[str, int]:
    """Files of a snapshot and their sizes; a link whose blob is gone does not count, nor a
    name or link that leads out of the repo's folder."""
    repo_dir = snap.parent.parent
    files = {}
    for p in walk(snap):
        name = p.relative_to(snap).as_posix()
        if is_safe_file_name(name) and p.is_file() and inside(p, repo_dir):
            files[name] = p.stat().st_size
    return files


def complete(snap: Path, sel: Selection, source: str) -> bool:
    """Whether a cached safetensors snapshot holds every weight shard (and a tokenizer)."""
    if sel.format != "safetensors":
        return True
    try:
        index = read_json(snap / "model.safetensors.index.json")
    except ModelFormatError:
        return False
    shards = set() if index is None else index_shards(index)
    if shards is None or not all(is_safe_file_name(s) and (snap / s).is_file() for s in shards):
        return False
    # llmrun fetches the tokenizer before the weights; other tools may have skipped it.
    return source == "llmrun" or any((snap / f).is_file() for f in TOKENIZER_FILES)


def model_path(snap: Path, sel: Selection) -> Path:
    """What the loader takes: the GGUF's first part, or the safetensors folder."""
    return snap / sel.files[0] if sel.format == "gguf" else snap


def find_cached(name: HubName) -> tuple[str, Path, Selection] | None:
    """(cache, snapshot, files) of the first cache holding all of `name`'s files."""
    for source, root in roots():
        snap = snapshot(repo_path(root, name.repo), name.revision)
        if snap is None:
            continue
        try:
            sel = select(name, snapshot_files(snap))
        except (ModelNotFoundError, HubError):
            continue
        if complete(snap, sel, source):
            return source, snap, sel
    return None


def _rev_suffix(snap: Path) -> str:
    refs_dir = snap.parent.parent / "refs"
    refs = sorted(
        p.relative_to(refs_dir).as_posix()
        for p in walk(refs_dir)
        if p.is_file() and not p.is_symlink() and p.read_text(errors="replace").strip() == snap.name
    )
    if "main" in refs:
        return ""
    return "@" + (refs[0] if refs else snap.name)


def model_name(repo: str, snap: Path, sel: Selection, files: dict[str, int]) -> str:
    """The shortest name that picks this model again (as `list` shows it)."""
    if sel.format == "safetensors":
        return repo + _rev_suffix(snap)
    return choice_names(repo, gguf_groups(files))[sel.files[0]] + _rev_suffix(snap)


def _usage_file() -> Path:
    return cache_dir() / "last_used.json"


def read_usage() -> dict[str, float]:
    """{model name: when it was last used}."""
    try:
        data = json.loads(_usage_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    # Only times a clock could have written (the file may have been edited or damaged).
    latest = time.time() + 86400
    return {
        name: float(when)
        for name, when in data.items()
        if isinstance(when, (int, float)) and not isinstance(when, bool) and 0 <= when <= latest
    }


def touch_usage(name: str) -> None:
    """Record that model `name` was used now."""
    usage = read_usage()
    usage[name] = time.time()
    path = _usage_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(usage, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache still serves models; only "last used" goes stale


def list_models() -> list[CachedModel]:
    """Every complete model in llmrun's cache and in the Hugging Face cache."""
    usage = read_usage()
    rows = []
    for source, root in roots():
        for repo_dir in sorted(root.glob("models--*--*")):
            repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
            snaps = repo_dir / "snapshots"
            if not (inside(repo_dir, root) and snaps.is_dir()):
                continue
            for commit in sorted(os.listdir(snaps)):
                snap = snapshot(repo_dir, commit)
                if snap is not None:
                    rows += _snapshot_rows(source, repo, snap, usage)
    return rows


def _snapshot_rows(
    source: str, repo: str, snap: Path, usage: dict[str, float]
) -> list[CachedModel]:
    files = snapshot_files(snap)
    selections = []
    safetensors = select_safetensors(files)
    if safetensors and complete(snap, safetensors, source):
        selections.append(safetensors)
    for first in gguf_groups(files):
        try:
            selections.append(Selection("gguf", tuple(gguf_parts(first, files, repo))))
        except ModelNotFoundError:
            continue
    rows = []
    for sel in selections:
        name = model_name(repo, snap, sel, files)
        path = model_path(snap, sel)
        try:
            stats = weight_stats(path)
        except LlmrunError:
            stats = {"quant": None, "parameters": None}
        size = sum(files[f] for f in sel.files)
        row = CachedModel(
            name,
            sel.format,
            stats["quant"],
            stats["parameters"],
            size,
            usage.get(name),
            path,
            source,
        )
        rows.append(row)
    return rows


def plan_removal(spec: str) -> Removal:
    """What removing MODEL would delete, from every cache holding it, and the bytes freed.

    `org/repo` is the whole repo (every quant, partial downloads too); `org/repo:QUANT` or a
    file is those files and their blobs; `@revision` limits either to that snapshot.
    """
    if Path(spec).expanduser().exists() or spec.lower() == BUNDLED_MODEL.stem.lower():
        raise UsageError(
            f"{spec} is a local model, not a downloaded one: rm deletes only from llmrun's "
            "cache (see `llmrun list`)"
        )
    name = parse_name(spec)
    repos, paths = [], []
    for _, root in roots():
        repo_dir = repo_path(root, name.repo)
        if repo_dir.is_symlink() or (repo_dir.exists() and not inside(repo_dir, root)):
            raise HubError(
                f"{repo_dir} is a link to {os.path.realpath(repo_dir)}, outside the cache: "
                "llmrun deletes nothing there; remove it yourself"
            )
        found = _removal_paths(repo_dir, name) if repo_dir.is_dir() else []
        if found:
            repos.append(repo_dir)
            paths += found
    if not paths:
        raise ModelNotFoundError(f"{name} is not in the cache (see `llmrun list`)")
    return Removal(str(name), repos, paths, _freed(paths))


def remove(spec: str) -> int:
    """Delete MODEL as plan_removal describes; returns the bytes freed."""
    plan = plan_removal(spec)
    for path in plan.paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for repo_dir in plan.repos:
        _prune(repo_dir)
    return plan.freed


def _removal_paths(repo_dir: Path, name: HubName) -> list[Path]:
    """Snapshot entries and blobs to delete, or the repo folder when nothing of it stays."""
    if not (name.file or name.quant or name.revision):
        return [repo_dir]
    folder = repo_dir / "snapshots"
    commits = sorted(os.listdir(folder)) if folder.is_dir() else []
    snaps = [s for s in (snapshot(repo_dir, c) for c in commits) if s is not None]
    chosen = [snapshot(repo_dir, name.revision)] if name.revision else snaps
    dropped: set[Path] = set()
    for snap in filter(None, chosen):
        files = snapshot_files(snap)
        if name.file or name.quant:
            try:
                dropped |= {snap / f for f in select(name, files).files}
            except (ModelNotFoundError, HubError):
                continue
        else:
            dropped |= {snap / f for f in files}
    if not dropped:
        return []
    kept = {p for snap in snaps for p in walk(snap) if not p.is_dir()} - dropped
    if not kept:
        return [repo_dir]
    # Only blobs of this repo go: a link planted in the snapshot may point anywhere.
    blobs = {p.resolve() for p in dropped if p.is_symlink() and inside(p, repo_dir / "blobs")}
    return sorted(dropped) + sorted(blobs - {p.resolve() for p in kept})


def _freed(paths: list[Path]) -> int:
    """Bytes that deleting `paths` gives back: a file lives on while any hard link to it does."""
    inodes: dict[tuple[int, int], list[int]] = {}
    for path in paths:
        for p in walk(path) if path.is_dir() and not path.is_symlink() else [path]:
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                inodes.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])[2] += 1
    return sum(size for size, nlink, links in inodes.values() if links >= nlink)


def _prune(repo_dir: Path) -> None:
    """Drop emptied folders and snapshots, and the refs that pointed at them."""
    if not repo_dir.is_dir():
        return
    for folder in sorted(walk(repo_dir / "snapshots"), reverse=True):
        if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
    for ref in list(walk(repo_dir / "refs")):
        if ref.is_file() and not ref.is_symlink():
            if snapshot(repo_dir, ref.read_text(errors="replace").strip()) is None:
                ref.unlink()

"""Model names -> local files: resolve, pull, list, describe and remove Hugging Face models.

A MODEL is a local path (file or folder), the bundled model's name, or a Hub name:

    org/repo                  safetensors repo: config.json, *.safetensors, tokenizer files
    org/repo:Q4_K_M           GGUF repo: the file (all parts of a split one) with that quant tag
    org/repo/path/file.gguf   one GGUF file of a repo
    ...@revision              any of these at a branch, tag or commit

Downloads go to llmrun's cache (paths.cache_dir()), laid out like the Hugging Face cache:

    models--{org}--{repo}/
        blobs/{etag}               verified content; the etag is the sha256 (LFS) or git sha1
        blobs/{etag}.part          bytes received so far; the next pull continues it (HTTP Range)
        blobs/{etag}.lock          held by the process downloading that blob
        snapshots/{commit}/{path}  relative symlink to ../../blobs/{etag}
        refs/{revision}            the commit a revision pointed to when it was pulled
    last_used.json                 {model name: unix time}, written by resolve_model

A blob gets its final name only once its size and hash match the etag: sha256 for LFS files,
git's blob sha1 for the others (an etag of any other shape is checked by size only). Models in
the Hugging Face cache (HF_HUB_CACHE, HF_HOME) are used in place, and their blobs are hard-linked
rather than downloaded again. huggingface_hub supplies names, URLs, auth, metadata and the HTTP
session; the byte transfer is llmrun's own, because huggingface_hub 2.4 restarts a download from
zero in every new process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urljoin, urlsplit

from huggingface_hub import constants

from llmrun.errors import HubError, LlmrunError, ModelFormatError, ModelNotFoundError, UsageError
from llmrun.paths import BUNDLED_MODEL, cache_dir

DEFAULT_QUANT = "Q4_K_M"
SAFETENSORS_SIDECARS = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "README.md",
    }
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")
_QUANT_RE = re.compile(
    r"(?<![a-z0-9])(i?q\d(?:_[a-z0-9]+)*|tq\d_\d|bf16|fp?16|fp?32|mxfp4(?:_moe)?)(?![a-z0-9])",
    re.IGNORECASE,
)
_REPO_PART_RE = re.compile(r"[A-Za-z0-9][\w.-]*")
_RETRIES = 3
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class FileTransfer:
    """One file of a pull: its path in the repo, its size, and the bytes already on disk."""

    name: str
    size: int
    done: int


class Progress(Protocol):
    """What a pull reports; ui.py renders it, hub.py never prints progress itself."""

    def on_notice(self, message: str) -> None: ...

    def on_start(self, files: list[FileTransfer], total_bytes: int) -> None: ...

    def on_progress(self, name: str, done: int, total: int) -> None: ...

    def on_file_done(self, name: str) -> None: ...


class _NoticesToStderr:
    """The reporter used when the caller passes none: notices only, as plain stderr lines."""

    def on_notice(self, message: str) -> None:
        print(message, file=sys.stderr)

    def on_start(self, files: list[FileTransfer], total_bytes: int) -> None:
        pass

    def on_progress(self, name: str, done: int, total: int) -> None:
        pass

    def on_file_done(self, name: str) -> None:
        pass


@dataclass(frozen=True)
class HubName:
    """A parsed Hub model name."""

    repo: str
    file: str | None = None
    quant: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        text = self.repo + (f"/{self.file}" if self.file else "")
        text += f":{self.quant}" if self.quant else ""
        return text + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Selection:
    """The files of a repo that make up one model; for GGUF, the first part comes first."""

    format: str
    files: tuple[str, ...]
    note: str | None = None


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


# ---- names ------------------------------------------------------------------------------


def parse_name(spec: str) -> HubName:
    """Split `org/repo[/file.gguf][:QUANT][@revision]` (or `...@revision:QUANT`)."""
    rest, at, revision = spec.partition("@")
    quant = ""
    if ":" in revision:
        revision, _, quant = revision.partition(":")
    if not quant:
        rest, colon, quant = rest.partition(":")
        if colon and not quant:
            raise UsageError(
                f"{spec}: nothing after ':'; write org/repo:QUANT, e.g. :{DEFAULT_QUANT}"
            )
    if at and (not revision or revision.startswith("/") or ".." in revision.split("/")):
        raise UsageError(f"{spec}: write org/repo@BRANCH, TAG or COMMIT after the name")
    parts = rest.split("/")
    if len(parts) < 2 or not all(_REPO_PART_RE.fullmatch(p) for p in parts[:2]):
        raise ModelNotFoundError(
            f"{spec}: no such file or folder, and not a Hub name like org/repo or org/repo:QUANT"
        )
    file = "/".join(parts[2:]) or None
    if file is not None:
        if any(p in ("", ".", "..") for p in parts[2:]) or not file.lower().endswith(".gguf"):
            raise UsageError(f"{spec}: only a .gguf file can be named inside a repo")
        if quant:
            raise UsageError(f"{spec}: name a file or a quant tag, not both")
    return HubName("/".join(parts[:2]), file, quant or None, revision or None)


def quant_label(path: str) -> str | None:
    """The quant tag in a GGUF file name (or else its folders), e.g. 'Q4_K_M', upper-cased."""
    for part in reversed(Path(_SPLIT_RE.sub(".gguf", path)).parts):
        found = _QUANT_RE.findall(part.removesuffix(".gguf"))
        if found:
            return found[-1].upper()
    return None


def _local_path(spec: str) -> Path | None:
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec.lower() == BUNDLED_MODEL.stem.lower():
        return BUNDLED_MODEL
    looks_local = spec.startswith((".", "/", "~", "\\")) or bool(Path(spec).drive)
    if looks_local or (spec.lower().endswith(".gguf") and spec.count("/") < 2):
        raise ModelNotFoundError(f"{spec}: no such file or folder")
    return None


# ---- choosing files ---------------------------------------------------------------------


def _gguf_groups(files: dict[str, int]) -> dict[str, list[str]]:
    """GGUF files keyed by their first part; mmproj (vision projector) files are not models."""
    groups: dict[str, list[str]] = {}
    for name in sorted(files):
        if name.lower().endswith(".gguf") and not Path(name).name.lower().startswith("mmproj"):
            groups.setdefault(_first_part(name), []).append(name)
    return groups


def _first_part(name: str) -> str:
    m = _SPLIT_RE.search(name)
    return f"{name[: m.start()]}-00001-of-{m.group(2)}.gguf" if m else name


def _gguf_parts(first: str, files: dict[str, int], repo: str) -> list[str]:
    parts = sorted(f for f in files if _first_part(f) == first)
    m = _SPLIT_RE.search(first)
    count = int(m.group(2)) if m else 1
    if len(parts) != count:
        raise ModelNotFoundError(
            f"{repo}: only {len(parts)} of the {count} parts of {first} are there"
        )
    return parts


def _choice_names(repo: str, groups: dict[str, list[str]]) -> dict[str, str]:
    """The shortest name that picks each group: org/repo:QUANT when the tag is unique."""
    labels = {first: quant_label(first) for first in groups}
    counts: dict[str | None, int] = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    return {
        first: f"{repo}:{label}" if label and counts[label] == 1 else f"{repo}/{first}"
        for first, label in labels.items()
    }


def _select_gguf(name: HubName, files: dict[str, int]) -> Selection:
    groups = _gguf_groups(files)
    if name.file:
        if name.file not in files:
            hint = f"; choose one of: {', '.join(_choice_names(name.repo, groups).values())}"
            raise ModelNotFoundError(f"{name.repo} has no file {name.file}{hint if groups else ''}")
        first = _first_part(name.file)
        parts = _gguf_parts(first, files, name.repo)
        return Selection("gguf", tuple(parts))
    if not groups:
        listing = ", ".join(sorted(files)[:10]) + (", ..." if len(files) > 10 else "")
        raise HubError(
            f"{name.repo} has neither safetensors weights with a config.json nor GGUF files "
            f"(it has: {listing or 'no files'})"
        )
    choices = _choice_names(name.repo, groups)
    note = None
    if name.quant:
        tag = name.quant.upper()
        hits = [f for f in groups if quant_label(f) == tag] or [
            f for f in groups if re.search(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9])", f, re.I)
        ]
        if not hits:
            raise ModelNotFoundError(
                f"{name.repo} has no GGUF file tagged {name.quant}; choose one of: "
                + ", ".join(choices.values())
            )
    else:
        hits = [f for f in groups if quant_label(f) == DEFAULT_QUANT]
        if hits:
            why = f"the default {DEFAULT_QUANT}"
        else:
            hits = [min(groups, key=lambda f: (sum(files[p] for p in groups[f]), f))]
            why = "the only GGUF" if len(groups) == 1 else "the smallest GGUF"
        if len(groups) > 1 and len(hits) == 1:
            others = ", ".join(c for f, c in choices.items() if f != hits[0])
            note = f"using {choices[hits[0]]} ({why}); others: {others}"
    if len(hits) > 1:
        raise UsageError(
            f"{name} matches {len(hits)} GGUF files; choose one of: "
            + ", ".join(choices[f] for f in hits)
        )
    parts = _gguf_parts(hits[0], files, name.repo)
    return Selection("gguf", tuple(parts), note)


def _select_safetensors(files: dict[str, int]) -> Selection | None:
    top = {f for f in files if "/" not in f}
    weights = {f for f in top if f.endswith(".safetensors")}
    if "config.json" not in top or not weights:
        return None
    # Repos often carry the same weights twice (sharded and consolidated.safetensors).
    shards = {f for f in weights if _SHARD_RE.search(f)}
    if shards:
        weights = shards
    elif "model.safetensors" in weights:
        weights = {"model.safetensors"}
    return Selection("safetensors", tuple(sorted(weights | (top & SAFETENSORS_SIDECARS))))


def _select(name: HubName, files: dict[str, int]) -> Selection:
    if name.file or name.quant:
        return _select_gguf(name, files)
    return _select_safetensors(files) or _select_gguf(name, files)


# ---- cache folders ----------------------------------------------------------------------


def hf_cache_dir() -> Path:
    """The standard Hugging Face cache, read from the environment at call time."""
    # huggingface_hub reads these once at import; reading them per call follows later changes.
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _roots() -> list[tuple[str, Path]]:
    return [("llmrun", cache_dir()), ("huggingface", hf_cache_dir())]


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def _repo_dir(root: Path, repo: str) -> Path:
    return root / ("models--" + repo.replace("/", "--"))


# ---- names from outside -----------------------------------------------------------------
# Every string that a server sends, or that a cache folder holds, passes one of these checks
# before it becomes part of a local path: llmrun joins such names to paths itself, so it must
# refuse what huggingface_hub refuses (names that climb out of the snapshot folder).

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_HASH_ETAG_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_DRIVE_RE = re.compile(r"[A-Za-z]:")


def is_safe_file_name(name: object) -> bool:
    """A relative POSIX path of plain parts: no '', '.', '..', backslash, NUL or drive."""
    return (
        isinstance(name, str)
        and not name.startswith("/")
        and not _DRIVE_RE.match(name)
        and "\\" not in name
        and "\0" not in name
        and all(part not in ("", ".", "..") for part in name.split("/"))
    )


def checked_file_name(repo: str, name: object) -> str:
    """A repo file name from the server, or HubError naming the repo and the name."""
    if not is_safe_file_name(name):
        raise HubError(f"{repo}: the server sent an unsafe file name {name!r}; nothing was written")
    return name


def checked_commit(repo: str, commit: object) -> str:
    """A commit id from the server (it names the snapshot folder): 40 lowercase hex digits."""
    if not isinstance(commit, str) or not _COMMIT_RE.fullmatch(commit):
        raise HubError(
            f"{repo}: the server sent an unsafe commit id {commit!r}; nothing was written"
        )
    return commit


def blob_name(etag: str) -> str:
    """The file name in blobs/ for an etag: the etag when it is a hash, else its sha256."""
    return etag if _HASH_ETAG_RE.fullmatch(etag) else _sha256(etag)


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path`, with every link and '..' followed, lies within `folder` (also followed)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def _snapshot_entry(repo: str, snap: Path, name: str) -> Path:
    """Where file `name` of a repo goes in `snap`; refused if a link there would lead out."""
    path = snap / checked_file_name(repo, name)
    if not _inside(path.parent, snap):
        raise HubError(f"{repo}: {snap} leads out of the cache at {name!r}; nothing was written")
    return path


def _walk(folder: Path) -> Iterator[Path]:
    """Everything below `folder` (files, links, folders), never following a link to a folder."""
    for top, dirs, files in os.walk(folder, followlinks=False):
        for entry in dirs + files:
            yield Path(top) / entry


def _snapshot(repo_dir: Path, revision: str | None) -> Path | None:
    rev = revision or "main"
    ref = repo_dir / "refs" / rev
    if ref.is_file() and not ref.is_symlink():
        commit = ref.read_text(errors="replace").strip()
    else:
        commit = rev
    snap = repo_dir / "snapshots" / commit
    if not _COMMIT_RE.fullmatch(commit) or not snap.is_dir() or not _inside(snap, repo_dir):
        return None
    return snap


def _snapshot_files(snap: Path) -> dict[str, int]:
    """Files of a snapshot and their sizes; a link whose blob is gone does not count, nor a
    name or link that leads out of the repo's folder."""
    repo_dir = snap.parent.parent
    files = {}
    for p in _walk(snap):
        name = p.relative_to(snap).as_posix()
        if is_safe_file_name(name) and p.is_file() and _inside(p, repo_dir):
            files[name] = p.stat().st_size
    return files


def _complete(snap: Path, sel: Selection, source: str) -> bool:
    """Whether a cached safetensors snapshot holds every weight shard (and a tokenizer)."""
    if sel.format != "safetensors":
        return True
    try:
        index = _read_json(snap / "model.safetensors.index.json") or {}
    except ModelFormatError:
        return False
    shards = set(index.get("weight_map", {}).values())
    if not all(is_safe_file_name(s) and (snap / s).is_file() for s in shards):
        return False
    # llmrun fetches the tokenizer before the weights; other tools may have skipped it.
    return source == "llmrun" or any((snap / f).is_file() for f in TOKENIZER_FILES)


def _model_path(snap: Path, sel: Selection) -> Path:
    return snap / sel.files[0] if sel.format == "gguf" else snap


def _find_cached(name: HubName) -> tuple[str, Path, Selection] | None:
    for source, root in _roots():
        snap = _snapshot(_repo_dir(root, name.repo), name.revision)
        if snap is None:
            continue
        try:
            sel = _select(name, _snapshot_files(snap))
        except (ModelNotFoundError, HubError):
            continue
        if _complete(snap, sel, source):
            return source, snap, sel
    return None


def _rev_suffix(snap: Path) -> str:
    refs_dir = snap.parent.parent / "refs"
    refs = sorted(
        p.relative_to(refs_dir).as_posix()
        for p in _walk(refs_dir)
        if p.is_file() and not p.is_symlink() and p.read_text(errors="replace").strip() == snap.name
    )
    if "main" in refs:
        return ""
    return "@" + (refs[0] if refs else snap.name)


def _model_name(repo: str, snap: Path, sel: Selection, files: dict[str, int]) -> str:
    if sel.format == "safetensors":
        return repo + _rev_suffix(snap)
    return _choice_names(repo, _gguf_groups(files))[sel.files[0]] + _rev_suffix(snap)


def _usage_file() -> Path:
    return cache_dir() / "last_used.json"


def _read_usage() -> dict[str, float]:
    try:
        data = json.loads(_usage_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _touch_usage(name: str) -> None:
    usage = _read_usage()
    usage[name] = time.time()
    path = _usage_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(usage, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache still serves models; only "last used" goes stale


# ---- public entry points ----------------------------------------------------------------


def resolve_model(spec: str, *, pull: bool = True, progress: Progress | None = None) -> Path:
    """A local .gguf file (the first part if split) or a safetensors folder for MODEL.

    Local paths are returned as they are; cached models are used without touching the
    network; anything else is pulled unless `pull` is False or HF_HUB_OFFLINE is set.
    """
    local = _local_path(spec)
    if local is not None:
        return local
    name = parse_name(spec)
    progress = progress or _NoticesToStderr()
    found = _find_cached(name)
    if found is None:
        if _offline():
            raise ModelNotFoundError(
                f"{name} is not in the cache and HF_HUB_OFFLINE=1 is set: unset it to download"
            )
        if not pull:
            raise ModelNotFoundError(f"{name} is not downloaded: run `llmrun pull {name}`")
        snap, sel = _pull(name, progress)
    else:
        _, snap, sel = found
        if sel.note:
            progress.on_notice(sel.note)
    _touch_usage(_model_name(name.repo, snap, sel, _snapshot_files(snap)))
    return _model_path(snap, sel)


def pull(spec: str, progress: Progress | None = None) -> Path:
    """Download MODEL (or bring it up to date) and return its local path, like resolve_model."""
    if _local_path(spec) is not None:
        raise UsageError(f"{spec} is a local path; pull takes a Hub name like org/repo:QUANT")
    name = parse_name(spec)
    progress = progress or _NoticesToStderr()
    if _offline():
        found = _find_cached(name)
        if found is None:
            raise ModelNotFoundError(
                f"{name} is not in the cache and HF_HUB_OFFLINE=1 is set: unset it to download"
            )
        progress.on_notice(f"HF_HUB_OFFLINE=1: using the cached {name} without checking the Hub")
        return _model_path(found[1], found[2])
    snap, sel = _pull(name, progress)
    return _model_path(snap, sel)


def list_models() -> list[CachedModel]:
    """Every complete model in llmrun's cache and in the Hugging Face cache."""
    usage = _read_usage()
    rows = []
    for source, root in _roots():
        for repo_dir in sorted(root.glob("models--*--*")):
            repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
            snaps = repo_dir / "snapshots"
            if not (_inside(repo_dir, root) and snaps.is_dir()):
                continue
            for commit in sorted(os.listdir(snaps)):
                snap = _snapshot(repo_dir, commit)
                if snap is not None:
                    rows += _snapshot_rows(source, repo, snap, usage)
    return rows


def _snapshot_rows(
    source: str, repo: str, snap: Path, usage: dict[str, float]
) -> list[CachedModel]:
    files = _snapshot_files(snap)
    selections = []
    safetensors = _select_safetensors(files)
    if safetensors and _complete(snap, safetensors, source):
        selections.append(safetensors)
    for first in _gguf_groups(files):
        try:
            selections.append(Selection("gguf", tuple(_gguf_parts(first, files, repo))))
        except ModelNotFoundError:
            continue
    rows = []
    for sel in selections:
        name = _model_name(repo, snap, sel, files)
        path = _model_path(snap, sel)
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


def model_info(spec: str) -> dict[str, Any]:
    """What `llmrun show` prints, for a local path or a downloaded model (no network)."""
    local = _local_path(spec)
    if local is not None:
        return {"name": spec, **describe(local)}
    name = parse_name(spec)
    found = _find_cached(name)
    if found is None:
        raise ModelNotFoundError(f"{name} is not downloaded: run `llmrun pull {name}`")
    source, snap, sel = found
    info = describe(_model_path(snap, sel))
    return {
        "name": _model_name(name.repo, snap, sel, _snapshot_files(snap)),
        "source": source,
        **info,
    }


def plan_removal(spec: str) -> Removal:
    """What removing MODEL would delete, from every cache holding it, and the bytes freed.

    `org/repo` is the whole repo (every quant, partial downloads too); `org/repo:QUANT` or a
    file is those files and their blobs; `@revision` limits either to that snapshot.
    """
    name = parse_name(spec)
    repos, paths = [], []
    for _, root in _roots():
        repo_dir = _repo_dir(root, name.repo)
        if repo_dir.is_symlink() or (repo_dir.exists() and not _inside(repo_dir, root)):
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
    snaps = [s for s in (_snapshot(repo_dir, c) for c in commits) if s is not None]
    chosen = [_snapshot(repo_dir, name.revision)] if name.revision else snaps
    dropped: set[Path] = set()
    for snap in filter(None, chosen):
        files = _snapshot_files(snap)
        if name.file or name.quant:
            try:
                dropped |= {snap / f for f in _select(name, files).files}
            except (ModelNotFoundError, HubError):
                continue
        else:
            dropped |= {snap / f for f in files}
    if not dropped:
        return []
    kept = {p for snap in snaps for p in _walk(snap) if not p.is_dir()} - dropped
    if not kept:
        return [repo_dir]
    # Only blobs of this repo go: a link planted in the snapshot may point anywhere.
    blobs = {p.resolve() for p in dropped if p.is_symlink() and _inside(p, repo_dir / "blobs")}
    return sorted(dropped) + sorted(blobs - {p.resolve() for p in kept})


def _freed(paths: list[Path]) -> int:
    """Bytes that deleting `paths` gives back: a file lives on while any hard link to it does."""
    inodes: dict[tuple[int, int], list[int]] = {}
    for path in paths:
        for p in _walk(path) if path.is_dir() and not path.is_symlink() else [path]:
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                inodes.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])[2] += 1
    return sum(size for size, nlink, links in inodes.values() if links >= nlink)


def _prune(repo_dir: Path) -> None:
    """Drop emptied folders and snapshots, and the refs that pointed at them."""
    if not repo_dir.is_dir():
        return
    for folder in sorted(_walk(repo_dir / "snapshots"), reverse=True):
        if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
    for ref in list(_walk(repo_dir / "refs")):
        if ref.is_file() and not ref.is_symlink():
            if _snapshot(repo_dir, ref.read_text(errors="replace").strip()) is None:
                ref.unlink()


# ---- describing a model -----------------------------------------------------------------


def describe(path: Path) -> dict[str, Any]:
    """Architecture, size, weights, tokenizer, template and license of a local model."""
    if path.is_dir():
        return _describe_safetensors(path)
    return _describe_gguf(path)


def weight_stats(path: Path) -> dict[str, Any]:
    """Parameter count, main weight type, bytes per weight and per-type totals, from headers."""
    if path.is_dir():
        return _stats(_safetensors_tensors(path))
    stats = _stats(_gguf_tensors(_gguf_files(path)))
    return {**stats, "quant": quant_label(path.name) or stats["quant"]}


def _stats(tensors: list[tuple[str, tuple[int, ...], int]]) -> dict[str, Any]:
    types: dict[str, dict[str, int]] = {}
    for kind, shape, nbytes in tensors:
        row = types.setdefault(kind, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += math.prod(shape)
        row["bytes"] += nbytes
    params = sum(r["parameters"] for r in types.values())
    nbytes = sum(r["bytes"] for r in types.values())
    return {
        "parameters": params,
        "quant": max(types, key=lambda k: types[k]["bytes"]) if types else None,
        "bytes_per_weight": nbytes / params if params else None,
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])),
    }


def _files_listing(base: Path, files: list[Path]) -> dict[str, Any]:
    rows = [{"name": f.relative_to(base).as_posix(), "size": f.stat().st_size} for f in files]
    return {"files": rows, "size": sum(r["size"] for r in rows)}


def _gguf_files(path: Path) -> list[Path]:
    """A GGUF file, or every part of a split one (first part first)."""
    if path.suffix.lower() != ".gguf":
        raise ModelFormatError(f"{path}: not a .gguf file nor a folder with config.json")
    m = _SPLIT_RE.search(path.name)
    if not m:
        return [path]
    prefix, count = path.name[: m.start()], int(m.group(2))
    parts = [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFormatError(f"{path}: split GGUF with parts missing: {', '.join(missing)}")
    return parts


def _gguf_tensors(parts: list[Path]) -> list[tuple[str, tuple[int, ...], int]]:
    # Imported here: llmrun.loading imports torch, which resolving a name never needs.
    from llmrun.loading.gguf_io import read_gguf

    return [
        (t.ggml_type.name, t.shape, t.nbytes)
        for part in parts
        for t in read_gguf(part, with_tensors=False).tensors.values()
    ]


def _describe_gguf(path: Path) -> dict[str, Any]:
    from gguf import Keys

    from llmrun.loading.gguf_io import read_gguf

    parts = _gguf_files(path)
    header = read_gguf(parts[0], with_tensors=False)
    arch = header.get(Keys.General.ARCHITECTURE)
    tok_model = header.get(Keys.Tokenizer.MODEL)
    return {
        "format": "gguf",
        "path": str(parts[0]),
        "architecture": arch,
        "context_length": header.get(Keys.LLM.CONTEXT_LENGTH.format(arch=arch)),
        **weight_stats(parts[0]),
        "tokenizer": _GGUF_TOKENIZERS.get(tok_model, tok_model),
        "chat_template": header.get(Keys.Tokenizer.CHAT_TEMPLATE),
        "license": header.get(Keys.General.LICENSE),
        **_files_listing(path.parent, parts),
    }


_GGUF_TOKENIZERS = {"llama": "SentencePiece", "gpt2": "BPE", "bert": "WordPiece", "t5": "Unigram"}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise ModelFormatError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ModelFormatError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header


def _safetensors_tensors(folder: Path) -> list[tuple[str, tuple[int, ...], int]]:
    sel = _select_safetensors({p.name: 0 for p in folder.iterdir() if p.is_file()})
    if sel is None:
        raise ModelFormatError(f"{folder}: no config.json with .safetensors weights next to it")
    tensors = []
    for shard in (f for f in sel.files if f.endswith(".safetensors")):
        for key, t in safetensors_header(folder / shard).items():
            if key != "__metadata__":
                start, end = t["data_offsets"]
                tensors.append((t["dtype"], tuple(t["shape"]), end - start))
    return tensors


def _describe_safetensors(folder: Path) -> dict[str, Any]:
    stats = weight_stats(folder)
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise ModelFormatError(f"{folder / 'config.json'}: not a JSON object")
    text_config = config.get("text_config") or {}
    context = next(
        (
            c[k]
            for c in (config, text_config)
            for k in ("max_position_embeddings", "n_positions", "seq_length")
            if k in c
        ),
        None,
    )
    return {
        "format": "safetensors",
        "path": str(folder),
        "architecture": config.get("model_type") or (config.get("architectures") or [None])[0],
        "context_length": context,
        **stats,
        "tokenizer": _hf_tokenizer_kind(folder),
        "chat_template": _hf_chat_template(folder),
        "license": _readme_license(folder / "README.md"),
        **_files_listing(folder, sorted(p for p in folder.rglob("*") if p.is_file())),
    }


def _hf_tokenizer_kind(folder: Path) -> str | None:
    tok = _read_json(folder / "tokenizer.json")
    if isinstance(tok, dict) and isinstance(tok.get("model"), dict):
        return tok["model"].get("type")
    return "SentencePiece" if (folder / "tokenizer.model").is_file() else None


def _hf_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for source in ("tokenizer_config.json", "chat_template.json"):
        template = (_read_json(folder / source) or {}).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template:
            return template
    return None


def _readme_license(readme: Path) -> str | None:
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return None
    front = re.match(r"---\s*\n(.*?)\n---", text, re.DOTALL)
    found = re.search(r"^license:\s*(\S+)", front.group(1), re.MULTILINE) if front else None
    return found.group(1).strip("'\"") if found else None


# ---- downloading ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Blob:
    file: str
    url: str
    headers: dict[str, str]
    etag: str
    size: int
    path: Path


def _pull(name: HubName, progress: Progress) -> tuple[Path, Selection]:
    """Fetch the selected files of `name` at its current commit into llmrun's cache."""
    # Imported here: `list`, `show`, `rm` and cached runs never need the HTTP stack.
    from huggingface_hub import HfApi

    endpoint = _endpoint()
    with _hub_errors(name, endpoint):
        info = HfApi(endpoint=endpoint).model_info(
            name.repo, revision=name.revision or "main", files_metadata=True
        )
        if not info.sha:
            raise HubError(f"{endpoint} sent no commit for {name.repo}: is HF_ENDPOINT a Hub?")
        commit = checked_commit(name.repo, info.sha)
        sizes = {checked_file_name(name.repo, s.rfilename): s.size for s in info.siblings or []}
        sel = _select(name, {f: size or 0 for f, size in sizes.items()})
        if sel.note:
            progress.on_notice(sel.note)
        hf_repo = _repo_dir(hf_cache_dir(), name.repo)
        hf_snap = _snapshot(hf_repo, commit)
        if hf_snap and set(sel.files) <= set(_snapshot_files(hf_snap)):
            if _complete(hf_snap, sel, "huggingface"):
                progress.on_notice(f"using {name} from the Hugging Face cache at {hf_snap}")
                return hf_snap, sel
        repo_dir = _repo_dir(cache_dir(), name.repo)
        snap = repo_dir / "snapshots" / commit
        entries = {f: _snapshot_entry(name.repo, snap, f) for f in sel.files}
        # Weights last, so a cached snapshot with all its weights has its small files too.
        todo = sorted(
            (f for f, path in entries.items() if not path.is_file()),
            key=lambda f: (f.endswith((".safetensors", ".gguf")), f),
        )
        blobs = [_blob_info(name.repo, commit, f, sizes.get(f), repo_dir, endpoint) for f in todo]
        blobs = [b for b in blobs if not _reuse(b, name.repo, entries[b.file])]
        _check_space(name, blobs, repo_dir)
        transfers = [FileTransfer(b.file, b.size, _part_size(b)) for b in blobs]
        if transfers:
            progress.on_start(transfers, sum(t.size for t in transfers))
        for blob in blobs:
            _download(blob, progress)
            _link(entries[blob.file], blob.path)
            progress.on_file_done(blob.file)
    if name.revision != commit:
        ref = repo_dir / "refs" / (name.revision or "main")
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return snap, sel


@contextmanager
def _hub_errors(name: HubName, endpoint: str) -> Iterator[None]:
    """Turn huggingface_hub and network errors into one-line errors that say what to do."""
    import httpx2
    from huggingface_hub import errors as hf

    page = f"{endpoint}/{name.repo}"
    resume = "run the pull again: it resumes where it stopped"
    try:
        yield
    except hf.GatedRepoError as e:
        if _has_token():
            raise HubError(
                f"{name.repo} is gated and your token has no access to it: accept its license at "
                f"{page} with that account"
            ) from e
        raise HubError(
            f"{name.repo} is gated: accept its license at {page}, then set HF_TOKEN "
            "(or run `huggingface-cli login`)"
        ) from e
    except hf.RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"no model {name.repo} on {endpoint}: check the name (a private repo needs HF_TOKEN)"
        ) from e
    except hf.RevisionNotFoundError as e:
        raise ModelNotFoundError(
            f"{name.repo} has no revision {name.revision!r}: check the branch, tag or commit"
        ) from e
    except hf.RemoteEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{name.repo}: a file is missing on the Hub ({e.response.url})"
        ) from e
    except hf.OfflineModeIsEnabled as e:
        raise HubError(f"{name} is not in the cache and HF_HUB_OFFLINE=1 is set: unset it") from e
    except hf.HfHubHTTPError as e:
        status = e.response.status_code
        if status == 401:
            raise HubError(
                "the Hub refused the token (401): check HF_TOKEN or run `huggingface-cli login`"
            ) from e
        if status == 403:
            raise HubError(
                f"access to {name.repo} denied (403): accept its license at {page} and check "
                "that HF_TOKEN may read it"
            ) from e
        if status >= 500:
            raise HubError(
                f"{endpoint} failed with HTTP {status}: try again later; {resume}"
            ) from e
        raise HubError(f"{endpoint} answered HTTP {status} for {name.repo}") from e
    except hf.HFValidationError as e:
        raise UsageError(f"{name}: not a valid Hub name ({e})") from e
    except httpx2.TimeoutException as e:
        raise HubError(f"timed out talking to {endpoint}: check the network; {resume}") from e
    except (httpx2.ConnectError, hf.FileMetadataError) as e:
        raise HubError(
            f"cannot reach {endpoint} ({e}): check the network, proxy or HF_ENDPOINT; {resume}"
        ) from e
    except httpx2.TransportError as e:
        raise HubError(f"network error talking to {endpoint} ({e}); {resume}") from e
    except OSError as e:
        raise HubError(
            f"cannot write to {e.filename or cache_dir()}: {e.strerror or e} "
            "(LLMRUN_HOME moves llmrun's cache)"
        ) from e


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def _blob_info(
    repo: str, commit: str, file: str, listed_size: int | None, repo_dir: Path, endpoint: str
) -> _Blob:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, file, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    size = meta.size if meta.size is not None else listed_size
    if not meta.etag or size is None:
        raise HubError(f"{endpoint} sent no ETag or size for {repo}/{file}: is HF_ENDPOINT a Hub?")
    if listed_size is not None and listed_size != size:
        raise HubError(
            f"{repo}/{file}: the listing says {listed_size} bytes and the headers {size}; "
            "refusing a file whose size the server cannot agree on"
        )
    _check_url(f"{repo}/{file}", meta.location)
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"
    # Signed CDN URLs must not receive the Hub token.
    if urlsplit(meta.location)[:2] != urlsplit(url)[:2]:
        headers.pop("authorization", None)
    path = repo_dir / "blobs" / blob_name(meta.etag)
    return _Blob(file, meta.location, headers, meta.etag, size, path)


def _check_url(what: str, url: str) -> None:
    if urlsplit(url).scheme.lower() not in ("http", "https"):
        raise HubError(f"{what}: refused a redirect to {url!r}, which is not HTTP(S)")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _reuse(blob: _Blob, repo: str, link: Path) -> bool:
    """Link a blob that is already here or in the Hugging Face cache instead of downloading."""
    if not (blob.path.is_file() and blob.path.stat().st_size == blob.size):
        hf_repo = _repo_dir(hf_cache_dir(), repo)
        theirs = hf_repo / "blobs" / blob.path.name
        usable = theirs.is_file() and not theirs.is_symlink() and _inside(theirs, hf_repo)
        if not (usable and theirs.stat().st_size == blob.size):
            return False
        blob.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(theirs, blob.path)
        except FileExistsError:
            pass
        except OSError:
            return False  # another file system: downloading is the only way to share nothing
    _link(link, blob.path)
    return True


def _part_size(blob: _Blob) -> int:
    part = _part(blob)
    size = part.stat().st_size if part.is_file() else 0
    return size if size <= blob.size else 0


def _part(blob: _Blob) -> Path:
    return blob.path.with_name(blob.path.name + ".part")


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _check_space(name: HubName, blobs: list[_Blob], repo_dir: Path) -> None:
    need = sum(b.size - _part_size(b) for b in blobs)
    if not need:
        return
    repo_dir.mkdir(parents=True, exist_ok=True)
    free = _free_bytes(repo_dir)
    if need > free:
        raise HubError(
            f"not enough disk space for {name}: it needs {human_bytes(need)} more and "
            f"{repo_dir.parent} has {human_bytes(free)} free; free some space or set LLMRUN_HOME "
            "to a bigger disk"
        )


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (powers of 1000, as the Hub shows sizes)."""
    units = ("B", "kB", "MB", "GB", "TB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _new_hasher(etag: str, size: int) -> Any:
    if re.fullmatch(r"[0-9a-f]{64}", etag):
        return hashlib.sha256()
    if re.fullmatch(r"[0-9a-f]{40}", etag):
        hasher = hashlib.sha1()
        hasher.update(b"blob %d\0" % size)  # git's object header: the etag is the blob's id
        return hasher
    return None


class _Partial:
    """A blob's .part file and the running hash of exactly the bytes it holds."""

    def __init__(self, blob: _Blob) -> None:
        self.blob, self.path = blob, _part(blob)
        if self.path.is_file() and self.path.stat().st_size > blob.size:
            self.path.unlink()
        self.size = _part_size(blob)
        self.hasher = _new_hasher(blob.etag, blob.size)
        if self.size and self.hasher is not None:
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 20):
                    self.hasher.update(chunk)

    def restart(self) -> None:
        self.size, self.hasher = 0, _new_hasher(self.blob.etag, self.blob.size)
        self.path.write_bytes(b"")

    def append(self, f: Any, data: memoryview) -> None:
        while data:
            try:
                written = f.write(data)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise HubError(
                        f"disk full while downloading {self.blob.file}: the "
                        f"{human_bytes(self.size)} received are kept in {self.path}; free some "
                        "space and pull again to resume"
                    ) from e
                raise HubError(
                    f"cannot write {self.path}: {e.strerror}; pull again to resume"
                ) from e
            if self.hasher is not None:
                self.hasher.update(data[:written])
            self.size += written
            data = data[written:]

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.size, self.hasher = 0, _new_hasher(self.blob.etag, self.blob.size)

    def check(self) -> None:
        blob = self.blob
        if self.size != blob.size:
            problem = f"{self.size} bytes, expected {blob.size}"
        elif self.hasher is not None and self.hasher.hexdigest() != blob.etag:
            problem = "its hash does not match the Hub's etag"
        else:
            return
        self.path.unlink()
        raise HubError(f"{blob.file} arrived corrupt ({problem}) and was discarded: pull again")


def _download(blob: _Blob, progress: Progress) -> None:
    """Continue or start `blob`'s .part file, verify it, then give it its final name."""
    from huggingface_hub.utils import WeakFileLock

    blob.path.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(blob.path.with_name(blob.path.name + ".lock")):
        if blob.path.is_file():
            return  # another process finished it while this one waited for the lock
        partial = _Partial(blob)
        for attempt in range(_RETRIES):
            try:
                _fetch(partial, progress)
                break
            except Exception as e:
                if attempt == _RETRIES - 1 or not _transient(e):
                    raise
                time.sleep(0.5 * 2**attempt)
        partial.check()
        os.replace(partial.path, blob.path)


def _transient(error: Exception) -> bool:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError):
        return error.response.status_code >= 500
    return isinstance(error, httpx2.TransportError)


def _fetch(partial: _Partial, progress: Progress) -> None:
    """One GET of the bytes after the end of the .part file, never more than declared."""
    from huggingface_hub.utils import hf_raise_for_status

    blob = partial.blob
    if partial.size == blob.size:
        return
    headers = dict(blob.headers, Range=f"bytes={partial.size}-") if partial.size else blob.headers
    with _get(blob, headers) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        if partial.size and response.status_code != 206:  # the server ignored Range
            partial.restart()
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > blob.size - partial.size:
            raise HubError(
                f"{blob.file}: the server is sending {declared} bytes where "
                f"{blob.size - partial.size} remain of the {blob.size} it declared; refused"
            )
        with open(partial.path, "ab", buffering=0) as f:
            for chunk in response.iter_bytes():
                room = blob.size - partial.size
                partial.append(f, memoryview(chunk)[:room])
                progress.on_progress(blob.file, partial.size, blob.size)
                if len(chunk) > room:
                    partial.discard()
                    raise HubError(
                        f"{blob.file}: the server sent more than the {blob.size} bytes it "
                        "declared; the download was cut off there and discarded"
                    )


@contextmanager
def _get(blob: _Blob, headers: dict[str, str]) -> Iterator[Any]:
    """GET `blob.url`, following at most five redirects, each to an HTTP(S) URL only."""
    from huggingface_hub import get_session

    url, timeout = blob.url, constants.HF_HUB_DOWNLOAD_TIMEOUT
    for _ in range(6):
        request = get_session().build_request("GET", url, headers=headers, timeout=timeout)
        response = get_session().send(request, stream=True, follow_redirects=False)
        if not response.is_redirect:
            break
        response.close()
        target = urljoin(url, response.headers["location"])
        _check_url(blob.file, target)
        if urlsplit(target)[:2] != urlsplit(url)[:2]:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        url = target
    else:
        raise HubError(f"{blob.file}: more than five redirects from {blob.url}")
    try:
        yield response
    finally:
        response.close()


def _link(link: Path, blob: Path) -> None:
    """Point `link` at `blob` atomically (relative symlink, else a hard link)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        tmp.symlink_to(os.path.relpath(blob, link.parent))
    except OSError:
        os.link(blob, tmp)
    os.replace(tmp, link)

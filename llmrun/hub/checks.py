"""Names from outside, checked before they become local paths, in one place.

Every string that a server sends (a repo's file names, the commit id, an ETag) or that a
cache folder holds (refs, snapshot entries, links) passes one of these checks before it is
joined to a path: llmrun joins such names itself, so it must refuse what huggingface_hub
refuses, names that climb out of the snapshot folder, and links that lead out of the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from llmrun.errors import HubError

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_HASH_ETAG_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_DRIVE_RE = re.compile(r"[A-Za-z]:")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def is_safe_file_name(name: object) -> bool:
    """A relative POSIX path of plain parts: no '', '.', '..', backslash, control character
    (a terminal would obey it when the name is shown) or drive; each part a UTF-8 name that
    a file system takes (at most 255 bytes)."""
    return (
        isinstance(name, str)
        and not name.startswith("/")
        and not _DRIVE_RE.match(name)
        and "\\" not in name
        and not _CONTROL_RE.search(name)
        and all(
            part not in ("", ".", "..") and _name_bytes(part) <= 255 for part in name.split("/")
        )
    )


def _name_bytes(part: str) -> int:
    """A name's length in UTF-8 bytes; past any limit where it is not UTF-8 (a lone
    surrogate from JSON)."""
    try:
        return len(part.encode())
    except UnicodeEncodeError:
        return 1 << 30


def checked_file_name(repo: str, name: object) -> str:
    """A repo file name from the server, or HubError naming the repo and the name."""
    if not is_safe_file_name(name):
        raise HubError(f"{repo}: the server sent an unsafe file name {name!r}; nothing was written")
    return name


def checked_commit(repo: str, commit: object) -> str:
    """A commit id from the server (it names the snapshot folder): 40 lowercase hex digits."""
    if not isinstance(commit, str) or not COMMIT_RE.fullmatch(commit):
        raise HubError(
            f"{repo}: the server sent an unsafe commit id {commit!r}; nothing was written"
        )
    return commit


def blob_name(etag: str) -> str:
    """The file name in blobs/ for an etag: the etag when it is a hash, else its sha256."""
    return etag if _HASH_ETAG_RE.fullmatch(etag) else hashlib.sha256(etag.encode()).hexdigest()


def inside(path: Path, folder: Path) -> bool:
    """Whether `path`, with every link and '..' followed, lies within `folder` (also followed)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def snapshot_entry(repo: str, snap: Path, name: str) -> Path:
    """Where file `name` of a repo goes in `snap`; refused if a link there would lead out."""
    path = snap / checked_file_name(repo, name)
    if not inside(path.parent, snap):
        raise HubError(f"{repo}: {snap} leads out of the cache at {name!r}; nothing was written")
    return path


def walk(folder: Path) -> Iterator[Path]:
    """Everything below `folder` (files, links, folders), never following a link to a folder."""
    for top, dirs, files in os.walk(folder, followlinks=False):
        for entry in dirs + files:
            yield Path(top) / entry

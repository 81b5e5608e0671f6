"""Downloading a model's files from a Hub-protocol server into llmrun's cache.

huggingface_hub supplies names, URLs, auth, metadata and the HTTP session; the byte transfer
is llmrun's own, because huggingface_hub 2.4 restarts a download from zero in every new
process. A blob's bytes go to blobs/{etag}.part and continue there with an HTTP Range on the
next pull; the blob gets its final name only once its size and hash match the etag: sha256
for LFS files, git's blob sha1 for the others (an etag of any other shape is checked by size
only). Blobs already in the Hugging Face cache are hard-linked rather than downloaded again.
Every name the server sends passes checks.py before it touches the file system, no body is
kept past its declared size, and redirects go to HTTP(S) URLs only.
"""

from __future__ import annotations

import errno
import hashlib
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

from llmrun.errors import HubError, ModelNotFoundError, UsageError
from llmrun.hub.cache import complete, hf_cache_dir, repo_path, snapshot, snapshot_files
from llmrun.hub.checks import blob_name, checked_commit, checked_file_name, inside, snapshot_entry
from llmrun.hub.names import HubName, Selection, select
from llmrun.paths import cache_dir

_RETRIES = 3


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


class NoticesToStderr:
    """The reporter used when the caller passes none: notices only, as plain stderr lines."""

    def on_notice(self, message: str) -> None:
        print(message, file=sys.stderr)

    def on_start(self, files: list[FileTransfer], total_bytes: int) -> None:
        pass

    def on_progress(self, name: str, done: int, total: int) -> None:
        pass

    def on_file_done(self, name: str) -> None:
        pass


def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now, else the Hub."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids the network."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class _Blob:
    file: str
    url: str
    headers: dict[str, str]
    etag: str
    size: int
    path: Path


def fetch(name: HubName, progress: Progress) -> tuple[Path, Selection]:
    """Fetch the selected files of `name` at its current commit into llmrun's cache, or
    find them all in the Hugging Face cache; (snapshot folder, files)."""
    # Imported here: `list`, `show`, `rm` and cached runs never need the HTTP stack.
    from huggingface_hub import HfApi

    endpoint = hub_endpoint()
    with _hub_errors(name, endpoint):
        with _server_reply(endpoint):
            info = HfApi(endpoint=endpoint).model_info(
                name.repo, revision=name.revision or "main", files_metadata=True
            )
            siblings = list(info.siblings or [])
        if not info.sha:
            raise HubError(f"{endpoint} sent no commit for {name.repo}: is HF_ENDPOINT a Hub?")
        commit = checked_commit(name.repo, info.sha)
        sizes = {
            checked_file_name(name.repo, s.rfilename): _listed_size(name.repo, s.rfilename, s.size)
            for s in siblings
        }
        sel = select(name, {f: size or 0 for f, size in sizes.items()})
        if sel.note:
            progress.on_notice(sel.note)
        hf_repo = repo_path(hf_cache_dir(), name.repo)
        hf_snap = snapshot(hf_repo, commit)
        if hf_snap and set(sel.files) <= set(snapshot_files(hf_snap)):
            if complete(hf_snap, sel, "huggingface"):
                progress.on_notice(f"using {name} from the Hugging Face cache at {hf_snap}")
                return hf_snap, sel
        repo_dir = repo_path(cache_dir(), name.repo)
        snap = repo_dir / "snapshots" / commit
        entries = {f: snapshot_entry(name.repo, snap, f) for f in sel.files}
        # Weights last, so a cached snapshot with all its weights has its small files too.
        # An entry counts only as a file in this cache (a link planted there to a file
        # elsewhere is replaced).
        todo = sorted(
            (f for f, path in entries.items() if not (path.is_file() and inside(path, repo_dir))),
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


def _listed_size(repo: str, file: str, size: object) -> int | None:
    """A size from the repo's listing: a byte count, or None where it gives none."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        return size
    raise HubError(f"{repo}: the server lists {file} with a size of {size!r}, not a byte count")


@contextmanager
def _server_reply(endpoint: str) -> Iterator[None]:
    """Around reading what a server sent: a reply that is not what the Hub protocol
    says (not JSON, fields of the wrong type, a malformed URL) is one error line."""
    try:
        yield
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubError(
            f"{endpoint} sent a reply llmrun cannot read ({type(e).__name__}: {e}): is "
            "HF_ENDPOINT a Hugging Face Hub?"
        ) from e


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
        host = urlsplit(str(e.response.url)).netloc
        if host and host != urlsplit(endpoint).netloc and status in (401, 403):
            raise HubError(
                f"the download server {host} refused {name.repo}'s file (HTTP {status}): its "
                f"signed link may have expired; {resume}"
            ) from e
        if status == 429:
            raise HubError(
                f"{host or endpoint} is rate-limiting this machine (HTTP 429): wait a few "
                f"minutes, then {resume}"
            ) from e
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
    with _server_reply(endpoint):
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


def _reuse(blob: _Blob, repo: str, link: Path) -> bool:
    """Link a blob that is already here or in the Hugging Face cache instead of downloading."""
    if not (_regular(blob.path) and blob.path.stat().st_size == blob.size):
        hf_repo = repo_path(hf_cache_dir(), repo)
        theirs = hf_repo / "blobs" / blob.path.name
        usable = theirs.is_file() and not theirs.is_symlink() and inside(theirs, hf_repo)
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


def _regular(path: Path) -> bool:
    """A file of its own here, not a link to one elsewhere."""
    return path.is_file() and not path.is_symlink()


def _part_size(blob: _Blob) -> int:
    part = _part(blob)
    size = part.stat().st_size if _regular(part) else 0
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
        if self.path.is_symlink() or (self.path.is_file() and self.path.stat().st_size > blob.size):
            self.path.unlink()  # never written through a link: it may lead anywhere
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
        if _regular(blob.path):
            have = blob.path.stat().st_size
            if have == blob.size:
                return  # another process finished it while this one waited for the lock
            raise HubError(
                f"{blob.file}: the server gives it the ETag of a {have}-byte file already here "
                f"and declares {blob.size} bytes; refusing a file whose ETag and size disagree"
            )
        partial = _Partial(blob)
        for attempt in range(_RETRIES):
            try:
                _fetch(partial, progress)
                break
            except Exception as e:
                if attempt == _RETRIES - 1 or not _transient(e):
                    raise
                time.sleep(0.5 * 2**attempt)
        partial.path.touch()  # an empty file had no bytes to fetch, yet becomes a blob
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
        start = _range_start(response)
        if partial.size and start != partial.size:
            if start != 0:  # a 206 of another range, or of none it names
                partial.discard()
                raise HubError(
                    f"{blob.file}: asked to resume at byte {partial.size}, the server sent "
                    f"another range ({response.headers.get('content-range')!r}); the partial "
                    "download was discarded: pull again"
                )
            partial.restart()  # the server ignored Range: the whole file follows
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > blob.size - partial.size:
            raise HubError(
                f"{blob.file}: the server is sending {declared} bytes where "
                f"{blob.size - partial.size} remain of the {blob.size} it declared; refused"
            )
        with open(_append_only(partial.path), "ab", buffering=0) as f:
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


def _range_start(response: Any) -> int | None:
    """Where the body starts in the file: 0 for a whole file (200), a 206's Content-Range
    start, None for a 206 without a valid one."""
    if response.status_code != 206:
        return 0
    m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("content-range", "").strip())
    return int(m.group(1)) if m else None


def _append_only(path: Path) -> int:
    """A descriptor appending to `path`, which must not be a link (O_NOFOLLOW)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    return os.open(path, flags, 0o644)


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
        try:
            target = urljoin(url, response.headers["location"])
            urlsplit(target).port  # noqa: B018 (raises for a malformed host or port)
        except (KeyError, ValueError) as e:
            raise HubError(
                f"{blob.file}: {url} answered {response.status_code} without a usable Location"
            ) from e
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
    tmp = link.with_name(f".llmrun-{os.getpid()}.tmp")  # short: link.name may be 255 bytes
    tmp.unlink(missing_ok=True)
    try:
        tmp.symlink_to(os.path.relpath(blob, link.parent))
    except OSError:
        os.link(blob, tmp)
    os.replace(tmp, link)

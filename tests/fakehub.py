"""A Hugging Face Hub on 127.0.0.1 that speaks what huggingface_hub 2.4 asks of it, for tests.

Checked against huggingface_hub 2.4's source (hf_api.model_info, file_download.
get_hf_file_metadata and http_get, utils/_http.hf_raise_for_status):

- GET /api/models/{repo}[/revision/{rev}][?blobs=true]: the model info; with blobs=true the
  siblings carry size, blobId (git sha1) and lfs {sha256, size, pointerSize}.
- HEAD and GET /{repo}/resolve/{rev}/{path}: a regular file answers 200 with ETag (its git blob
  sha1), X-Repo-Commit and Content-Length; an LFS file answers 302 to the "CDN", a second server
  on another port (so the client drops its token, as with the real CDN), with X-Linked-Etag
  (sha256), X-Linked-Size and X-Repo-Commit. Ranges are honoured (206, Content-Range, 416).
- Errors as the Hub marks them with X-Error-Code: RepoNotFound (401 without a token, else 404),
  RevisionNotFound, EntryNotFound, GatedRepo (401 without a token, 403 with a wrong one).
- A renamed repo answers 307 to its new name.
- Xet headers are never sent, so clients stay on plain HTTP.

Test knobs: `throttle` (CDN bytes per second), `cut_after` (the next CDN body stops after that
many bytes and the connection closes), `fail` ({path substring: status}). `requests` logs
(server, method, path, lower-cased headers) of everything received.

Hostile knobs, for what a mirror, a proxy or a compromised host could send: `commit` (the
model info's sha, any string), `sizes` ({path: size} in the listing), `etag` (every ETag and
X-Linked-Etag), `location` (the LFS redirect's Location), `cdn_redirect` (the CDN answers a
GET with a redirect there), `cdn_extra` (bytes appended to CDN bodies, with a Content-Length
that counts them, or none at all with `cdn_chunked`), `range_from` (a Range is answered 206
with as many bytes as asked for, but from that offset, as Content-Range says), `info_body`
(the model info's 200 body, in place of the JSON).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model", ".onnx", ".msgpack")
TOKEN = "hf_fakehub_token"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
    )


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False


@dataclass
class Request:
    server: str
    method: str
    path: str
    headers: dict[str, str]


class FakeHub:
    """Two threaded HTTP servers (Hub and CDN) over in-memory repos."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.renamed: dict[str, str] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.throttle: float | None = None
        self.cut_after: int | None = None
        self.fail: dict[str, int] = {}
        self.commit: str | None = None
        self.sizes: dict[str, int] = {}
        self.etag: str | None = None
        self.location: str | None = None
        self.cdn_redirect: str | None = None
        self.cdn_extra = b""
        self.cdn_chunked = False
        self.range_from: int | None = None
        self.info_body: bytes | None = None
        self._servers = [_server(self, "api"), _server(self, "cdn")]
        self.url = _url(self._servers[0])
        self.cdn_url = _url(self._servers[1])

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        revision: str = "main",
        gated: bool = False,
        private: bool = False,
    ) -> str:
        """Add a commit holding `files` and point `revision` at it; returns the commit id."""
        repo = self.repos.setdefault(repo_id, Repo(gated=gated, private=private))
        digest = hashlib.sha1(repo_id.encode() + str(len(repo.commits)).encode())
        for name in sorted(files):
            digest.update(
                name.encode(errors="surrogatepass") + hashlib.sha256(files[name]).digest()
            )
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs[revision] = commit
        for data in files.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return commit

    def served(self, server: str = "cdn", method: str = "GET") -> list[Request]:
        return [r for r in self.requests if r.server == server and r.method == method]

    def start(self) -> FakeHub:
        for server in self._servers:
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _server(hub: FakeHub, role: str) -> ThreadingHTTPServer:
    handler = type(f"{role}Handler", (_Handler,), {"hub": hub, "role": role})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    return server


def _url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub
    role: str

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def _handle(self) -> None:
        hub = self.hub
        headers = {k.lower(): v for k, v in self.headers.items()}
        hub.requests.append(Request(self.role, self.command, self.path, headers))
        for marker, status in hub.fail.items():
            if marker in self.path:
                return self._reply(status, b"injected failure", {"X-Error-Message": "boom"})
        url = urlsplit(self.path)
        if self.role == "cdn":
            return self._cdn(url.path)
        if url.path.startswith("/api/models/"):
            return self._model_info(url.path.removeprefix("/api/models/"), parse_qs(url.query))
        parts = url.path.lstrip("/").split("/", 4)
        if len(parts) == 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote(parts[4]))
        self._reply(404, b"not found")

    # -- Hub API -----------------------------------------------------------------------

    def _repo(self, repo_id: str, *, files: bool) -> Repo | None:
        """The repo, or None after answering with the error the Hub would send."""
        repo = self.hub.repos.get(repo_id)
        auth = self.headers.get("Authorization")
        if repo is not None and repo.private and auth != f"Bearer {TOKEN}":
            repo = None
        if repo is None:
            status = 404 if auth else 401
            self._reply(
                status,
                b'{"error":"Repository not found"}',
                {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
            )
            return None
        if files and repo.gated and auth != f"Bearer {TOKEN}":
            message = f"Access to model {repo_id} is restricted. You must have access to it."
            self._reply(
                403 if auth else 401,
                json.dumps({"error": message}).encode(),
                {"X-Error-Code": "GatedRepo", "X-Error-Message": message},
            )
            return None
        return repo

    def _redirect_renamed(self, repo_id: str) -> bool:
        new = self.hub.renamed.get(repo_id)
        if new is None:
            return False
        self._reply(307, b"", {"Location": self.path.replace(f"/{repo_id}", f"/{new}", 1)})
        return True

    def _commit(self, repo: Repo, revision: str) -> str | None:
        commit = repo.refs.get(revision) or (revision if revision in repo.commits else None)
        if commit is None:
            message = f"Invalid rev id: {revision}"
            self._reply(
                404,
                json.dumps({"error": message}).encode(),
                {"X-Error-Code": "RevisionNotFound", "X-Error-Message": message},
            )
        return commit

    def _model_info(self, rest: str, query: dict[str, list[str]]) -> None:
        org, name, *tail = rest.split("/")
        repo_id = f"{org}/{name}"
        if self._redirect_renamed(repo_id):
            return
        repo = self._repo(repo_id, files=False)
        if repo is None:
            return
        revision = unquote(tail[1]) if len(tail) == 2 and tail[0] == "revision" else "main"
        commit = self._commit(repo, revision)
        if commit is None:
            return
        if self.hub.info_body is not None:
            return self._reply(200, self.hub.info_body, {"Content-Type": "application/json"})
        blobs = query.get("blobs") == ["true"]
        siblings = []
        for path, data in sorted(repo.commits[commit].items()):
            sibling: dict[str, object] = {"rfilename": path}
            if blobs:
                lfs = path.endswith(LFS_SUFFIXES)
                sibling["size"] = self.hub.sizes.get(path, len(data))
                sibling["blobId"] = git_blob_sha1(lfs_pointer(data) if lfs else data)
                if lfs:
                    sha = hashlib.sha256(data).hexdigest()
                    pointer_size = len(lfs_pointer(data))
                    sibling["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": pointer_size}
            siblings.append(sibling)
        info = {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": org,
            "sha": commit if self.hub.commit is None else self.hub.commit,
            "lastModified": "2024-05-01T12:00:00.000Z",
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, path: str) -> None:
        if self._redirect_renamed(repo_id):
            return
        repo = self._repo(repo_id, files=True)
        if repo is None:
            return
        commit = self._commit(repo, revision)
        if commit is None:
            return
        data = repo.commits[commit].get(path)
        if data is None:
            self._reply(
                404,
                b'{"error":"Entry not found"}',
                {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit},
            )
            return
        if path.endswith(LFS_SUFFIXES):
            sha = hashlib.sha256(data).hexdigest()
            location = f"{self.hub.cdn_url}/blobs/{sha}?X-Amz-Signature={quote(commit)}"
            headers = {
                "Location": self.hub.location or location,
                "ETag": f'"{git_blob_sha1(lfs_pointer(data))}"',
                "X-Linked-Etag": f'"{self.hub.etag or sha}"',
                "X-Linked-Size": str(len(data)),
                "X-Repo-Commit": commit,
            }
            return self._reply(302, b"", headers)
        headers = {"ETag": f'"{self.hub.etag or git_blob_sha1(data)}"', "X-Repo-Commit": commit}
        self._send_file(data, headers)

    # -- CDN ---------------------------------------------------------------------------

    def _cdn(self, path: str) -> None:
        if self.hub.cdn_redirect:
            return self._reply(302, b"", {"Location": self.hub.cdn_redirect})
        data = self.hub.blobs.get(path.removeprefix("/blobs/"))
        if data is None:
            return self._reply(404, b"NoSuchKey")
        self._send_file(
            data + self.hub.cdn_extra, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        )

    # -- plumbing ----------------------------------------------------------------------

    def _send_file(self, data: bytes, headers: dict[str, str]) -> None:
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        status, body = 200, data
        wanted = self.headers.get("Range")
        if wanted:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), int(last) if last else len(data) - 1
            if start >= len(data):
                return self._reply(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            status, body = 206, data[start : end + 1]
            if self.hub.range_from is not None:
                start = self.hub.range_from
                body = data[start : start + len(body)]
            headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(data)}"
        self._reply(status, body, headers, stream=self.role == "cdn")

    def _reply(
        self, status: int, body: bytes, headers: dict[str, str] | None = None, stream: bool = False
    ) -> None:
        hub = self.hub
        chunked = stream and hub.cdn_chunked and self.command == "GET"
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if chunked:
            try:
                for i in range(0, len(body), 8192):
                    piece = body[i : i + 8192]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading: what the over-long-body tests expect
            return
        limit = len(body)
        if stream and hub.cut_after is not None:
            limit, hub.cut_after = min(limit, hub.cut_after), None
            self.close_connection = True
        step = 8192
        try:
            for i in range(0, limit, step):
                self.wfile.write(body[i : min(i + step, limit)])
                if stream and hub.throttle:
                    self.wfile.flush()
                    time.sleep(step / hub.throttle)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

"""What a hostile Hub-protocol server (or a planted cache folder) sends never reaches the file
system outside llmrun's and the Hugging Face caches.

The server is the fake Hub with its hostile knobs; after each case a walk over the whole
temporary folder proves that nothing outside the two caches was created or changed.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from fakehub import FakeHub
from huggingface_hub import constants
from in_process import llmrun

from llmrun import hub
from llmrun.errors import HubError, ModelNotFoundError

REPO = "test/tiny-GGUF"
GOOD = {"tiny-Q8_0.gguf": b"GGUF" + bytes(range(256)) * 40, "README.md": b"# tiny\n"}
VICTIM = b"the user's own file\n"


def tree(root: Path, skip: tuple[Path, ...]) -> dict[str, tuple]:
    """Every entry below `root` but the skipped folders: kind, size, mtime, link target, bytes."""
    found = {}
    for top, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if Path(top, d) not in skip]
        for name in dirs + files:
            path = Path(top, name)
            st = path.lstat()
            link = os.readlink(path) if path.is_symlink() else None
            data = path.read_bytes() if path.is_file() and not link else None
            found[str(path.relative_to(root))] = (
                st.st_mode,
                st.st_size,
                st.st_mtime_ns,
                link,
                data,
            )
    return found


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A fake Hub with REPO, caches under tmp_path, and a victim folder beside them whose
    tree must come out of every test unchanged."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "llmrun"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "target.gguf").write_bytes(VICTIM)
    (victim / "notes").mkdir()
    (victim / "notes" / "todo.txt").write_bytes(VICTIM)
    caches = (tmp_path / "llmrun", tmp_path / "hf")
    before = tree(tmp_path, caches)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake
    assert tree(tmp_path, caches) == before


def snapshot_dir(commit: str) -> Path:
    return (
        Path(os.environ["LLMRUN_HOME"])
        / "models"
        / "models--test--tiny-GGUF"
        / "snapshots"
        / commit
    )


def blobs_dir() -> Path:
    return Path(os.environ["LLMRUN_HOME"]) / "models" / "models--test--tiny-GGUF" / "blobs"


# From a snapshot folder, five '..' reach the temporary folder that holds victim/.
UNSAFE_NAMES = [
    "../../../../../victim/target.gguf",
    "/tmp/evil.gguf",
    "sub/../../../../../../victim/target.gguf",
    "sub\\..\\..\\evil.gguf",
    "C:evil.gguf",
    "./evil.gguf",
    "sub//evil.gguf",
    "evil\0.gguf",
    "",
    "\x1b[2J\x1b[31mPWNED\x1b[0m-Q8_0.gguf",  # shown to the user, a terminal would obey it
    "evil\n-Q4_K_M.gguf",
    "x\r.gguf",
    "a" * 251 + ".gguf",  # longer than a file system's 255-byte names
    "\ud800.gguf",  # not UTF-8: no file system name
]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_unsafe_file_names_are_refused(server, name):
    server.add_repo(REPO, {**GOOD, name: b"GGUF server bytes"})
    with pytest.raises(HubError) as e:
        hub.pull(f"{REPO}:Q8_0")
    assert (
        str(e.value) == f"{REPO}: the server sent an unsafe file name {name!r}; nothing was written"
    )
    assert not server.served("api", "HEAD") and not server.served("cdn")


@pytest.mark.parametrize(
    "commit",
    ["../../../../victim", "A" * 40, "deadbeef", "0" * 39 + "/", "0" * 40 + "\n", ""],
)
def test_unsafe_commit_ids_are_refused(server, commit):
    server.add_repo(REPO, GOOD)
    server.commit = commit
    with pytest.raises(HubError, match=f"{REPO}: "):
        hub.pull(f"{REPO}:Q8_0")
    assert not server.served("api", "HEAD") and not server.served("cdn")


def test_the_command_line_says_one_error_line(server):
    name = "../../../../../victim/target.gguf"
    server.add_repo(REPO, {**GOOD, name: b"x"})
    r = llmrun("pull", REPO)
    assert (r.returncode, r.stdout) == (1, "")
    assert (
        r.stderr
        == f"error: {REPO}: the server sent an unsafe file name {name!r}; nothing was written\n"
    )


@pytest.mark.parametrize("etag", ["../../../../victim/target.gguf", "..", "/etc/passwd", "a/b"])
def test_an_etag_names_only_a_file_in_blobs(server, etag):
    commit = server.add_repo(REPO, GOOD)
    server.etag = etag
    path = hub.pull(f"{REPO}:Q8_0")
    assert path.read_bytes() == GOOD["tiny-Q8_0.gguf"]
    blob = path.resolve()
    assert blob.parent == blobs_dir().resolve()
    assert blob.name == hashlib.sha256(etag.encode()).hexdigest()
    assert path.parent == snapshot_dir(commit)


def test_a_body_longer_than_its_declared_length_is_refused(server):
    server.add_repo(REPO, GOOD)
    server.cdn_extra = b"more bytes than the listing and the headers declared" * 100
    with pytest.raises(HubError, match="tiny-Q8_0.gguf: the server is sending .* bytes where"):
        hub.pull(f"{REPO}:Q8_0")
    assert [p.suffix for p in blobs_dir().iterdir()] == [".lock"], "nothing written but the lock"


def test_an_endless_body_is_cut_off_at_the_declared_size(server):
    server.add_repo(REPO, GOOD)
    server.cdn_extra = b"\0" * (1 << 20)
    server.cdn_chunked = True
    with pytest.raises(HubError, match="sent more than the 10244 bytes it declared"):
        hub.pull(f"{REPO}:Q8_0")
    assert not list(blobs_dir().glob("*.part")), "the cut-off bytes were discarded"
    assert not snapshot_dir(server.repos[REPO].refs["main"]).exists()


def test_a_listing_that_disagrees_with_the_headers_is_refused(server):
    server.add_repo(REPO, GOOD)
    server.sizes = {"tiny-Q8_0.gguf": 10}
    with pytest.raises(HubError, match="the listing says 10 bytes and the headers 10244"):
        hub.pull(f"{REPO}:Q8_0")
    assert not server.served("cdn")


@pytest.mark.parametrize("where", ["location", "cdn_redirect"])
@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.invalid/x", "data:,GGUF"])
def test_redirects_to_other_than_http_are_refused(server, where, url):
    server.add_repo(REPO, GOOD)
    setattr(server, where, url)
    with pytest.raises(HubError, match=f"refused a redirect to '{url}', which is not HTTP"):
        hub.pull(f"{REPO}:Q8_0")


# ---- a planted cache -----------------------------------------------------------------------


def plant(tmp_path: Path) -> tuple[Path, str]:
    """A cache repo whose folders lead outside: a ref naming a path, a snapshot entry linking
    to the victim's file, a snapshot folder and a refs folder that are links to the victim."""
    repo_dir = Path(os.environ["LLMRUN_HOME"]) / "models" / "models--test--tiny-GGUF"
    commit, other = "a" * 40, "b" * 40
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    (repo_dir / "refs" / "main").write_text("../../../../victim")
    (repo_dir / "refs" / "pr").symlink_to(tmp_path / "victim" / "notes")
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "evil-Q8_0.gguf").symlink_to(tmp_path / "victim" / "target.gguf")
    (snap / "notes").symlink_to(tmp_path / "victim" / "notes")
    (repo_dir / "snapshots" / other).symlink_to(tmp_path / "victim")
    return repo_dir, commit


def test_a_planted_cache_is_neither_listed_nor_run(server, tmp_path):
    _, commit = plant(tmp_path)
    assert [m for m in hub.list_models() if m.name.startswith(REPO)] == []
    for name in (f"{REPO}:Q8_0", f"{REPO}@{commit}", f"{REPO}/target.gguf@{'b' * 40}"):
        with pytest.raises(ModelNotFoundError):
            hub.resolve_model(name, pull=False)
        with pytest.raises(ModelNotFoundError):
            hub.model_info(name)


@pytest.mark.parametrize(
    "name", [f"{REPO}:Q8_0", f"{REPO}@{'a' * 40}", f"{REPO}@{'b' * 40}", f"{REPO}@main", REPO]
)
def test_rm_on_a_planted_cache_deletes_nothing_outside(server, tmp_path, name):
    repo_dir, _ = plant(tmp_path)
    try:
        hub.remove(name)
    except (ModelNotFoundError, HubError):
        pass
    if name == REPO:
        assert not repo_dir.exists()


def test_rm_refuses_a_repo_folder_that_is_a_link_outside(server, tmp_path):
    models = Path(os.environ["LLMRUN_HOME"]) / "models"
    models.mkdir(parents=True)
    (models / "models--test--tiny-GGUF").symlink_to(tmp_path / "victim")
    with pytest.raises(HubError, match="outside the cache: llmrun deletes nothing there"):
        hub.remove(REPO)


def test_links_planted_in_the_cache_are_never_written_through(server, tmp_path):
    """A .part link (the download would append to its target) and a snapshot entry linked
    to a file elsewhere (the pull would take it for done) are replaced, not followed."""
    commit = server.add_repo(REPO, GOOD)
    blob = hashlib.sha256(GOOD["tiny-Q8_0.gguf"]).hexdigest()
    blobs_dir().mkdir(parents=True)
    (blobs_dir() / f"{blob}.part").symlink_to(tmp_path / "victim" / "target.gguf")
    snapshot_dir(commit).mkdir(parents=True)
    (snapshot_dir(commit) / "tiny-Q8_0.gguf").symlink_to(tmp_path / "victim" / "notes" / "todo.txt")
    path = hub.pull(f"{REPO}:Q8_0")
    assert path.read_bytes() == GOOD["tiny-Q8_0.gguf"]
    assert path.resolve() == (blobs_dir() / blob).resolve()
    assert len(server.served("cdn")) == 1


def test_an_empty_file_is_pulled(server):
    server.add_repo(REPO, {**GOOD, "empty-Q4_0.gguf": b""})
    path = hub.pull(f"{REPO}:Q4_0")
    assert path.is_file() and path.read_bytes() == b""


@pytest.mark.parametrize("start", [0, 7])
def test_a_resume_answered_from_another_offset_keeps_nothing(server, start):
    """With an ETag that is no hash only the size is checked: a 206 whose Content-Range
    starts elsewhere than the bytes kept would make a corrupt file of the right size."""
    server.add_repo(REPO, GOOD)
    server.etag = "not-a-hash"
    data = GOOD["tiny-Q8_0.gguf"]
    blobs_dir().mkdir(parents=True)
    part = blobs_dir() / (hashlib.sha256(b"not-a-hash").hexdigest() + ".part")
    part.write_bytes(data[:100])
    server.range_from = start
    with pytest.raises(HubError, match="arrived corrupt|sent another range"):
        hub.pull(f"{REPO}:Q8_0")
    assert not part.exists()
    server.range_from = None
    assert hub.pull(f"{REPO}:Q8_0").read_bytes() == data


def test_an_etag_that_names_a_file_of_another_size_is_refused(server):
    other = b"GGUF" + b"other bytes" * 30
    server.add_repo(REPO, {**GOOD, "tiny-Q4_0.gguf": other})
    server.etag = "same-etag-for-all"
    assert hub.pull(f"{REPO}:Q8_0").read_bytes() == GOOD["tiny-Q8_0.gguf"]
    with pytest.raises(HubError, match="ETag of a 10244-byte file already here and declares 334"):
        hub.pull(f"{REPO}:Q4_0")


@pytest.mark.parametrize(
    "body",
    [
        b"<html>a login page</html>",
        b"{}",
        b'{"id": "test/tiny-GGUF", "sha": "' + b"a" * 40 + b'", "siblings": "tiny-Q8_0.gguf"}',
        b'{"id": "test/tiny-GGUF", "sha": "' + b"a" * 40 + b'", "siblings": {"a": 1}}',
    ],
)
def test_a_model_info_that_is_not_the_hubs_is_one_error(server, body):
    server.add_repo(REPO, GOOD)
    server.info_body = body
    with pytest.raises(HubError, match="sent a reply llmrun cannot read .*: is HF_ENDPOINT a"):
        hub.pull(f"{REPO}:Q8_0")


def test_a_listed_size_that_is_not_a_byte_count_is_refused(server):
    server.add_repo(REPO, GOOD)
    server.sizes = {"tiny-Q8_0.gguf": "10244"}
    with pytest.raises(HubError, match="lists tiny-Q8_0.gguf with a size of '10244', not a byte"):
        hub.pull(f"{REPO}:Q8_0")


def test_a_redirect_to_a_malformed_url_is_one_error(server):
    server.add_repo(REPO, GOOD)
    server.cdn_redirect = "http://[::1"
    with pytest.raises(HubError, match="tiny-Q8_0.gguf: .* answered 302 without a usable Location"):
        hub.pull(f"{REPO}:Q8_0")


@pytest.mark.parametrize(
    ("where", "status", "says"),
    [
        ("/api/models/", 429, "is rate-limiting this machine"),
        ("/blobs/", 429, "is rate-limiting this machine"),
        (
            "/blobs/",
            403,
            "the download server 127.0.0.1:.* refused .* signed link may have expired",
        ),
    ],
)
def test_rate_limits_and_download_server_refusals_say_so(server, where, status, says):
    server.add_repo(REPO, GOOD)
    server.fail = {where: status}
    with pytest.raises(HubError, match=says):
        hub.pull(f"{REPO}:Q8_0")

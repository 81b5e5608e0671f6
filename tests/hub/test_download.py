"""pull against a local fake Hub driven through the real huggingface_hub client: safetensors
and GGUF repos, resume after kill -9, a cut connection or a full disk, errors, offline mode,
and the Hugging Face cache used in place."""

from __future__ import annotations

import hashlib
import json
import signal
import socket

import numpy as np
import pytest
import safetensors.numpy
from fakehub import TOKEN
from hubkit import (
    GGUF_REPO,
    ST_PULLED,
    ST_REPO,
    Recorder,
    cache,
    run_pull,
    sha256,
    wait_for_part,
)
from huggingface_hub import hf_hub_download

from llmrun import hub
from llmrun.errors import HubError, ModelNotFoundError, UsageError
from llmrun.hub import download

# ---- pulling ------------------------------------------------------------------------------


def test_pull_safetensors_repo(fake, st_files):
    progress = Recorder()
    path = hub.pull(ST_REPO, progress)
    wanted = set(ST_PULLED)
    assert {p.name for p in path.iterdir()} == wanted
    for name in wanted:
        assert (path / name).read_bytes() == st_files[name]
    assert not [r.path for r in fake.requests if ".bin" in r.path or "onnx" in r.path]
    # LFS blobs are named by sha256, git files by their git blob sha1.
    blob = (path / "model.safetensors").resolve()
    assert blob.name == sha256(st_files["model.safetensors"])
    assert (path / "config.json").resolve().name == hashlib.sha1(
        b"blob %d\0" % len(st_files["config.json"]) + st_files["config.json"]
    ).hexdigest()
    assert (cache(ST_REPO) / "refs" / "main").read_text() == path.name
    files, total = progress.started[0]
    assert total == sum(len(st_files[n]) for n in wanted) == sum(f.size for f in files)
    assert files[-1].name == "model.safetensors"  # weights last
    assert progress.last["model.safetensors"] == (blob.stat().st_size,) * 2
    assert sorted(progress.done) == sorted(wanted)
    # A second pull checks the Hub once and downloads nothing.
    before = len(fake.requests)
    assert hub.pull(ST_REPO) == path
    assert [r.path for r in fake.requests[before:]] == [
        f"/api/models/{ST_REPO}/revision/main?blobs=true"
    ]


def test_pull_a_mistral_native_repo(fake):
    """A repo of Mistral's own format only (params.json, consolidated.safetensors,
    tekken.json): its files and no others, listed and shown as a Mistral model."""
    weights = {
        "tok_embeddings.weight": np.zeros((32, 16), np.float16),
        "layers.0.attention.wq.weight": np.zeros((16, 16), np.float16),
        "norm.weight": np.ones(16, np.float32),
    }
    params = {"dim": 16, "n_layers": 1, "hidden_dim": 24, "n_heads": 2, "n_kv_heads": 1}
    params |= {"norm_eps": 1e-5, "vocab_size": 32, "rope_theta": 1e6}
    files = {
        "params.json": json.dumps(params).encode(),
        "consolidated.safetensors": safetensors.numpy.save(weights),
        "tekken.json": b'{"config": {"version": "v13"}}',
        "SYSTEM_PROMPT.txt": b"You are a tiny model.",
        "README.md": b"---\nlicense: apache-2.0\n---\n",
        "tokenizer.model.v3": b"sentencepiece" * 10,
        "consolidated.00.pth": b"\x80\x02pickle" * 10,
    }
    fake.add_repo("test/tiny-mistral", files)
    path = hub.pull("test/tiny-mistral")
    pulled = {"params.json", "consolidated.safetensors", "tekken.json", "SYSTEM_PROMPT.txt"}
    assert {p.name for p in path.iterdir()} == pulled | {"README.md"}
    (row,) = [m for m in hub.list_models() if m.name == "test/tiny-mistral"]
    assert (row.format, row.quant, row.parameters) == ("safetensors", "F16", 32 * 16 + 256 + 16)
    info = hub.model_info("test/tiny-mistral")
    assert (info["architecture"], info["tokenizer"]) == ("mistral", "BPE (tekken.json)")


def test_pull_gguf_quant_choice(fake, gguf_files, capsys):
    path = hub.resolve_model(GGUF_REPO)
    assert path.name == "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == gguf_files["tiny-Q4_K_M.gguf"]
    assert "using test/tiny-GGUF:Q4_K_M (the default Q4_K_M)" in capsys.readouterr().err
    assert hub.pull(f"{GGUF_REPO}:q8_0").name == "tiny-Q8_0.gguf"
    split = hub.pull(f"{GGUF_REPO}:F16")
    assert split.name == "tiny-F16-00001-of-00002.gguf"
    assert (split.parent / "tiny-F16-00002-of-00002.gguf").is_file()
    named = hub.pull(f"{GGUF_REPO}/stories260K.gguf")
    assert named.read_bytes() == gguf_files["stories260K.gguf"]
    with pytest.raises(UsageError) as ambiguous:
        hub.pull(f"{GGUF_REPO}:Q4_K")
    assert str(ambiguous.value) == (
        "test/tiny-GGUF:Q4_K matches 2 GGUF files; choose one of: "
        "test/tiny-GGUF:Q4_K_M, test/tiny-GGUF:Q4_K_S"
    )
    with pytest.raises(ModelNotFoundError) as missing:
        hub.pull(f"{GGUF_REPO}:Q5_K_M")
    assert str(missing.value) == (
        "test/tiny-GGUF has no GGUF file tagged Q5_K_M; choose one of: test/tiny-GGUF:F16, "
        "test/tiny-GGUF/stories260K.gguf, test/tiny-GGUF:Q4_K_M, test/tiny-GGUF:Q4_K_S, "
        "test/tiny-GGUF:Q8_0"
    )
    gets = [r.path.split("?")[0] for r in fake.served("cdn")]
    assert len(gets) == 5 and len(set(gets)) == 5  # each blob fetched exactly once


def test_pull_resumes_after_kill_9(fake, gguf_files):
    data = gguf_files["stories260K.gguf"]
    fake.throttle = 300_000
    proc = run_pull(f"{GGUF_REPO}/stories260K.gguf")
    part = wait_for_part(GGUF_REPO, 100_000, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = part.stat().st_size
    assert 0 < kept < len(data)
    assert part.read_bytes() == data[:kept]
    fake.throttle = None
    progress = Recorder()
    path = hub.pull(f"{GGUF_REPO}/stories260K.gguf", progress)
    assert path.read_bytes() == data
    assert fake.served("cdn")[-1].headers["range"] == f"bytes={kept}-"
    assert progress.started[0][0] == [hub.FileTransfer("stories260K.gguf", len(data), kept)]
    assert not part.exists()


def test_pull_resumes_after_connection_cut(fake, gguf_files):
    fake.cut_after = 200_000
    path = hub.pull(f"{GGUF_REPO}/stories260K.gguf")
    assert path.read_bytes() == gguf_files["stories260K.gguf"]
    first, second = fake.served("cdn")
    assert "range" not in first.headers
    assert second.headers["range"] == "bytes=200000-"


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_disk_full_keeps_partial_for_resume(fake, gguf_files):
    import resource

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    proc = run_pull(f"{GGUF_REPO}/stories260K.gguf", preexec_fn=small_disk)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.startswith("error: disk full while downloading stories260K.gguf: the 300.0 kB ")
    assert not (cache(GGUF_REPO) / "snapshots").exists()
    (part,) = (cache(GGUF_REPO) / "blobs").glob("*.part")
    assert part.stat().st_size == 300_000
    assert hub.pull(f"{GGUF_REPO}/stories260K.gguf").read_bytes() == gguf_files["stories260K.gguf"]
    assert fake.served("cdn")[-1].headers["range"] == "bytes=300000-"


def test_refuses_when_disk_too_small(fake, monkeypatch):
    monkeypatch.setattr(download, "_free_bytes", lambda folder: 1000)
    with pytest.raises(HubError) as refused:
        hub.pull(f"{GGUF_REPO}/stories260K.gguf")
    assert str(refused.value).startswith(
        "not enough disk space for test/tiny-GGUF/stories260K.gguf: it needs 1.2 MB more and "
    )
    assert not fake.served("cdn") and not list(cache(GGUF_REPO).rglob("*.part"))


def test_corrupt_bytes_are_never_kept(fake, gguf_files):
    data = gguf_files["tiny-Q8_0.gguf"]
    fake.blobs[sha256(data)] = data[:-1] + b"?"
    with pytest.raises(HubError, match="arrived corrupt .*hash"):
        hub.pull(f"{GGUF_REPO}:Q8_0")
    blobs = cache(GGUF_REPO) / "blobs"
    assert not [p for p in blobs.iterdir() if not p.name.endswith(".lock")]


def test_revision_and_renamed_repo(fake, st_files):
    v2 = dict(st_files, **{"config.json": b'{"model_type": "llama", "max_position_embeddings": 9}'})
    commit = fake.add_repo(ST_REPO, v2, revision="v2")
    path = hub.pull(f"{ST_REPO}@v2")
    assert path.name == commit and (path / "config.json").read_bytes() == v2["config.json"]
    assert (cache(ST_REPO) / "refs" / "v2").read_text() == commit
    assert hub.resolve_model(f"{ST_REPO}@{commit}", pull=False) == path
    fake.renamed["old/tiny-llama"] = ST_REPO
    assert (hub.pull("old/tiny-llama") / "config.json").read_bytes() == st_files["config.json"]


# ---- errors -------------------------------------------------------------------------------


def test_not_found_errors(fake):
    with pytest.raises(
        ModelNotFoundError, match=r"^no model test/nope on http://127\.0\.0\.1:\d+: check the name"
    ):
        hub.pull("test/nope")
    with pytest.raises(ModelNotFoundError, match="^test/tiny-llama has no revision 'v9'"):
        hub.pull(f"{ST_REPO}@v9")
    with pytest.raises(ModelNotFoundError, match="has no file nope.gguf; choose one of: "):
        hub.pull(f"{GGUF_REPO}/nope.gguf")


def test_server_error_and_unreachable(fake, monkeypatch):
    fake.fail["/api/models/"] = 500
    with pytest.raises(HubError, match="failed with HTTP 500: try again later; run the pull again"):
        hub.pull(ST_REPO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    with pytest.raises(HubError, match=f"^cannot reach http://127.0.0.1:{closed} .*resumes"):
        hub.pull(ST_REPO)


def test_gated_and_private_repos(fake, monkeypatch, st_files):
    fake.add_repo("test/gated", st_files, gated=True)
    fake.add_repo("test/private", st_files, private=True)
    with pytest.raises(HubError) as gated:
        hub.pull("test/gated")
    assert str(gated.value) == (
        f"test/gated is gated: accept its license at {fake.url}/test/gated, then set HF_TOKEN "
        "(or run `huggingface-cli login`)"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match="^test/gated is gated and your token has no access"):
        hub.pull("test/gated")
    with pytest.raises(ModelNotFoundError, match="a private repo needs HF_TOKEN"):
        hub.pull("test/private")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert (hub.pull("test/gated") / "config.json").is_file()
    assert (hub.pull("test/private") / "config.json").is_file()
    assert all(
        r.headers.get("authorization") == f"Bearer {TOKEN}"
        for r in fake.requests[-4:]
        if r.server == "api"
    )
    assert fake.served("cdn") and not [
        r for r in fake.requests if r.server == "cdn" and "authorization" in r.headers
    ]


def test_offline_mode_uses_the_cache_only(fake, monkeypatch):
    path = hub.pull(f"{GGUF_REPO}:Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake.requests)
    assert hub.resolve_model(f"{GGUF_REPO}:Q8_0") == path
    assert hub.pull(f"{GGUF_REPO}:Q8_0", Recorder()) == path
    with pytest.raises(ModelNotFoundError) as missing:
        hub.resolve_model(f"{GGUF_REPO}:Q4_K_S")
    assert str(missing.value) == (
        "test/tiny-GGUF:Q4_K_S is not in the cache and HF_HUB_OFFLINE=1 is set: unset it to download"
    )
    assert len(fake.requests) == before
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(
        ModelNotFoundError, match="is not downloaded: run `llmrun pull test/tiny-llama`"
    ):
        hub.resolve_model(ST_REPO, pull=False)


def test_hugging_face_cache_is_used_in_place(fake, st_files, tmp_path):
    hf_cache = tmp_path / "hf" / "hub"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        hf_hub_download(ST_REPO, name, cache_dir=hf_cache, endpoint=fake.url)
    fetched = len(fake.served("cdn"))
    path = hub.resolve_model(ST_REPO)
    assert path.is_relative_to(hf_cache) and path.parent.name == "snapshots"
    # pull fills llmrun's cache, hard-linking the weights instead of downloading them again.
    pulled = hub.pull(ST_REPO)
    assert pulled.is_relative_to(cache(ST_REPO))
    assert len(fake.served("cdn")) == fetched
    blob = (pulled / "model.safetensors").resolve()
    assert blob.stat().st_nlink == 2
    assert (pulled / "README.md").read_bytes() == st_files["README.md"]
    assert {m.source for m in hub.list_models() if m.name == ST_REPO} == {"llmrun", "huggingface"}

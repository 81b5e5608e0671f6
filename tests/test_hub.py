"""hub.py against a local fake Hub driven through the real huggingface_hub client.

Names, file choice, pull (safetensors and GGUF), resume after kill -9, a cut connection or a
full disk, errors, offline mode, the Hugging Face cache used in place, list, show and rm.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
from fakehub import TOKEN, FakeHub
from huggingface_hub import constants, hf_hub_download

from llmrun import hub
from llmrun.errors import HubError, ModelNotFoundError, UsageError
from llmrun.paths import BUNDLED_MODEL

GGUF_REPO = "test/tiny-GGUF"
ST_REPO = "test/tiny-llama"
ST_PULLED = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
PULL_SCRIPT = """
import sys
from llmrun import hub
from llmrun.errors import LlmrunError
try:
    print(hub.pull(sys.argv[1]))
except LlmrunError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


def tiny_gguf(path: Path, rows: int, name: str) -> bytes:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name(name)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.arange(rows * 32, dtype=np.float32).reshape(rows, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    return {
        "stories260K.gguf": BUNDLED_MODEL.read_bytes(),
        "tiny-Q4_K_M.gguf": tiny_gguf(d / "a.gguf", 40, "q4km"),
        "tiny-Q4_K_S.gguf": tiny_gguf(d / "b.gguf", 36, "q4ks"),
        "tiny-Q8_0.gguf": tiny_gguf(d / "c.gguf", 64, "q8"),
        "F16/tiny-F16-00001-of-00002.gguf": tiny_gguf(d / "d.gguf", 8, "f16a"),
        "F16/tiny-F16-00002-of-00002.gguf": tiny_gguf(d / "e.gguf", 8, "f16b"),
        "mmproj-tiny-f16.gguf": tiny_gguf(d / "f.gguf", 2, "mmproj"),
        "README.md": b"---\nlicense: mit\n---\n# tiny GGUFs\n",
    }


@pytest.fixture(scope="session")
def st_files() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    weights = {
        "model.embed_tokens.weight": rng.standard_normal((32, 16)).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((24, 16)).astype(np.float16),
        "model.norm.weight": np.ones(16, np.float32),
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 16,
        "max_position_embeddings": 256,
        "num_hidden_layers": 1,
        "vocab_size": 32,
    }
    vocab = {chr(97 + i): i for i in range(26)}
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": b'{"eos_token_id": 2}',
        "model.safetensors": safetensors.numpy.save(weights),
        "tokenizer.json": json.dumps(tokenizer).encode(),
        "tokenizer_config.json": json.dumps({"chat_template": template}).encode(),
        "README.md": b"---\nlicense: apache-2.0\ntags: [tiny]\n---\n# tiny\n",
        "pytorch_model.bin": b"\x80\x02pickle" * 1000,
        "flax_model.msgpack": b"flax" * 100,
        "onnx/model.onnx": b"onnx" * 100,
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }


class Recorder:
    """A Progress that remembers what it was told."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self.started: list[tuple[list[hub.FileTransfer], int]] = []
        self.last: dict[str, tuple[int, int]] = {}
        self.done: list[str] = []

    def on_notice(self, message: str) -> None:
        self.notices.append(message)

    def on_start(self, files: list[hub.FileTransfer], total_bytes: int) -> None:
        self.started.append((files, total_bytes))

    def on_progress(self, name: str, done: int, total: int) -> None:
        self.last[name] = (done, total)

    def on_file_done(self, name: str) -> None:
        self.done.append(name)


@pytest.fixture
def fake(tmp_path, monkeypatch, gguf_files, st_files):
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "llmrun"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        server.add_repo(GGUF_REPO, gguf_files)
        server.add_repo(ST_REPO, st_files)
        yield server


def cache(repo: str) -> Path:
    return Path(os.environ["LLMRUN_HOME"]) / "models" / ("models--" + repo.replace("/", "--"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_pull(name: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PULL_SCRIPT, name],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_for_part(repo: str, at_least: int, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for part in (cache(repo) / "blobs").glob("*.part"):
            if part.stat().st_size >= at_least:
                return part
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the download never started")


# ---- names and choices (no network) ------------------------------------------------------


def test_parse_name_forms():
    assert hub.parse_name("org/repo") == hub.HubName("org/repo")
    assert hub.parse_name("org/repo:q4_k_m@v2") == hub.HubName("org/repo", None, "q4_k_m", "v2")
    assert hub.parse_name("org/repo@v2:Q8_0") == hub.HubName("org/repo", None, "Q8_0", "v2")
    assert hub.parse_name("org/repo/a/b-Q4_0.gguf@refs/pr/1") == hub.HubName(
        "org/repo", "a/b-Q4_0.gguf", None, "refs/pr/1"
    )
    for bad in (
        "org/repo:",
        "org/repo@",
        "org/repo/model.bin",
        "org/repo/x.gguf:Q4_0",
        "o/r/../x.gguf",
        "o/r@../../x",
    ):
        with pytest.raises(UsageError):
            hub.parse_name(bad)


def test_local_paths_and_unknown_names(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert hub.resolve_model(str(f)) == f
    assert hub.resolve_model(str(tmp_path)) == tmp_path
    assert hub.resolve_model("stories260K") == BUNDLED_MODEL
    for missing in ("./nope", "/nope/x", "~/nope.gguf", "nope.gguf", "dir/nope.gguf", "nope"):
        with pytest.raises(ModelNotFoundError):
            hub.resolve_model(missing, pull=False)


def test_quant_labels():
    cases = {
        "Llama-3.2-1B-Instruct-Q4_K_M.gguf": "Q4_K_M",
        "qwen2.5-0.5b-instruct-q4_k_m-00001-of-00002.gguf": "Q4_K_M",
        "Q8_0/model-00001-of-00003.gguf": "Q8_0",
        "model.IQ4_XS.gguf": "IQ4_XS",
        "x-UD-Q4_K_XL.gguf": "Q4_K_XL",
        "ggml-model-f16.gguf": "F16",
        "Qwen2-7B.BF16.gguf": "BF16",
        "stories260K.gguf": None,
    }
    assert {name: hub.quant_label(name) for name in cases} == cases


def test_safetensors_choice_skips_other_formats_and_duplicates():
    files = dict.fromkeys(
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "consolidated.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "pytorch_model.bin",
            "model.pt",
            "weights.pth",
            "onnx/model.onnx",
            "flax_model.msgpack",
            "original/consolidated.00.pth",
        ],
        1,
    )
    sel = hub._select(hub.parse_name("o/r"), files)
    assert sel.format == "safetensors"
    assert sel.files == (
        "chat_template.jinja",
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )


def test_gguf_choice_rules():
    files = {"a-Q8_0.gguf": 80, "a-Q2_K.gguf": 20, "a-Q4_K_M.gguf": 40, "mmproj-a-f16.gguf": 1}
    sel = hub._select(hub.parse_name("o/r"), files)
    assert sel.files == ("a-Q4_K_M.gguf",)
    assert sel.note == "using o/r:Q4_K_M (the default Q4_K_M); others: o/r:Q2_K, o/r:Q8_0"
    del files["a-Q4_K_M.gguf"]
    sel = hub._select(hub.parse_name("o/r"), files)
    assert sel.files == ("a-Q2_K.gguf",) and "smallest" in sel.note
    only = hub._select(hub.parse_name("o/r"), {"x.gguf": 5, "README.md": 1})
    assert only.files == ("x.gguf",) and only.note is None
    assert hub._select(hub.parse_name("o/r/mmproj-a-f16.gguf"), files).files == (
        "mmproj-a-f16.gguf",
    )
    split = {"Q6_K/m-Q6_K-00002-of-00002.gguf": 9, "Q6_K/m-Q6_K-00001-of-00002.gguf": 9}
    assert hub._select(hub.parse_name("o/r:q6_k"), split).files == (
        "Q6_K/m-Q6_K-00001-of-00002.gguf",
        "Q6_K/m-Q6_K-00002-of-00002.gguf",
    )
    with pytest.raises(ModelNotFoundError, match="only 1 of the 2 parts"):
        hub._select(hub.parse_name("o/r:Q6_K"), {"m-Q6_K-00001-of-00002.gguf": 9})
    with pytest.raises(HubError, match=r"neither .* \(it has: config.json, pytorch_model.bin\)"):
        hub._select(hub.parse_name("o/r"), {"config.json": 1, "pytorch_model.bin": 2})


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
    monkeypatch.setattr(hub, "_free_bytes", lambda folder: 1000)
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


# ---- list, show, rm -----------------------------------------------------------------------


def test_list_and_show(fake, gguf_files, st_files):
    hub.pull(f"{GGUF_REPO}/stories260K.gguf")
    hub.pull(f"{GGUF_REPO}:F16")
    st_path = hub.resolve_model(ST_REPO)
    rows = {m.name: m for m in hub.list_models()}
    assert sorted(rows) == [f"{GGUF_REPO}/stories260K.gguf", f"{GGUF_REPO}:F16", ST_REPO]
    stories = rows[f"{GGUF_REPO}/stories260K.gguf"]
    reader = gguf.GGUFReader(BUNDLED_MODEL)
    assert (stories.format, stories.quant, stories.size) == (
        "gguf",
        "F32",
        len(gguf_files["stories260K.gguf"]),
    )
    assert stories.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert stories.last_used is None
    f16 = rows[f"{GGUF_REPO}:F16"]
    assert f16.parameters == 2 * 8 * 32 and f16.quant == "F16"
    st = rows[ST_REPO]
    assert st.last_used is not None and st.path == st_path and st.quant == "F16"
    assert st.size == sum(len(st_files[n]) for n in ST_PULLED)

    info = hub.model_info(f"{GGUF_REPO}/stories260K.gguf")
    assert info["architecture"] == "llama"
    assert info["context_length"] == 2048
    assert info["tokenizer"] == "SentencePiece"
    assert info["chat_template"] is None
    assert info["tensor_types"]["F32"]["parameters"] == stories.parameters
    assert info["bytes_per_weight"] == pytest.approx(4.0)
    assert info["files"] == [{"name": "stories260K.gguf", "size": stories.size}]

    info = hub.model_info(ST_REPO)
    reference = safetensors.numpy.load(st_files["model.safetensors"])
    assert info["parameters"] == sum(a.size for a in reference.values())
    assert (
        info["tensor_types"]["F16"]["tensors"] == 2 and info["tensor_types"]["F32"]["bytes"] == 64
    )
    assert (info["architecture"], info["context_length"], info["tokenizer"]) == (
        "llama",
        256,
        "BPE",
    )
    assert info["chat_template"] == json.loads(st_files["tokenizer_config.json"])["chat_template"]
    assert info["license"] == "apache-2.0"
    assert info["path"] == str(st_path)
    json.dumps(info)
    with pytest.raises(ModelNotFoundError, match="run `llmrun pull test/tiny-GGUF:Q8_0`"):
        hub.model_info(f"{GGUF_REPO}:Q8_0")


def test_rm_frees_the_bytes(fake, gguf_files):
    q4 = hub.pull(f"{GGUF_REPO}:Q4_K_M")
    q8 = hub.pull(f"{GGUF_REPO}:Q8_0")
    q8_blob = q8.resolve()
    expected = len(gguf_files["tiny-Q8_0.gguf"])
    assert hub.plan_removal(f"{GGUF_REPO}:Q8_0").freed == expected
    assert q8_blob.exists()
    assert hub.remove(f"{GGUF_REPO}:Q8_0") == expected
    assert not q8_blob.exists() and not q8.exists() and q4.is_file()
    assert [m.name for m in hub.list_models()] == [f"{GGUF_REPO}:Q4_K_M"]
    with pytest.raises(ModelNotFoundError, match=r"^test/tiny-GGUF:Q8_0 is not in the cache"):
        hub.remove(f"{GGUF_REPO}:Q8_0")
    ref_size = (cache(GGUF_REPO) / "refs" / "main").stat().st_size
    assert hub.remove(GGUF_REPO) == len(gguf_files["tiny-Q4_K_M.gguf"]) + ref_size
    assert not cache(GGUF_REPO).exists()
    assert hub.list_models() == []
    with pytest.raises(ModelNotFoundError):
        hub.remove(GGUF_REPO)


def test_rm_counts_partial_downloads_and_hard_links(fake, monkeypatch, st_files, tmp_path):
    fake.cut_after = 1000
    monkeypatch.setattr(hub, "_RETRIES", 1)
    with pytest.raises(HubError, match="network error .*resumes"):
        hub.pull(f"{GGUF_REPO}/stories260K.gguf")
    assert hub.remove(GGUF_REPO) == 1000
    hf_cache = tmp_path / "hf" / "hub"
    hf_hub_download(ST_REPO, "model.safetensors", cache_dir=hf_cache, endpoint=fake.url)
    pulled = hub.pull(ST_REPO)
    # The weights are one file linked from both caches: freed once, and only with both links.
    weights = (pulled / "model.safetensors").resolve()
    assert hub._freed([weights]) == 0
    plan = hub.plan_removal(ST_REPO)
    hf_repo = hf_cache / "models--test--tiny-llama"
    assert plan.paths == [cache(ST_REPO), hf_repo]
    ours = sum(
        p.stat().st_size for p in cache(ST_REPO).rglob("*") if p.is_file() and not p.is_symlink()
    )
    assert plan.freed == ours + (hf_repo / "refs" / "main").stat().st_size
    assert hub.remove(ST_REPO) == plan.freed
    assert not weights.exists() and not hf_repo.exists()


# ---- the command line ---------------------------------------------------------------------


def llmrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmrun", *args],
        env=dict(os.environ),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_pull_list_show_rm(fake, gguf_files, st_files):
    q8 = len(gguf_files["tiny-Q8_0.gguf"])
    st = sum(len(st_files[n]) for n in ST_PULLED)
    r = llmrun("pull", f"{GGUF_REPO}:Q8_0")
    assert (r.returncode, r.stderr) == (
        0,
        f"downloading 1 file(s), {q8 / 1000:.1f} kB\ndownloaded tiny-Q8_0.gguf\n",
    )
    assert Path(r.stdout.strip()).read_bytes() == gguf_files["tiny-Q8_0.gguf"]
    r = llmrun("pull", ST_REPO)
    assert r.returncode == 0 and r.stderr.startswith("downloading 6 file(s), ")
    r = llmrun("list")
    assert [line.split() for line in r.stdout.splitlines()] == [
        ["NAME", "FORMAT", "QUANT", "PARAMS", "SIZE", "LAST", "USED", "CACHE"],
        [f"{GGUF_REPO}:Q8_0", "gguf", "Q8_0", "2.05K", f"{q8 / 1000:.1f}", "kB", "never", "llmrun"],
        [ST_REPO, "safetensors", "F16", "912", f"{st / 1000:.1f}", "kB", "never", "llmrun"],
    ]
    rows = json.loads(llmrun("list", "--json").stdout)
    assert [(m["name"], m["size"], m["last_used"], m["source"]) for m in rows] == [
        (f"{GGUF_REPO}:Q8_0", q8, None, "llmrun"),
        (ST_REPO, st, None, "llmrun"),
    ]
    r = llmrun("show", ST_REPO)
    assert r.stdout.splitlines()[:9] == [
        f"name           {ST_REPO}",
        "format         safetensors",
        "architecture   llama",
        "parameters     912 (912)",
        "context length 256",
        "weights        F16 (2 tensors, 1.8 kB), F32 (1 tensor, 64 bytes); 2.04 bytes per weight",
        "tokenizer      BPE",
        "chat template  yes (--template prints it)",
        "license        apache-2.0",
    ]
    r = llmrun("show", "--template", ST_REPO)
    assert r.stdout == json.loads(st_files["tokenizer_config.json"])["chat_template"] + "\n"
    r = llmrun("show", "--template", f"{GGUF_REPO}:Q8_0")
    assert (r.returncode, r.stderr) == (1, f"error: {GGUF_REPO}:Q8_0 has no chat template\n")
    assert json.loads(llmrun("show", "--json", f"{GGUF_REPO}:Q8_0").stdout)["parameters"] == 64 * 32
    r = llmrun("rm", ST_REPO)
    assert (r.returncode, r.stderr) == (
        2,
        "error: rm asks before deleting: pass -y to delete without asking\n",
    )
    blobs = list((cache(ST_REPO) / "blobs").iterdir())
    r = llmrun("rm", "-y", f"{GGUF_REPO}:Q8_0", ST_REPO)
    assert r.returncode == 0
    ref = 40  # refs/main goes too, as nothing else of either repo stays
    assert r.stdout.splitlines() == [
        f"deleted {GGUF_REPO}:Q8_0: {(q8 + ref) / 1000:.1f} kB freed",
        f"deleted {ST_REPO}: {(st + ref) / 1000:.1f} kB freed",
    ]
    assert not any(b.exists() for b in blobs)
    r = llmrun("rm", "-y", ST_REPO)
    assert (r.returncode, r.stderr) == (
        1,
        f"error: {ST_REPO} is not in the cache (see `llmrun list`)\n",
    )


def test_cli_exit_codes(fake):
    r = llmrun("pull", "test/nope")
    assert r.returncode == 1 and r.stderr.startswith("error: no model test/nope on http://")
    assert llmrun("pull").returncode == 2
    r = llmrun("pull", f"{GGUF_REPO}:Q4_K")
    assert r.returncode == 2 and "choose one of" in r.stderr


def test_cli_ctrl_c_keeps_the_partial_download(fake, gguf_files):
    fake.throttle = 300_000
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmrun", "pull", f"{GGUF_REPO}/stories260K.gguf"],
        env=dict(os.environ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    part = wait_for_part(GGUF_REPO, 50_000, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    kept = part.stat().st_size
    fake.throttle = None
    r = llmrun("pull", f"{GGUF_REPO}/stories260K.gguf")
    assert r.returncode == 0
    assert "resuming with" in r.stderr
    assert fake.served("cdn")[-1].headers["range"] == f"bytes={kept}-"

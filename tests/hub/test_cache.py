"""list, show and rm over llmrun's and the Hugging Face caches."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
import safetensors.numpy
from hubkit import GGUF_REPO, ST_PULLED, ST_REPO, cache
from huggingface_hub import hf_hub_download

from llmrun import hub
from llmrun.errors import HubError, ModelNotFoundError
from llmrun.hub import cache as cache_module
from llmrun.hub import download
from llmrun.paths import BUNDLED_MODEL


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
    monkeypatch.setattr(download, "_RETRIES", 1)
    with pytest.raises(HubError, match="network error .*resumes"):
        hub.pull(f"{GGUF_REPO}/stories260K.gguf")
    assert hub.remove(GGUF_REPO) == 1000
    hf_cache = tmp_path / "hf" / "hub"
    hf_hub_download(ST_REPO, "model.safetensors", cache_dir=hf_cache, endpoint=fake.url)
    pulled = hub.pull(ST_REPO)
    # The weights are one file linked from both caches: freed once, and only with both links.
    weights = (pulled / "model.safetensors").resolve()
    assert cache_module._freed([weights]) == 0
    plan = hub.plan_removal(ST_REPO)
    hf_repo = hf_cache / "models--test--tiny-llama"
    assert plan.paths == [cache(ST_REPO), hf_repo]
    ours = sum(
        p.stat().st_size for p in cache(ST_REPO).rglob("*") if p.is_file() and not p.is_symlink()
    )
    assert plan.freed == ours + (hf_repo / "refs" / "main").stat().st_size
    assert hub.remove(ST_REPO) == plan.freed
    assert not weights.exists() and not hf_repo.exists()


def test_list_and_show_import_no_torch():
    code = (
        "import sys\nfrom llmrun import hub\nfrom llmrun.paths import BUNDLED_MODEL\n"
        "hub.list_models()\nhub.model_info(str(BUNDLED_MODEL))\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_bad_index_or_usage_file_breaks_neither_list_nor_show(fake, st_files):
    """A repo's index without a weight_map of names is an incomplete model, and a damaged
    last-used file only loses its bad entries: `list` goes on for the other models."""
    fake.add_repo(
        "test/bad-index", {**st_files, "model.safetensors.index.json": b'{"weight_map": []}'}
    )
    hub.pull("test/bad-index")
    hub.pull(f"{GGUF_REPO}:Q8_0")
    usage = cache_module._usage_file()
    usage.write_text(
        json.dumps({f"{GGUF_REPO}:Q8_0": "yesterday", "a": 1e300, "b": -1e20, "c": float("nan")})
    )
    assert [m.name for m in hub.list_models()] == [f"{GGUF_REPO}:Q8_0"]
    with pytest.raises(ModelNotFoundError):
        hub.model_info("test/bad-index")


def test_an_empty_file_of_a_repo_is_pulled(fake, st_files):
    fake.add_repo("test/empty-readme", {**st_files, "README.md": b""})
    path = hub.pull("test/empty-readme")
    assert (path / "README.md").read_bytes() == b""


def test_a_ref_that_cannot_be_written_is_one_error(fake):
    (cache(GGUF_REPO) / "refs" / "main").mkdir(parents=True)
    with pytest.raises(HubError, match="cannot write to .*refs/main"):
        hub.pull(f"{GGUF_REPO}:Q8_0")

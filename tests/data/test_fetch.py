"""fetch.py takes only the wanted regular files out of the sdist, reuses what it has,
and fails in one line."""

import importlib.util
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("fetch", Path(__file__).with_name("fetch.py"))
fetch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch)

M = fetch.MODELS
G = fetch.LLAMA_CPP + "grammars/"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(fetch, "CACHE", cache)
    monkeypatch.setattr(fetch, "DOWNLOADS", cache / "downloads")
    monkeypatch.setattr(fetch, "MANIFEST", cache / "manifest.json")
    return cache


def sdist(path: Path, members: list[tuple[str, bytes | None]]) -> Path:
    """A .tar.gz of regular files, or symlinks where the content is None."""
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize(
    "name",
    [
        "ggml-vocab-x.gguf.bin",
        ".ggml-vocab-x.gguf",
        "sub/ggml-vocab-x.gguf",
        "../ggml-vocab-x.gguf",
        "templates/../../x.jinja",
        "templates/sub/x.jinja",
        "templates/.x.jinja",
        "templates/README.md",
        "convert.py",
        "../grammars/x.gbnf",
    ],
)
def test_unwanted_names_are_left_in_the_archive(cache, name):
    assert fetch.destination(M + name) is None
    assert fetch.destination("other/" + name) is None


@pytest.mark.parametrize("name", ["sub/x.gbnf", "../x.gbnf", ".x.gbnf", "x.gbnf.txt", "README.md"])
def test_unwanted_grammar_names_are_left_in_the_archive(cache, name):
    assert fetch.destination(G + name) is None


@pytest.mark.parametrize(
    "name",
    [
        "conversion/sub/x.py",
        "conversion/../x.py",
        "conversion/.x.py",
        "conversion/README.md",
        "gguf-py/gguf/scripts/x.py",
        "gguf-py/x.py",
        "convert_lora_to_gguf.py",
    ],
)
def test_unwanted_converter_names_are_left_in_the_archive(cache, name):
    assert fetch.destination(fetch.LLAMA_CPP + name) is None


def test_extracts_the_vocab_and_template_files_only(cache, tmp_path):
    archive = sdist(
        tmp_path / "s.tar.gz",
        [
            (M + "ggml-vocab-a.gguf", b"gguf"),
            (M + "ggml-vocab-a.gguf.inp", b"inp"),
            (M + "ggml-vocab-a.gguf.out", b"out"),
            (M + "templates/Org-Model.jinja", b"{{ x }}"),
            (M + "templates/../../../escape.jinja", b"no"),
            (M + "templates/README.md", b"no"),
            (G + "json.gbnf", b"root ::= x"),
            (G + "README.md", b"no"),
            (fetch.LLAMA_CPP + "convert_hf_to_gguf.py", b"main"),
            (fetch.LLAMA_CPP + "conversion/mistral.py", b"mod"),
            (fetch.LLAMA_CPP + "gguf-py/gguf/constants.py", b"k"),
            (fetch.LLAMA_CPP + "gguf-py/gguf/scripts/gguf_dump.py", b"no"),
            ("llama_cpp_python-0.3.36/setup.py", b"no"),
        ],
    )
    files = fetch.extract(archive)
    assert files == {
        "vocab/ggml-vocab-a.gguf": 4,
        "vocab/ggml-vocab-a.gguf.inp": 3,
        "vocab/ggml-vocab-a.gguf.out": 3,
        "templates/Org-Model.jinja": 7,
        "grammars/json.gbnf": 10,
        "converter/convert_hf_to_gguf.py": 4,
        "converter/conversion/mistral.py": 3,
        "converter/gguf-py/gguf/constants.py": 1,
    }
    folders = ["converter/conversion", "converter/gguf-py", "converter/gguf-py/gguf"]
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")) == sorted(
        ["vocab", "templates", "grammars", "converter", *folders, *files]
    )
    assert (cache / "templates/Org-Model.jinja").read_bytes() == b"{{ x }}"
    assert not (tmp_path / "escape.jinja").exists()


def test_a_link_is_refused(cache, tmp_path):
    archive = sdist(
        tmp_path / "s.tar.gz",
        [(M + "templates/a.jinja", b"a"), (M + "ggml-vocab-a.gguf", None)],
    )
    with pytest.raises(fetch.FetchError, match="ggml-vocab-a.gguf is not a regular file"):
        fetch.extract(archive)
    assert not (cache / "vocab/ggml-vocab-a.gguf").exists()


def test_an_archive_without_the_files_is_refused(cache, tmp_path):
    converter = (fetch.LLAMA_CPP + "convert_hf_to_gguf.py", b"a")
    archive = sdist(
        tmp_path / "s.tar.gz", [(M + "templates/a.jinja", b"a"), (G + "a.gbnf", b"a"), converter]
    )
    with pytest.raises(fetch.FetchError, match="holds no files for vocab/"):
        fetch.extract(archive)


def test_up_to_date_returns_without_pip(cache, monkeypatch, capsys):
    files = {"vocab/ggml-vocab-a.gguf": 4, "templates/a.jinja": 4, "grammars/a.gbnf": 4}
    files["converter/convert_hf_to_gguf.py"] = 4
    for name in files:
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(b"abcd")
    manifest = {"sha256": fetch.SHA256, "files": files}
    fetch.MANIFEST.write_text(fetch.json.dumps(manifest))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was run"))
    assert fetch.main() == 0
    assert "up to date" in capsys.readouterr().err
    (cache / "vocab/ggml-vocab-a.gguf").write_bytes(b"truncated")
    assert not fetch.up_to_date()


def test_a_manifest_without_a_wanted_folder_is_out_of_date(cache):
    # One written before grammars/ was wanted: fetch again rather than skip the grammars.
    (cache / "vocab").mkdir(parents=True)
    (cache / "vocab/ggml-vocab-a.gguf").write_bytes(b"gguf")
    (cache / "templates").mkdir()
    (cache / "templates/a.jinja").write_bytes(b"a")
    files = {"vocab/ggml-vocab-a.gguf": 4, "templates/a.jinja": 1}
    fetch.MANIFEST.write_text(fetch.json.dumps({"sha256": fetch.SHA256, "files": files}))
    assert not fetch.up_to_date()


def test_pip_failure_is_one_line_and_exit_1(cache, monkeypatch, capsys):
    stderr = "Looking in indexes: x\nERROR: No matching distribution found for llama-cpp-python\n"
    monkeypatch.setattr(
        subprocess, "run", lambda command, **k: subprocess.CompletedProcess(command, 1, "", stderr)
    )
    assert fetch.main() == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == (
        f"fetch.py: error: pip download {fetch.REQUIREMENT} failed (exit 1): "
        "ERROR: No matching distribution found for llama-cpp-python"
    )

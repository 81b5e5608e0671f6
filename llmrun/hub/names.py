"""Hub model names and the files of a repo that make up one model.

    org/repo                  safetensors repo: config.json, *.safetensors, tokenizer files
                              (or Mistral's params.json, consolidated.safetensors)
    org/repo:Q4_K_M           GGUF repo: the file (all parts of a split one) with that quant tag
    org/repo/path/file.gguf   one GGUF file of a repo
    ...@revision              any of these at a branch, tag or commit

Pure functions of names and listings: no file system, no network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from llmrun.errors import HubError, ModelNotFoundError, UsageError
from llmrun.loading import mistral_native
from llmrun.loading.inspect import SPLIT_RE, quant_label, safetensors_weights
from llmrun.paths import BUNDLED_MODEL

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
        # Granite Speech's feature extractor settings and its LoRA adapter, which runs for
        # prompts with audio (llmrun.loading.granite_speech)
        "preprocessor_config.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    }
)
# Older uploads' only tokenizer (T5Tokenizer's, XLMRobertaTokenizer's), and Mistral's
# tekken.json: fetched where a repo has no tokenizer.json, as they are large and the json is
# the one read where both are.
OLDER_SENTENCEPIECE_FILES = frozenset({"spiece.model", "sentencepiece.bpe.model"})
TEKKEN_FILE = "tekken.json"
_REPO_PART_RE = re.compile(r"[A-Za-z0-9][\w.-]*")


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
    if at and not _is_revision(revision):
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


def _is_revision(revision: str) -> bool:
    """A branch, tag or commit that can name a file under refs/: parts that are names."""
    return bool(revision) and all(
        part not in ("", ".", "..") and len(part.encode()) <= 255 and part.isprintable()
        for part in revision.split("/")
    )


def local_path(spec: str) -> Path | None:
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


def gguf_groups(files: dict[str, int]) -> dict[str, list[str]]:
    """GGUF files keyed by their first part; mmproj (vision projector) files are not models."""
    groups: dict[str, list[str]] = {}
    for name in sorted(files):
        if name.lower().endswith(".gguf") and not Path(name).name.lower().startswith("mmproj"):
            groups.setdefault(first_part(name), []).append(name)
    return groups


def first_part(name: str) -> str:
    m = SPLIT_RE.search(name)
    return f"{name[: m.start()]}-00001-of-{m.group(2)}.gguf" if m else name


def gguf_parts(first: str, files: dict[str, int], repo: str) -> list[str]:
    """The parts of the GGUF whose first part is `first`: each number 1..N once."""
    parts = sorted(f for f in files if first_part(f) == first)
    m = SPLIT_RE.search(first)
    if not m:
        return parts
    count = int(m.group(2))
    numbers = sorted(int(SPLIT_RE.search(f).group(1)) for f in parts)
    if count < 1 or numbers != list(range(1, count + 1)):
        have = [n for n in numbers if 1 <= n <= count]
        raise ModelNotFoundError(
            f"{repo}: only {len(set(have))} of the {count} parts of {first} are there"
            + (f" (and {len(numbers) - len(have)} more)" if len(have) != len(numbers) else "")
        )
    return parts


def choice_names(repo: str, groups: dict[str, list[str]]) -> dict[str, str]:
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
    groups = gguf_groups(files)
    if name.file:
        if name.file not in files:
            hint = f"; choose one of: {', '.join(choice_names(name.repo, groups).values())}"
            raise ModelNotFoundError(f"{name.repo} has no file {name.file}{hint if groups else ''}")
        first = first_part(name.file)
        parts = gguf_parts(first, files, name.repo)
        return Selection("gguf", tuple(parts))
    if not groups and select_safetensors(files):
        raise ModelNotFoundError(
            f"{name} names a GGUF, and {name.repo} holds safetensors weights only: pull "
            f"{name.repo} without a file or quant tag"
        )
    if not groups:
        listing = ", ".join(sorted(files)[:10]) + (", ..." if len(files) > 10 else "")
        raise HubError(
            f"{name.repo} has neither safetensors weights with a config.json (or Mistral's "
            f"params.json) nor GGUF files "
            f"(it has: {listing or 'no files'})"
        )
    choices = choice_names(name.repo, groups)
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
    parts = gguf_parts(hits[0], files, name.repo)
    return Selection("gguf", tuple(parts), note)


def select_safetensors(files: dict[str, int]) -> Selection | None:
    """Config, weights and tokenizer files of a safetensors repo, or of a Mistral native
    one (params.json, consolidated*.safetensors, no config.json); None if it is neither."""
    top = {f for f in files if "/" not in f}
    if _native_weights(top):
        try:
            weights = mistral_native.weight_files(top, "")
        except ModelNotFoundError:
            return None  # shards missing: select names them
        return Selection("safetensors", tuple(sorted({*weights, *(top & mistral_native.SIDECARS)})))
    weights = set(safetensors_weights(top))
    if "config.json" not in top or not weights:
        return None
    sidecars = top & SAFETENSORS_SIDECARS
    if "tokenizer.json" not in top:
        sidecars |= top & (OLDER_SENTENCEPIECE_FILES | {TEKKEN_FILE})
    return Selection("safetensors", tuple(sorted(weights | sidecars)))


def _native_weights(top: set[str]) -> bool:
    """Whether a repo's top-level files are a Mistral native folder's, weights included."""
    return mistral_native.is_native(top) and any(map(mistral_native.WEIGHTS_RE.fullmatch, top))


def select(name: HubName, files: dict[str, int]) -> Selection:
    """The files of a repo listing ({path: size}) that make up the model `name` asks for."""
    if name.file or name.quant:
        return _select_gguf(name, files)
    chosen = select_safetensors(files)
    top = {f for f in files if "/" not in f}
    if chosen is None and _native_weights(top):
        mistral_native.weight_files(top, name.repo)  # refuses shards with a gap
    return chosen or _select_gguf(name, files)

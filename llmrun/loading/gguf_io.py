"""GGUF files: a validating, memory-mapped reader (gguf_config.py maps the metadata).

The gguf package's GGUFReader builds a numpy object per array element, which
takes ~10 s on a 150k-token vocabulary, so the header is parsed here with
`struct` and the package supplies the constants (value types, quant block sizes,
key names). Every length, count, size and offset read from the file is checked
against the file size before it is used, so a truncated or hostile file fails
with ModelFormatError instead of allocating or reading out of bounds. A model split
into parts by gguf-split is read whole from its first part (read_model_gguf).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
)

from llmrun import native
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.inspect import SPLIT_RE

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
NO_TOKEN_ID = 0xFFFFFFFF
# Integer tensors a model holds as they are (DeepSeek-V4's token -> experts tables, I32),
# by torch dtype name: read as plain views, never dequantized.
INTEGER_TYPES = {GGMLQuantizationType.I32: "int32"}
VOCABULARY_KEYS = (
    Keys.Tokenizer.LIST,
    Keys.Tokenizer.TOKEN_TYPE,
    Keys.Tokenizer.SCORES,
    Keys.Tokenizer.MERGES,
)

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's place in the file. `shape` is in torch order (rows first)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    part: int = 0  # the file of a split GGUF that holds it: an index into GGUFFile.buffers


@dataclass
class GGUFFile:
    """Parsed header of a GGUF file plus a copy-on-write map of its bytes (of every part,
    for a split GGUF read by read_model_gguf)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    buffer: mmap.mmap | None
    # A split GGUF's other parts (-00002-of-N.gguf on), mapped likewise.
    part_buffers: list[mmap.mmap] = field(default_factory=list)

    @property
    def buffers(self) -> list[mmap.mmap]:
        """The map of each part, first part first (tensors' `part` indexes it)."""
        return [] if self.buffer is None else [self.buffer, *self.part_buffers]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def release_vocabulary(self) -> None:
        """Drop the tokenizer's token, type, score and merge lists, once a tokenizer has
        been built from them: for a 150k-token vocabulary they are ~30 MB of Python
        objects that nothing reads again."""
        for key in VOCABULARY_KEYS:
            self.metadata.pop(key, None)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get(Keys.General.ARCHITECTURE)
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: no {Keys.General.ARCHITECTURE} in the metadata")
        return arch


@dataclass(frozen=True)
class ArchMetadata:
    """One architecture's keys in a GGUF file's metadata, named by gguf.Keys templates
    ("{arch}.attention.head_count"): how every loader reads them, and refuses, naming the
    file and the key, a file that lacks one it requires."""

    metadata: dict[str, Any]
    arch: str
    source: Path | str  # the file, named in errors

    @classmethod
    def of(cls, gg: GGUFFile, arch: str | None = None) -> ArchMetadata:
        """The keys of `arch` (the file's general.architecture by default) in `gg`."""
        return cls(gg.metadata, gg.architecture if arch is None else arch, gg.path)

    def name(self, template: str) -> str:
        """The full key of a gguf.Keys template."""
        return template.format(arch=self.arch)

    def get(self, template: str, default: Any = None) -> Any:
        """The key's value, or `default` where the file leaves it out."""
        return self.metadata.get(self.name(template), default)

    def require(self, template: str) -> Any:
        """The value of a key the architecture cannot do without (ModelFormatError where
        the file leaves it out)."""
        name = self.name(template)
        if name not in self.metadata:
            raise ModelFormatError(
                f"{self.source}: metadata {name!r} is missing ({self.arch} needs it)"
            )
        return self.metadata[name]


def layer_name(tensor: MODEL_TENSOR) -> str:
    """A per-layer tensor's GGUF name after "blk.N." ("ffn_up_exps"), from gguf's table."""
    return TENSOR_NAMES[tensor].removeprefix("blk.{bid}.")


def mapped_name(
    gguf_name: str, global_names: dict[str, str], layer_names: dict[str, str], layers: str
) -> str | None:
    """A GGUF tensor's checkpoint key: global_names' for a global tensor, else
    f"{layers}N.{layer_names[rest]}" for "blk.N.rest"; None if it has none."""
    if gguf_name in global_names:
        return global_names[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = layer_names.get(parts[2])
    return None if name is None else f"{layers}{parts[1]}.{name}"


def vocab_size(gg: GGUFFile, meta: ArchMetadata) -> int | None:
    """The vocabulary's size: {arch}.vocab_size, else the length of the tokenizer's token
    list, else the rows of the token embedding; None where the file has none of them."""
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    return (
        meta.get(Keys.LLM.VOCAB_SIZE)
        or (len(tokens) if tokens else None)
        or (embed.shape[0] if embed else None)
    )


_U64 = struct.Struct("<Q")


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFormatError(
                f"{self.path}: truncated or corrupt GGUF: {what} needs {n} bytes at offset "
                f"{self.pos}, but the file has {self.size} bytes"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold tokens that are not valid UTF-8 on their own.
            return raw.decode("utf-8", errors="surrogateescape")

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.unpack("<I", what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelFormatError(
                f"{self.path}: unknown GGUF value type {raw} in {what}"
            ) from None

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        return self.unpack(_SCALAR_FORMATS[vtype], what)

    def array(self, what: str) -> list[Any]:
        elem_type = self.value_type(what)
        count = self.unpack("<Q", what)
        min_size = (
            8
            if elem_type == GGUFValueType.STRING
            else 4
            if elem_type == GGUFValueType.ARRAY
            else struct.calcsize(_SCALAR_FORMATS[elem_type])
        )
        self.need(count * min_size, f"{what} ({count} elements)")
        if elem_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[elem_type]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        if elem_type == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.value(elem_type, what) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row, as `string` reads each: decoded at once where every one
        is UTF-8 without a NUL (so in every vocabulary llama.cpp tests with), else, or where
        one runs past the end (to say where), one by one."""
        start = self.pos
        try:
            found = self._utf8_strings(count)
        except (struct.error, OverflowError):  # a length that points past the end
            found = None
        if found is not None:
            return found
        self.pos = start
        return self._strings_one_by_one(count, what)

    def _utf8_strings(self, count: int) -> list[str] | None:
        """The strings, found by a loop that only adds lengths and decoded as one text that
        NULs separate (less work than a slice and a decode each): a NUL ends any UTF-8
        character, so the text decodes only where each string does on its own, and it splits
        into `count` strings only where none holds a NUL. None where not."""
        if count == 0:
            return []
        buf, begin = self.buf, self.pos
        found_starts = _string_starts(buf, self.size, begin, count)
        if found_starts is None:
            return None
        at, pos = found_starts
        data = np.frombuffer(buf, dtype=np.uint8, count=pos - begin, offset=begin).copy()
        at -= begin  # each string's first byte in `data`
        keep = np.ones(len(data), dtype=bool)
        for k in range(2, 9):  # drop each string's 8-byte length but its last byte,
            keep[at - k] = False
        data[at[1:] - 1] = 0  # which becomes the NUL before the string (none before the first)
        keep[at[0] - 1] = False
        try:
            text = data[keep].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return None
        found = text.split("\x00")
        if len(found) != count:
            return None
        self.pos = pos
        return found

    def _strings_one_by_one(self, count: int, what: str) -> list[str]:
        """The strings, each length checked before it is used; one that is not UTF-8 keeps
        its bytes as surrogate escapes."""
        buf, size, pos = self.buf, self.size, self.pos
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, what)
            raw = buf[pos : pos + n]
            pos += n
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(raw.decode("utf-8", errors="surrogateescape"))
        self.pos = pos
        return out


def _string_starts(buf: Any, size: int, pos: int, count: int) -> tuple[np.ndarray, int] | None:
    """Where each of `count` GGUF strings from `pos` begins (after its u64 length), and the
    position after the last; None where a length runs past the end. By the tokenizer's C
    library where it is built (this loop in Python took ~0.1 s of each 150k-entry array)."""
    lib = native.tokenize_library()
    if lib is not None:
        starts = np.empty(count, dtype=np.int64)
        whole = np.frombuffer(buf, dtype=np.uint8, count=size)
        end = lib.llmrun_gguf_strings(whole.ctypes.data, size, pos, count, starts.ctypes.data)
        return None if end < 0 else (starts, end)
    length = _U64.unpack_from
    starts_list = [0] * count
    for i in range(count):
        (n,) = length(buf, pos)
        pos += 8
        starts_list[i] = pos
        pos += n
    return (np.array(starts_list, dtype=np.int64), pos) if pos <= size else None


def read_gguf(path: str | Path, *, with_tensors: bool = True) -> GGUFFile:
    """Parse and validate a GGUF file's header; map its bytes when `with_tensors`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ModelFormatError(f"{path}: the file is empty, not a GGUF")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelFormatError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read: {e.strerror or e}") from None

    cur = _Cursor(buf, size, path)
    cur.need(4, "the magic number")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFormatError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur.pos = 4
    version = cur.unpack("<I", "the version")
    if version not in (2, 3):
        if version & 0xFFFF == 0:
            raise UnsupportedError(f"{path}: big-endian GGUF files are not supported")
        raise UnsupportedError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    tensor_count = cur.unpack("<Q", "the tensor count")
    kv_count = cur.unpack("<Q", "the metadata count")
    # Each metadata entry takes at least 12 bytes and each tensor info at least 28.
    cur.need(
        kv_count * 12 + tensor_count * 28, f"{kv_count} metadata entries and {tensor_count} tensors"
    )

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string("a metadata key")
        vtype = cur.value_type(f"metadata {key!r}")
        if key in metadata:
            raise ModelFormatError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")

    infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cur.string("a tensor name")
        n_dims = cur.unpack("<I", f"tensor {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise ModelFormatError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        ne = [cur.unpack("<Q", f"tensor {name!r}") for _ in range(n_dims)]
        raw_type = cur.unpack("<I", f"tensor {name!r}")
        offset = cur.unpack("<Q", f"tensor {name!r}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise UnsupportedError(
                f"{path}: tensor {name!r} has unknown GGML type {raw_type}"
            ) from None
        infos.append((name, ggml_type, tuple(ne), offset, 0))

    alignment = metadata.get(Keys.General.ALIGNMENT, DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFormatError(f"{path}: bad {Keys.General.ALIGNMENT} {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ggml_type, ne, offset, _ in infos:
        if name in tensors:
            raise ModelFormatError(f"{path}: tensor {name!r} appears twice")
        nbytes = _tensor_nbytes(path, name, ggml_type, ne)
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise ModelFormatError(
                f"{path}: truncated or corrupt GGUF: tensor {name!r} ({nbytes} bytes at offset "
                f"{start}) lies past the end of the file ({size} bytes)"
            )
        # GGML lists the fastest-varying dimension first; torch lists it last.
        tensors[name] = GGUFTensorInfo(name, ggml_type, tuple(reversed(ne)), start, nbytes)

    if not with_tensors:
        buf.close()
        return GGUFFile(path, version, metadata, tensors, None)
    return GGUFFile(path, version, metadata, tensors, buf)


def read_model_gguf(path: str | Path) -> GGUFFile:
    """A model's GGUF: one file, or one split by gguf-split into NAME-0000i-of-0000N.gguf,
    given its first part. Split, the first part holds the metadata and every part some
    tensors; they are read as llama.cpp reads them (llama-model-loader.cpp): each part's
    split.no must be its place, no tensor may be in two parts, and the parts must hold
    the first part's split.tensors.count tensors in all."""
    first = read_gguf(path)
    count = first.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT, 0)
    if not isinstance(count, int) or count <= 1:
        return first
    suffix = f"-00001-of-{count:05d}.gguf"
    number = first.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)
    if number != 0:
        first_name = (
            SPLIT_RE.sub(suffix, first.path.name)
            if SPLIT_RE.search(first.path.name)
            else f"...{suffix}"
        )
        raise ModelFormatError(
            f"{first.path}: not the first part of a GGUF split into {count} "
            f"({Keys.Split.LLM_KV_SPLIT_NO} is {number!r}); give the first part, {first_name}"
        )
    if not first.path.name.endswith(suffix):
        raise ModelFormatError(
            f"{first.path}: the first part of a GGUF split into {count}, but not named "
            f"...{suffix}, the name its other parts are found by"
        )
    prefix = first.path.name[: -len(suffix)]
    tensors = dict(first.tensors)
    for index in range(1, count):
        part_path = first.path.with_name(f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf")
        if not part_path.is_file():
            raise ModelFormatError(
                f"{first.path}: part {part_path.name} of this split GGUF is missing"
            )
        part = read_gguf(part_path)
        if part.metadata.get(Keys.Split.LLM_KV_SPLIT_NO) != index:
            raise ModelFormatError(
                f"{part_path}: its {Keys.Split.LLM_KV_SPLIT_NO} is "
                f"{part.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)!r}, not {index}: it is not "
                f"part {index + 1} of {first.path.name}"
            )
        for name, info in part.tensors.items():
            if name in tensors:
                raise ModelFormatError(f"{part_path}: tensor {name!r} is in an earlier part too")
            tensors[name] = replace(info, part=index)
        first.part_buffers.append(part.buffer)
    expected = first.metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if expected != len(tensors):
        raise ModelFormatError(
            f"{first.path}: {Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT} is {expected!r}, but its "
            f"{count} parts hold {len(tensors)} tensors"
        )
    first.tensors = tensors
    return first


def _tensor_nbytes(
    path: Path, name: str, ggml_type: GGMLQuantizationType, ne: tuple[int, ...]
) -> int:
    if ggml_type not in GGML_QUANT_SIZES:
        raise UnsupportedError(
            f"{path}: tensor {name!r} has GGML type {ggml_type.name}, which has no known size"
        )
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if any(n == 0 for n in ne) or ne[0] % block_size:
        raise ModelFormatError(
            f"{path}: tensor {name!r} of type {ggml_type.name} has shape {list(ne)}, "
            f"whose first dimension is not a positive multiple of the block size {block_size}"
        )
    count = 1
    for n in ne:
        count *= n
        if count > 1 << 48:
            raise ModelFormatError(f"{path}: tensor {name!r} has an absurd shape {list(ne)}")
    return count // block_size * type_size


# The most a small F32 tensor read into a list (RoPE factors) may hold.
FLOAT_LIST_MAX_BYTES = 1 << 20


def read_float_list(gg: GGUFFile, name: str) -> list[float]:
    """A small F32 tensor's values (RoPE factors), also from a header read without its
    tensors' bytes (`llmrun show`): then from the file itself."""
    info = gg.tensors.get(name)
    if info is None or (gg.buffer is None and info.part != 0):
        raise ModelFormatError(f"{gg.path}: tensor {name!r} is missing")
    if info.ggml_type != GGMLQuantizationType.F32 or info.nbytes > FLOAT_LIST_MAX_BYTES:
        raise UnsupportedError(
            f"{gg.path}: tensor {name!r} is {info.ggml_type.name} of {info.nbytes} bytes; "
            f"F32 of at most {FLOAT_LIST_MAX_BYTES} expected"
        )
    n = info.nbytes // 4
    if gg.buffer is not None:
        return list(struct.unpack_from(f"<{n}f", gg.buffers[info.part], info.offset))
    with open(gg.path, "rb") as f:
        f.seek(info.offset)
        data = f.read(4 * n)
    if len(data) != 4 * n:
        raise ModelFormatError(f"{gg.path}: tensor {name!r} runs past the end of the file")
    return list(struct.unpack(f"<{n}f", data))


def generation_defaults(gg: GGUFFile) -> dict[str, Any]:
    """Sampler defaults the file carries (general.sampling.*), in llmrun option names."""
    names = {
        Keys.General.SAMPLING_TEMP: "temperature",
        Keys.General.SAMPLING_TOP_K: "top_k",
        Keys.General.SAMPLING_TOP_P: "top_p",
        Keys.General.SAMPLING_MIN_P: "min_p",
        Keys.General.SAMPLING_PENALTY_REPEAT: "repeat_penalty",
        Keys.General.SAMPLING_PENALTY_LAST_N: "repeat_last_n",
    }
    # Stored as float32: 0.3 reads back as 0.30000001192..., so keep 7 significant digits.
    return {
        ours: float(f"{value:.7g}") if isinstance(value, float) else value
        for key, ours in names.items()
        if (value := gg.metadata.get(key)) is not None
    }


def token_id(gg: GGUFFile, key: str) -> int | None:
    """A tokenizer.ggml.*_token_id value, with out-of-range ids (0xFFFFFFFF) as None."""
    value = gg.metadata.get(key)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST) or ()
    if not isinstance(value, int) or value == NO_TOKEN_ID or not 0 <= value < max(len(tokens), 1):
        return None
    return value


def load_tensor(gg: GGUFFile, info: GGUFTensorInfo):
    """A zero-copy torch view of a tensor: float types in their dtype and shape;
    block-quantized types as uint8 [rows, bytes per row]."""
    import torch

    if gg.buffer is None:
        raise ValueError("GGUF was read without tensors")
    buffer = gg.buffers[info.part]
    float_types = {
        GGMLQuantizationType.F32: torch.float32,
        GGMLQuantizationType.F16: torch.float16,
        GGMLQuantizationType.BF16: torch.bfloat16,
        **{t: getattr(torch, name) for t, name in INTEGER_TYPES.items()},
    }
    if info.ggml_type in float_types:
        dtype = float_types[info.ggml_type]
        flat = torch.frombuffer(
            buffer, dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.offset
        )
        return flat.view(info.shape)
    rows = info.nbytes // (
        info.shape[-1] // GGML_QUANT_SIZES[info.ggml_type][0] * GGML_QUANT_SIZES[info.ggml_type][1]
    )
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
    return flat.view(rows, info.nbytes // rows)


def unpermute_rows(rows, n_heads: int):
    """Undo llama.cpp's q/k row permutation for arch `llama` (it interleaves the two
    RoPE halves of each head; HF keeps them split). Works on float weights and on
    quantized byte rows alike, since it only reorders rows."""
    shape = rows.shape
    if shape[0] % (2 * n_heads):
        raise ModelFormatError(
            f"{shape[0]} query or key rows do not split into {n_heads} heads of two halves: "
            "the file's head counts do not fit its tensors"
        )
    return (
        rows.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:])
        .transpose(1, 2)
        .reshape(shape)
    )


def stored_metadata(gg: GGUFFile) -> list[tuple[str, GGUFValueType, bytes]]:
    """Each metadata entry of `gg` (its first part, mapped) as (key, value type, the value's
    bytes as the file stores them), in file order: to copy them unchanged into another
    GGUF, typed arrays, empty arrays and strings that are not UTF-8 included."""
    if gg.buffer is None:
        raise ValueError("stored_metadata needs a GGUF read with its tensors mapped")
    cur = _Cursor(gg.buffer, len(gg.buffer), gg.path)
    cur.pos = 16  # magic, version and tensor count: read_gguf checked them
    entries = []
    for _ in range(cur.unpack("<Q", "the metadata count")):
        key = cur.string("a metadata key")
        vtype = cur.value_type(f"metadata {key!r}")
        start = cur.pos
        cur.value(vtype, f"metadata {key!r}")
        entries.append((key, vtype, bytes(gg.buffer[start : cur.pos])))
    return entries

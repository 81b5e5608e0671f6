"""Hugging Face model directories: config.json, generation_config.json, safetensors.

safetensors files are read here directly (an 8-byte header length, a JSON
header, raw little-endian tensor bytes) and memory-mapped, so loading copies
nothing and never unpickles anything. Header offsets are checked against the
file size before use. Sharded checkpoints follow model.safetensors.index.json.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError
from llmrun.loading.inspect import index_shards, safetensors_weights

DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# FP8 values, which are weights only with their block scales: read for a family whose
# loader dequantizes them (Inkling 2's MXFP8, llmrun.loading.inkling2), else refused.
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        if ggufs:
            raise ModelNotFoundError(
                f"{model_dir}: a folder of GGUF files, not a Hugging Face model folder (no "
                f"config.json); give one of its files: {', '.join(ggufs[:5])}"
                f"{' ...' if len(ggufs) > 5 else ''}"
            )
        raise ModelNotFoundError(
            f"{model_dir}: no config.json; a model directory needs config.json and *.safetensors"
        )
    return read_json(path)


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = index_shards(read_json(index))
        if shards is None:
            raise ModelFormatError(f"{index}: no weight_map of file names")
        for name in sorted(shards):
            if Path(name).name != name:
                raise ModelFormatError(f"{index}: lists {name}, which is not a file of {model_dir}")
            if not (model_dir / name).is_file():
                raise ModelFormatError(f"{index}: lists {name}, which is missing")
        return [model_dir / name for name in sorted(shards)]
    # The Hub's rule (inspect.safetensors_weights): folders often hold the weights twice,
    # as shards or model.safetensors and again as Mistral's consolidated.safetensors.
    files = [model_dir / name for name in safetensors_weights(p.name for p in model_dir.iterdir())]
    if not files:
        found = sorted(p.name for p in model_dir.iterdir())
        raise ModelNotFoundError(
            f"{model_dir}: no *.safetensors weights (found: {', '.join(found) or 'nothing'})"
        )
    return files


def read_header(path: Path, fp8: bool = False) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where data starts (FP8
    tensors refused unless `fp8`)."""
    header, _, data_start = read_header_metadata(path, fp8)
    return header, data_start


def read_header_metadata(
    path: Path, fp8: bool = False
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """read_header's header and offset, with the header's `__metadata__` as written (the
    format says strings to strings; unchecked here) or {} where it has none."""
    dtypes = {**DTYPES, **FP8_DTYPES} if fp8 else DTYPES
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ModelFormatError(
                f"{path}: corrupt safetensors header length {n} (file has {size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: corrupt safetensors header")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict):
        metadata = {}
    data_start = 8 + n
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype = info["dtype"]
            shape = info["shape"]
            if not (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(type(x) is int for x in (begin, end, *shape))
                and min(shape, default=0) >= 0
            ):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(
                f"{path}: tensor {name!r} has a malformed header entry"
            ) from None
        if dtype not in dtypes:
            raise UnsupportedError(
                f"{path}: tensor {name!r} has dtype {dtype}, which is not supported"
            )
        count = 1
        for dim in shape:
            count *= dim
        expected = count * dtypes[dtype].itemsize
        if not 0 <= begin <= end or end - begin != expected or data_start + end > size:
            raise ModelFormatError(
                f"{path}: tensor {name!r} ({dtype} {shape}) has offsets {begin}..{end}, "
                f"which do not fit its size or the file ({size} bytes); the file may be truncated"
            )
    return header, metadata, data_start


def load_tensors(path: Path, fp8: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as zero-copy views of a private map (FP8 ones
    refused unless `fp8`)."""
    header, data_start = read_header(path, fp8)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = {**DTYPES, **FP8_DTYPES}[info["dtype"]]
        if end == begin:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(
            buf, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin
        )
        tensors[name] = flat.view(info["shape"])
    return tensors

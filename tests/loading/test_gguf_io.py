"""The GGUF reader refuses malformed files with one clear error, before allocating."""

import struct

import pytest
from gguf import GGMLQuantizationType, GGUFValueType, Keys
from helpers import STORIES_GGUF, VOCAB_DIR, tiny_hf_model, write_gguf

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import gguf_io
from llmrun.loading.gguf_io import ArchMetadata, read_gguf
from llmrun.loading.loader import open_checkpoint


def string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(
    kvs=(("general.architecture", GGUFValueType.STRING, "llama"),),
    tensors=(("t.weight", 2, (32, 2), 0, 0),),
    version=3,
    kv_count=None,
    tensor_count=None,
    data=b"\0" * 256,
) -> bytes:
    """A GGUF file byte by byte; tensors are (name, n_dims, ne, type, offset)."""
    out = b"GGUF" + struct.pack("<I", version)
    out += struct.pack(
        "<QQ",
        len(tensors) if tensor_count is None else tensor_count,
        len(kvs) if kv_count is None else kv_count,
    )
    for key, vtype, value in kvs:
        out += string(key) + struct.pack("<I", vtype)
        if vtype == GGUFValueType.STRING:
            out += string(value)
        elif vtype == GGUFValueType.UINT32:
            out += struct.pack("<I", value)
        elif vtype == GGUFValueType.ARRAY:
            elem_type, count, payload = value
            out += struct.pack("<IQ", elem_type, count) + payload
    for name, n_dims, ne, ggml_type, offset in tensors:
        out += string(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", n) for n in ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % 32)
    return out + data


@pytest.fixture(params=["C", "Python"])
def string_scanner(request, monkeypatch) -> str:
    """Each way the reader finds the strings of a string array: the tokenizer's C library,
    and the loop in Python where that cannot be built."""
    if request.param == "Python":
        monkeypatch.setattr(gguf_io.native, "tokenize_library", lambda: None)
    elif gguf_io.native.tokenize_library() is None:
        pytest.skip("no C compiler here to build the tokenizer's library")
    return request.param


def write(tmp_path, data: bytes):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    return path


def test_a_valid_handmade_file_reads(tmp_path):
    gg = read_gguf(write(tmp_path, gguf_bytes()))
    assert gg.architecture == "llama"
    assert gg.tensors["t.weight"].shape == (2, 32)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"GGML" + b"\0" * 64, "bad magic"),
        (gguf_bytes(version=1), "version 1"),
        (gguf_bytes(kv_count=1 << 60), "metadata entries"),
        (gguf_bytes(tensor_count=1 << 40), "tensors"),
        (gguf_bytes()[:40], "truncated"),
        (
            gguf_bytes(
                kvs=(
                    (
                        "tokenizer.ggml.tokens",
                        GGUFValueType.ARRAY,
                        (GGUFValueType.STRING, 1 << 50, b""),
                    ),
                )
            ),
            "elements",
        ),
        (  # a string array whose second string runs past the end of the file
            gguf_bytes(
                kvs=(
                    (
                        "tokenizer.ggml.tokens",
                        GGUFValueType.ARRAY,
                        (GGUFValueType.STRING, 2, string("a") + struct.pack("<Q", 1 << 40)),
                    ),
                ),
                tensors=(),
                data=b"",
            ),
            "truncated",
        ),
        (
            gguf_bytes(
                kvs=(
                    ("general.name", GGUFValueType.STRING, "x"),
                    ("general.name", GGUFValueType.STRING, "y"),
                )
            ),
            "appears twice",
        ),
        (gguf_bytes(tensors=(("t.weight", 2, (32, 2), 0, 1 << 40),)), "past the end"),
        (gguf_bytes(tensors=(("t.weight", 2, (32, 2), 0, 0),), data=b"\0" * 100), "past the end"),
        (gguf_bytes(tensors=(("t.weight", 9, (1,) * 9, 0, 0),)), "dimensions"),
        (gguf_bytes(tensors=(("t.weight", 2, (1 << 40, 1 << 30), 0, 0),)), "absurd"),
        (gguf_bytes(tensors=(("t.weight", 2, (33, 2), 8, 0),)), "block size"),
        (
            gguf_bytes(tensors=(("t.weight", 1, (32,), 0, 0), ("t.weight", 1, (32,), 0, 128))),
            "appears twice",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_files_fail_clearly(tmp_path, data, message, string_scanner):
    with pytest.raises((ModelFormatError, UnsupportedError), match=message):
        read_gguf(write(tmp_path, data))


def test_string_arrays_read_every_token_and_keep_bytes_that_are_not_utf8(tmp_path, string_scanner):
    tokens = [b"<s>", b"\xe2\x96\x81the", b"", b"\xff\xfe", "日本".encode()]
    payload = b"".join(struct.pack("<Q", len(t)) + t for t in tokens)
    kvs = (
        ("general.architecture", GGUFValueType.STRING, "llama"),
        ("tokenizer.ggml.tokens", GGUFValueType.ARRAY, (GGUFValueType.STRING, 5, payload)),
    )
    got = read_gguf(write(tmp_path, gguf_bytes(kvs=kvs))).metadata["tokenizer.ggml.tokens"]
    assert [t.encode("utf-8", errors="surrogateescape") for t in got] == tokens


@pytest.mark.parametrize(
    ("strings", "at_once"),
    [
        # UTF-8 without a NUL, decoded at once: empty strings, 2- to 4-byte characters, and
        # 128- and 300-byte strings, whose lengths hold bytes that are not ASCII.
        (["", "a", "\u2581the", "日本", "\U0001f600", "é" * 64, "x" * 300, ""], True),
        (["a\x00b", "c", "\x00"], False),  # NULs
        ([b"\xe2\x96", b"\x81x", b"\xff", "ok"], False),  # halves of a character, a stray byte
    ],
    ids=["utf8", "nul", "not-utf8"],
)
def test_string_arrays_read_as_the_gguf_package_reads_them(
    tmp_path, monkeypatch, strings, at_once, string_scanner
):
    import gguf

    if at_once:
        monkeypatch.setattr(gguf_io._Cursor, "_strings_one_by_one", None)
    path = tmp_path / "strings.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", strings)
    writer.add_array("general.tags", ["read", "after", "them"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    expected = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
    assert len(expected) == len(strings)
    metadata = read_gguf(path, with_tensors=False).metadata
    assert metadata["tokenizer.ggml.tokens"] == expected
    assert metadata["general.tags"] == ["read", "after", "them"]


def test_a_real_vocabulary_reads_as_the_gguf_package_reads_it(string_scanner):
    import gguf

    path = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in {VOCAB_DIR}: run python tests/data/fetch.py")
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    expected = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
    assert len(expected) == 32000
    assert read_gguf(path, with_tensors=False).metadata["tokenizer.ggml.tokens"] == expected


def test_unknown_ggml_type_names_the_tensor(tmp_path):
    with pytest.raises(UnsupportedError, match="'t.weight' has unknown GGML type 99"):
        read_gguf(write(tmp_path, gguf_bytes(tensors=(("t.weight", 2, (32, 2), 99, 0),))))


def test_truncated_real_model(tmp_path):
    data = STORIES_GGUF.read_bytes()
    with pytest.raises(ModelFormatError, match="past the end of the file"):
        read_gguf(write(tmp_path, data[: len(data) // 2]))
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf(write(tmp_path, data[:5000]))


def test_unsupported_weight_type_names_tensor_and_type(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(
        "token_embd.weight",
        np.zeros((2, 292), dtype=np.uint8),
        raw_dtype=GGMLQuantizationType.Q8_K,  # llama.cpp's activations' type, never a weight's
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedError, match="'token_embd.weight' has weight type Q8_K"):
        open_checkpoint(path)


def test_unknown_architecture_lists_supported(tmp_path):
    path = write(
        tmp_path, gguf_bytes(kvs=(("general.architecture", GGUFValueType.STRING, "rwkv6qwen2"),))
    )
    with pytest.raises(
        UnsupportedError,
        match="'rwkv6qwen2' is not supported.*llama, .*mistral3, .*phi3, .*qwen2, qwen2moe, .*qwen3, .*qwen3moe",
    ):
        open_checkpoint(path)


def test_missing_tensor_is_named(tmp_path):
    hf, config = tiny_hf_model("llama")
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    path = write_gguf(tmp_path / "m.gguf", config, state)
    import torch

    from llmrun.loading.loader import build_model

    with pytest.raises(
        ModelFormatError, match="missing tensors: model.layers.1.mlp.up_proj.weight"
    ):
        build_model(open_checkpoint(path), torch.device("cpu"), torch.float32)


def test_none_token_ids_are_absent():
    from llmrun.loading.gguf_io import token_id

    gg = read_gguf(STORIES_GGUF, with_tensors=False)
    assert token_id(gg, "tokenizer.ggml.seperator_token_id") is None
    assert token_id(gg, "tokenizer.ggml.bos_token_id") == 1


def test_arch_metadata_reads_keys_by_template_and_names_a_missing_one(tmp_path):
    kvs = (
        ("general.architecture", GGUFValueType.STRING, "llama"),
        ("llama.block_count", GGUFValueType.UINT32, 2),
    )
    path = write(tmp_path, gguf_bytes(kvs=kvs))
    meta = ArchMetadata.of(read_gguf(path))
    assert meta.name(Keys.LLM.BLOCK_COUNT) == "llama.block_count"
    assert meta.require(Keys.LLM.BLOCK_COUNT) == meta.get(Keys.LLM.BLOCK_COUNT) == 2
    assert meta.get(Keys.LLM.CONTEXT_LENGTH) is None
    assert meta.get(Keys.LLM.CONTEXT_LENGTH, 4096) == 4096
    with pytest.raises(
        ModelFormatError, match=r"bad\.gguf: metadata 'llama\.context_length' is missing \(llama"
    ):
        meta.require(Keys.LLM.CONTEXT_LENGTH)

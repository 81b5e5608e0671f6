"""Fixtures of the hub tests: tiny GGUF and safetensors repos on a fake Hub (fakehub.py),
with llmrun's and the Hugging Face caches in a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
from fakehub import FakeHub
from hubkit import GGUF_REPO, ST_REPO
from huggingface_hub import constants

from llmrun.paths import BUNDLED_MODEL


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

"""CodeGen (Salesforce/codegen-*: llmrun's GPT-J model, llmrun/loading/codegen.py splitting
its fused qkv_proj) against transformers' CodeGenForCausalLM, from the folder
save_pretrained writes (the Hub's transformer.* names). llama.cpp has no converter for
CodeGen: folders only.

The tiny model: test_gptj.py's (2 layers, hidden 64, 4 heads of 16 with 8 features
rotated, a feed-forward of 256) as a CodeGen, over stories260K's 512-token vocabulary for
`llmrun run`. What is CodeGen's own each moves the logits by far more than the tolerance
(test_the_fused_projections_order_is_followed): qkv_proj's rows in 4 shards, each of
queries, values, then keys.

Tolerances: f32 logits 1e-4 max abs against transformers, whole, through the KV cache
(prefills in chunks, then one token at a time) and the paged cache; the static decode
step 1e-5 against the ordinary forward. `llmrun run` picks transformers' 8 greedy token
ids from the folder.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_static_decode,
    check_whole_and_cached,
    max_diff,
)
from helpers import cached_logits, save_hf_dir
from in_process import llmrun
from safetensors import safe_open
from test_gptj import IDS, hf_model

from llmrun.loading import codegen
from llmrun.loading.loader import load_model

pytest.importorskip("transformers.models.codegen")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf():
    return hf_model(model_type="codegen")


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("codegen") / "codegen-tiny", tokenizer=True)


def test_the_folder_matches_transformers_whole_cached_paged_and_static(
    folder, expected, monkeypatch
):
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert "transformer.h.0.attn.qkv_proj.weight" in f.keys()
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "codegen"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_static_decode(loaded.model, monkeypatch)


def test_the_folder_runs_and_shows(hf, folder):
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 2 layers' keys and values of 4 heads of 16, f32, 8192 positions.
    check_show(folder, "codegen", 2 * 2 * 64 * 4 * 8192)


@pytest.mark.parametrize(
    "planted", [dict(MP_NUM=1), dict(_ORDER=("q_proj", "k_proj", "v_proj"))], ids=str
)
def test_the_fused_projections_order_is_followed(folder, expected, planted, monkeypatch):
    """One shard instead of 4, or queries-keys-values instead of queries-values-keys,
    leaves transformers' logits."""
    for name, value in planted.items():
        monkeypatch.setattr(codegen, name, value)
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) > 0.1


def test_codegen2s_remote_code_is_refused(folder, tmp_path):
    """CodeGen2's folders carry auto_map: their remote code splits qkv_proj its own way
    (over 8 shards, as reported), which transformers' CodeGen (4) does not follow."""
    remote = tmp_path / "codegen2"
    remote.mkdir()
    for file in folder.iterdir():
        (remote / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_codegen.CodeGenForCausalLM"}
    (remote / "config.json").write_text(json.dumps(config))
    result = llmrun("run", str(remote), "def", "-n", "2")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "remote code" in result.stderr

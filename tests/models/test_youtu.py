"""Youtu-LLM (llmrun/models/youtu.py) against transformers' YoutuForCausalLM: its Hub
folder (config.json in the Hub's older style, rope_theta at the top; safetensors under
the Hub's keys, no lm_head: tied embeddings) and llama.cpp's converter's "deepseek2"
GGUFs of it (conversion/deepseek.py: every block a leading dense one, MLA as MQA with
kv_b_proj split into attn_k_b and attn_v_b, no output.weight), F32 and Q8_0, on one
tiny random model (2 layers, hidden 64) whose RoPE base (50000) is not the default.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache
(the static decode step: 1e-5 against the ordinary forward); the F32 GGUF 1e-4 too (its latent norms take rms_norm_eps,
as llama.cpp's do, where transformers' take 1e-6: ~4e-5 here); the Q8_0 GGUF 1e-4
against transformers running the weights the file's blocks hold (gguf-py's
dequantize). `llmrun run` picks transformers' 8 greedy token ids from each file.
"""

import copy
import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_static_decode,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, needs_converter, our_model, save_hf_dir
from in_process import llmrun
from llama_converter import run_converter
from test_deepseek import round_as_q8_0_gguf

from llmrun.loading.loader import load_model

pytest.importorskip("transformers.models.youtu")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="youtu",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


def save_hub_folder(hf, path):
    """The model's Hub folder (stories260K's tokenizer), its config.json in the Hub's
    style: rope_theta at the top, rope_scaling null; returns `path`."""
    save_hf_dir(hf, path, tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hub_folder(hf, tmp_path_factory.mktemp("youtu") / "Youtu-LLM")


@pytest.fixture(scope="module")
def converted(folder):
    """llama.cpp's converter's F32 and Q8_0 GGUFs of the folder, from one process."""
    files = {t: folder.parent / f"youtu-{t}.gguf" for t in ("f32", "q8_0")}
    run_converter(folder, {path: f"--outtype {t}" for t, path in files.items()})
    return files


def test_matches_transformers_whole_cached_paged_and_static(hf, expected, monkeypatch):
    ours = our_model(hf.config.to_dict(), hf.state_dict())
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)
    check_static_decode(ours, monkeypatch)


def test_the_hub_folder_runs_and_shows(hf, expected, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "youtu"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8)
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    assert "youtu" in shown.stdout


@needs_converter
@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_the_converters_gguf_matches_transformers(hf, expected, converted, qtype):
    path = converted[qtype]
    reference = hf
    if qtype == "q8_0":
        reference = copy.deepcopy(hf)
        round_as_q8_0_gguf(reference)
        with torch.no_grad():
            expected = reference(IDS).logits
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "youtu"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(reference, path, tokens=8)
    # Each layer's one latent head of 32 + 32, key and value alike, f32, 8192 positions.
    check_show(path, "deepseek2", 2 * 64 * 4 * 8192)


def test_youtu_llm_2b_caches_its_latent():
    """Youtu-LLM-2B's shape (YoutuConfig's defaults): per token and layer one latent head
    of kv_lora_rank 512 + qk_rope_head_dim 64, key and value alike, in bf16 36,864 bytes
    a token over 32 layers, where every head's key and value took 32 x 2 x 16 x 192 x 2."""
    from transformers import YoutuConfig

    from llmrun.loading import inspect
    from llmrun.models import kv_cache_bytes

    config = YoutuConfig().to_dict()
    assert kv_cache_bytes(config, 1000, 2) == 1000 * 32 * 576 * 2
    assert inspect.kv_cache_bytes(config, 1000, 2) == 1000 * 32 * 576 * 2

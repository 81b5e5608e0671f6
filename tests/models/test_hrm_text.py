"""HRM-Text (llmrun/models/hrm_text.py) against transformers' HrmTextForCausalLM: its Hub
folder (the fused attn.gqkv_proj and mlp.gate_up_proj transformers saves, split by
llmrun/loading/hrm_text.py) and llama.cpp's converter's "hrm_text" GGUFs of it
(conversion/hrm_text.py: the two stacks as blk.0-3, the gates as attn_gate, z_L_init as
hrm.z_l_init) in Q8_0, on one tiny random model: 2 layers a stack, 2 H cycles of 2
L cycles (12 KV cache entries), a RoPE base (50000) and an embedding scale (4) that are
not the defaults.

Each stack run feeds the next, 12 layer runs deep: the matrices are drawn at half
randomize()'s scale, where transformers' and llmrun's float32 rounding stays within
~3e-6 (at full scale the recurrence grows it past 1e-4, in float64 too: it amplifies
any 1e-7 change of the inputs ~1000x).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time), the paged cache and
the static decode step (1e-5 against the ordinary forward); the Q8_0 GGUF 1e-4 against
transformers running the weights the file's blocks hold (gguf-py's dequantize). `llmrun
run` picks transformers' 8 greedy token ids from the folder and from each file.
"""

import copy
import json
import shutil

import gguf
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_static_decode,
    check_whole_and_cached,
    dequantize_2d_weights,
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, needs_converter, our_model, save_hf_dir
from in_process import llmrun
from llama_converter import run_converter

from llmrun.loading.loader import load_model

pytest.importorskip("transformers.models.hrm_text")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="hrm_text",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,  # a stack's: transformers' config rewrites it to the 12 runs
    num_attention_heads=4,
    head_dim=16,
    H_cycles=2,
    L_cycles=2,
    embedding_scale=4.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
# The converter's vocabulary: stories260K's SentencePiece (HRM-Text's own is GPT-2 BPE).
LLAMA_VOCAB = "base.TextModel._set_vocab_gpt2 = lambda self: self._set_vocab_llama_hf()"
# 12 cache entries of 4 heads of 16, keys and values, f32, 8192 positions.
KV_8K = 12 * 2 * 4 * 16 * 4 * 8192


def hrm_model(config: dict):
    """transformers' model of `config` (hf_model_of's weights), its matrices halved."""
    model = hf_model_of(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(0.5)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    return hrm_model(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("hrm") / "HRM-Text", tokenizer=True)


def test_matches_transformers_whole_cached_paged_and_static(hf, expected, monkeypatch):
    ours = our_model(hf.config.to_dict(), hf.state_dict())
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)
    check_static_decode(ours, monkeypatch)


def test_the_hub_folder_runs_and_shows(hf, expected, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "hrm_text"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8)
    check_show(folder, "hrm_text", KV_8K)


@needs_converter
def test_the_converters_q8_0_gguf_matches_transformers(hf, folder):
    """Every matrix in Q8_0: the reference holds the values the file's blocks hold."""
    path = folder.parent / "hrm-q8_0.gguf"
    run_converter(folder, {path: "--outtype q8_0"}, LLAMA_VOCAB)
    rounded = copy.deepcopy(hf)
    dequantize_2d_weights(rounded, gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["num_layers_per_stack"] == 2
    assert max_diff(cached_logits(loaded.model, IDS), reference(rounded)) < 1e-4
    check_run_token_ids(rounded, path, tokens=8)
    check_show(path, "hrm_text", KV_8K)


# What the parity tests hold llmrun to, each changed in the reference alone (the same
# weights): the logits move by far more than the tolerance.
FEATURES = {
    "the L cycles": dict(L_cycles=1),
    "the H cycles": dict(H_cycles=1),
    "the embedding scale": dict(embedding_scale=1.0),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(expected, feature):
    assert max_diff(reference(hrm_model({**CONFIG, **FEATURES[feature]})), expected) > 0.1


def test_the_low_state_start_changes_the_logits(hf, expected):
    changed = copy.deepcopy(hf)
    with torch.no_grad():
        changed.model.z_L_init.zero_()
    assert max_diff(reference(changed), expected) > 0.1


def test_a_config_counting_a_stacks_layers_caches_every_stack_run():
    """The original configs' num_hidden_layers (no num_layers_per_stack) is a stack's
    layer count: `show` and the model count 12 cache entries alike."""
    from llmrun.loading import inspect
    from llmrun.models import kv_cache_bytes

    assert inspect.kv_cache_bytes(CONFIG, 8192) == kv_cache_bytes(CONFIG, 8192) == KV_8K


def test_a_folder_without_h_cycles_is_refused(folder, tmp_path):
    broken = shutil.copytree(folder, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "H_cycles": 0}))
    result = llmrun("run", str(broken), "Once upon a time", "-n", "1")
    assert result.returncode == 1
    assert result.stderr == "error: hrm_text H_cycles is 0, not a positive whole number\n"

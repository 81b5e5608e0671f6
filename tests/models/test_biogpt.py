"""BioGPT (microsoft/biogpt: llmrun's OPT model with scaled token embeddings,
llmrun/loading/fairseq_lm.py renaming its checkpoints) against transformers'
BioGptForCausalLM, from the folder save_pretrained writes (biogpt.* names, the output
projection tied to the embeddings) and from a config.json and a state dict. llama.cpp
has no converter for BioGPT: folders only. The Hub folders' tokenizer (Moses, then BPE:
vocab.json and merges.txt, BioGptTokenizer's, which needs sacremoses) is not read, so
the folder here carries stories260K's tokenizer.json.

The tiny model: 2 layers, hidden 64, 4 heads of 16, a GELU feed-forward of 96, 256
positions (OPT's offset of 2), stories260K's 512-token vocabulary for `llmrun run`.
Its features each move the logits by far more than the tolerance
(test_each_feature_is_followed): the embeddings' sqrt(hidden) scale, the GELU (OPT's
default is ReLU), the positions' offset of 2.

Tolerances: f32 logits 1e-4 max abs against transformers, whole, through the KV cache
(prefills in chunks, then one token at a time) and the paged cache; the static decode
step 1e-5 against the ordinary forward. `llmrun run` picks transformers' 8 greedy token
ids from the folder.
"""

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
from helpers import BASE, cached_logits, our_model, save_hf_dir

from llmrun.loading import fairseq_lm
from llmrun.loading.loader import load_model
from llmrun.models import opt

pytest.importorskip("transformers.models.biogpt")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="biogpt",
    vocab_size=BASE["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    hidden_act="gelu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


def ours(hf):
    return our_model(hf.config.to_dict(), fairseq_lm.hf_weights(hf.state_dict(), "biogpt"))


def test_the_folder_matches_transformers_whole_cached_paged_and_static(
    hf, expected, tmp_path, monkeypatch
):
    folder = save_hf_dir(hf, tmp_path / "biogpt-tiny", tokenizer=True)
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "biogpt"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_static_decode(loaded.model, monkeypatch)
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 2 layers' keys and values of 4 heads of 16, f32, 8192 positions.
    check_show(folder, "biogpt", 2 * 2 * 64 * 4 * 8192)


def test_unscaled_embeddings_and_relu_match_transformers_too():
    hf = hf_model_of(dict(CONFIG, scale_embedding=False, hidden_act="relu"))
    with torch.no_grad():
        check_whole_and_cached(ours(hf), IDS, hf(IDS).logits)


def unscaled(model, monkeypatch):
    monkeypatch.setattr(model.args, "scale_embedding", False)


def relu(model, monkeypatch):
    for layer in model.model.layers:
        monkeypatch.setattr(layer.mlp, "act", torch.relu)


def no_offset(model, monkeypatch):
    monkeypatch.setattr(opt, "POSITION_OFFSET", 0)


@pytest.mark.parametrize("planted", [unscaled, relu, no_offset])
def test_each_feature_is_followed(hf, expected, planted, monkeypatch):
    model = ours(hf)
    planted(model, monkeypatch)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1

"""GPT-NeoX Japanese (abeja/gpt-neox-japanese-2.7b: llmrun's GPT-NeoX model, sequential,
unbiased but for the bias after the last layer's attention; llmrun/loading/
gpt_neox_japanese.py renaming its checkpoints) against transformers'
GPTNeoXJapaneseForCausalLM, from the folder save_pretrained writes (embed_out tied to
embed_in) and from a config.json and a state dict. llama.cpp has no converter for it:
folders only. The folder here carries stories260K's tokenizer.json: the Hub's
vocab.txt and emoji.json (GPTNeoXJapaneseTokenizer's) are not read.

The tiny model: 3 layers (the dense_bias in the last alone), hidden 64, 4 heads of 16
(half of each rotated where rotary_pct says 0.5, base 25000), a feed-forward of 2 x 64,
stories260K's 512-token vocabulary for `llmrun run`. Its features each move the logits by
far more than the tolerance (test_each_feature_is_followed): the last layer's dense_bias,
the sequential residual.

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
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir

from llmrun.loading import gpt_neox_japanese
from llmrun.loading.loader import load_model

pytest.importorskip("transformers.models.gpt_neox_japanese")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="gpt_neox_japanese",
    vocab_size=BASE["vocab_size"],
    hidden_size=64,
    intermediate_multiple_size=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    rotary_pct=0.5,
    rotary_emb_base=25000,
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
    return our_model(hf.config.to_dict(), gpt_neox_japanese.hf_weights(hf.state_dict()))


def test_the_hub_folder_matches_transformers_whole_cached_paged_and_static(
    hf, expected, tmp_path, monkeypatch
):
    """Its config.json as the Hub's: rotary_pct and rotary_emb_base, no rope_parameters."""
    folder = save_hf_dir(hf, tmp_path / "gpt-neox-japanese-tiny", tokenizer=True)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rotary_pct=0.5, rotary_emb_base=25000)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gpt_neox_japanese"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_static_decode(loaded.model, monkeypatch)
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 3 layers' keys and values of 4 heads of 16, f32, 8192 positions.
    check_show(folder, "gpt_neox_japanese", 3 * 2 * 64 * 4 * 8192)


def test_its_defaults_match_transformers_too():
    """GPTNeoXJapaneseConfig's: every feature rotated, base 10000, a feed-forward 4x."""
    config = {k: v for k, v in CONFIG.items() if k not in ("rotary_pct", "rotary_emb_base")}
    hf = hf_model_of({**config, "intermediate_multiple_size": 4})
    with torch.no_grad():
        check_whole_and_cached(ours(hf), IDS, hf(IDS).logits)


def no_dense_bias(model, monkeypatch):
    monkeypatch.setattr(model.model.layers[-1].attention, "dense_bias", None)


def parallel_residual(model, monkeypatch):
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "parallel", True)


@pytest.mark.parametrize("planted", [no_dense_bias, parallel_residual])
def test_each_feature_is_followed(hf, expected, planted, monkeypatch):
    model = ours(hf)
    planted(model, monkeypatch)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1

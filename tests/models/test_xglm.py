"""XGLM (facebook/xglm-*: llmrun's OPT model with fairseq's sinusoidal positions,
llmrun/loading/fairseq_lm.py renaming its checkpoints) against transformers'
XGLMForCausalLM, from the folder save_pretrained writes (model.* names, lm_head tied to
the embeddings) and from a config.json and a state dict. llama.cpp has no converter for
XGLM: folders only.

The tiny model: 2 layers, d_model 64, 4 heads of 16, a GELU feed-forward of 96, 256
positions, 512 token rows, and for `llmrun run` an XGLMTokenizer (a Unigram of stories260K's pieces and
XGLM's 7 made-up words, 264 ids) saved beside it: llmrun puts its </s> before a prompt,
as transformers does, and its ids equal transformers'. Its features each move
the logits by far more than the tolerance (test_each_feature_is_followed): the
embeddings' sqrt(d_model) scale, the sinusoids' offset of 2 rows; and a pad_token_id of 5
zeroes the sinusoid of position 3, as transformers' table does (the config variants).

Tolerances: f32 logits 1e-4 max abs against transformers, whole, through the KV cache
(prefills in chunks, then one token at a time) and the paged cache; the static decode
step 1e-5 against the ordinary forward. `llmrun run` picks transformers' 8 greedy token
ids from the folder.
"""

import json

import pytest
import torch
from family_checks import (
    PROMPT,
    check_paged,
    check_run_token_ids,
    check_show,
    check_static_decode,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import STORIES_HF, cached_logits, our_model, save_hf_dir

from llmrun.loading import fairseq_lm
from llmrun.loading.loader import load_model
from llmrun.models import opt
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.xglm")


def xglm_tokenizer():
    """transformers' XGLMTokenizer of a Unigram over stories260K's pieces (but its byte
    tokens), after XGLM's <s>, <pad>, </s>, <unk>."""
    pieces = json.loads((STORIES_HF / "tokenizer.json").read_text())["model"]["vocab"]
    words = [p for p, i in sorted(pieces.items(), key=lambda kv: kv[1]) if i >= 3 + 256]
    units = [(special, 0.0) for special in ("<s>", "<pad>", "</s>", "<unk>")]
    units += [(word, -(len(words) - k) / 100) for k, word in enumerate(words)]
    return transformers.XGLMTokenizer(vocab=units)


TOKENIZER = xglm_tokenizer()

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="xglm",
    vocab_size=512,  # more rows than the tokenizer's 264: serve's paged checks take 512
    d_model=64,
    ffn_dim=96,
    num_layers=2,
    attention_heads=4,
    max_position_embeddings=256,
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
    return our_model(hf.config.to_dict(), fairseq_lm.hf_weights(hf.state_dict(), "xglm"))


def test_the_folder_matches_transformers_whole_cached_paged_and_static(
    hf, expected, tmp_path, monkeypatch
):
    folder = save_hf_dir(hf, tmp_path / "xglm-tiny")
    TOKENIZER.save_pretrained(folder)
    ids = TOKENIZER(PROMPT).input_ids
    assert ids[0] == 2 and load_tokenizer(folder).encode(PROMPT) == ids
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "xglm"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_static_decode(loaded.model, monkeypatch)
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 2 layers' keys and values of 4 heads of 16, f32, 8192 positions.
    check_show(folder, "xglm", 2 * 2 * 64 * 4 * 8192)


@pytest.mark.parametrize(
    "variant",
    [dict(scale_embedding=False, activation_function="relu"), dict(pad_token_id=5)],
    ids=str,
)
def test_config_variants_match_transformers(variant):
    hf = hf_model_of(dict(CONFIG, **variant))
    with torch.no_grad():
        check_whole_and_cached(ours(hf), IDS, hf(IDS).logits)


def unscaled(model, monkeypatch):
    monkeypatch.setattr(model.args, "scale_embedding", False)


def no_offset(model, monkeypatch):
    monkeypatch.setattr(opt, "POSITION_OFFSET", 0)


@pytest.mark.parametrize("planted", [unscaled, no_offset])
def test_each_feature_is_followed(hf, expected, planted, monkeypatch):
    model = ours(hf)
    planted(model, monkeypatch)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1

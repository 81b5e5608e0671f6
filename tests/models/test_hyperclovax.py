"""HyperCLOVA X SEED (llmrun/models/hyperclovax.py) against transformers'
HyperCLOVAXForCausalLM: its Hub folder on one tiny random model (2 layers, hidden 64)
with every muP scalar away from 1 and the norms after each sublayer (use_post_norm), its
config.json leaving attention_multiplier to HyperCLOVAXConfig's default (head_dim^-0.5).
llama.cpp has no converter for HyperCLOVAXForCausalLM: folders only.

Each way HyperCLOVA X differs from Granite moves the logits by far more than the
tolerance (test_each_difference_from_granite_moves_the_logits): the post norms, the
logits multiplied (Granite divides) and the default attention multiplier (Granite's is 1).

Tolerances: f32 logits (within about ±22) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache
(the static decode step: 1e-5 against the ordinary forward). `llmrun run` picks
transformers' 8 greedy token ids.
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

from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.hyperclovax")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="hyperclovax",
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    logits_scaling=3.0,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    """The Hub folder (stories260K's tokenizer), its config.json without
    attention_multiplier."""
    path = save_hf_dir(hf, tmp_path_factory.mktemp("hyperclovax") / "seed", tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    assert config.pop("attention_multiplier") == 16**-0.5 and config["use_post_norm"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_hub_folder_matches_transformers_whole_cached_paged_and_static(
    hf, expected, folder, monkeypatch
):
    # transformers reads the folder's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "hyperclovax"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_static_decode(loaded.model, monkeypatch)
    check_run_token_ids(hf, folder, tokens=8)
    # 2 layers' keys and values of 2 heads of 16, f32, 8192 positions.
    check_show(folder, "hyperclovax", 2 * 2 * 2 * 16 * 4 * 8192)


DIFFERENCES = {
    "no post norms": dict(use_post_norm=False),
    "the logits divided": dict(logits_scaling=1 / CONFIG["logits_scaling"]),
    "Granite's attention multiplier": dict(attention_multiplier=1.0),
}


@pytest.mark.parametrize("case", list(DIFFERENCES))
def test_each_difference_from_granite_moves_the_logits(expected, case):
    """The model with one of them read Granite's way (same weights) is far from
    transformers' logits; llmrun follows that config too."""
    variant = hf_model_of({**CONFIG, **DIFFERENCES[case]})
    logits = reference(variant)
    assert max_diff(logits, expected) > 0.1
    ours = our_model(variant.config.to_dict(), variant.state_dict())
    assert max_diff(cached_logits(ours, IDS), logits) < 1e-4

"""JetMoE (llmrun/models/jetmoe.py) against transformers' JetMoeForCausalLM: its Hugging
Face folder as save_pretrained writes it (the experts stacked, split by
llmrun/loading/jetmoe.py; tied embeddings, the Hub's default), on one tiny random model:
2 layers, hidden 64, 4 experts a mixture, 2 a token, in the attention (2 KV heads of 16,
so 4 query heads) and in the feed-forward. llama.cpp has no converter for the family.

rms_norm_eps is 0.05, far from the 1e-6 that the decoder layers' norms take whatever the
config says (transformers' JetMoeRMSNorm default): a model that gave them the config's
would miss by far more than the tolerance (test_the_layer_norms_ignore_rms_norm_eps).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time) and the paged cache.
`llmrun run` picks transformers' 8 greedy token ids from the folder.
"""

import pytest
import torch
from family_checks import check_paged, check_run_token_ids, check_show, hf_model_of, max_diff
from helpers import BASE, cached_logits, save_hf_dir

from llmrun.loading.loader import load_model
from llmrun.models import jetmoe

pytest.importorskip("transformers.models.jetmoe")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="jetmoe",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_key_value_heads=2,
    kv_channels=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=0.05,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
# 2 layers' keys and values of 2 heads of 16, f32, 8192 positions.
KV_8K = 2 * 2 * 2 * 16 * 4 * 8192


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
    return save_hf_dir(hf, tmp_path_factory.mktemp("jetmoe") / "jetmoe-8b", tokenizer=True)


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(hf, expected, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "jetmoe"
    with torch.no_grad():
        assert max_diff(loaded.model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_paged(loaded.model, IDS, expected)
    check_run_token_ids(hf, folder, tokens=8)
    check_show(folder, "jetmoe", KV_8K, moe=True)


def test_the_layer_norms_ignore_rms_norm_eps(expected, folder, monkeypatch):
    monkeypatch.setattr(jetmoe, "LAYER_NORM_EPS", CONFIG["rms_norm_eps"])
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) > 0.1


def test_one_expert_a_token_changes_the_logits(expected):
    """Another top-k (the same weights): fewer query heads, other mixtures."""
    assert max_diff(reference(hf_model_of({**CONFIG, "num_experts_per_tok": 1})), expected) > 0.1

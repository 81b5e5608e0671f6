"""Mistral 4 (llmrun/models/mistral4.py) against transformers' Mistral4ForCausalLM: whole
and cached forwards, its Hub folder (stacked experts), llama.cpp's `mistral4` GGUFs (F32
and Q8_0), and a `deepseek2` GGUF with Llama 4's query temperature (as Mistral Large
3's files carry it), on a tiny random model whose 40 tokens cross the temperature's
first steps (every 4 positions here) and whose router groups matter."""

import pytest
import torch
from family_checks import check_run_prints_greedy_tokens, check_show
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model, randomize
from test_deepseek import (
    COMMON,
    IDS,
    gguf_tensors,
    hub_state_dict,
    round_as_q8_0_gguf,
    write_deepseek2,
)

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
mistral4 = pytest.importorskip("transformers.models.mistral4")

ROPE = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=4,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    llama_4_scaling_beta=0.5,
)
CONFIG = {
    **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
    "q_lora_rank": 32,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.0,
    "rope_parameters": ROPE,
}


def hf_model(**overrides):
    config = mistral4.Mistral4Config(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = mistral4.Mistral4ForCausalLM(config).eval()
    randomize(model, {"o_proj.weight": 0.03})
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_matches_transformers_whole_and_through_the_cache():
    hf = hf_model()
    expected = reference(hf)
    ours = our_model(hf.config.to_dict(), hub_state_dict(hf))
    with torch.no_grad():
        whole = ours(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (cached_logits(ours, IDS) - expected).abs().max() < 1e-4


# Each feature, switched off in the reference (same weights otherwise), moves the logits
# far past the parity tolerance, so the test above checks every one of them.
FEATURES = {
    "query temperature": {"rope_parameters": {**ROPE, "llama_4_scaling_beta": 0.0}},
    "router groups": {"n_group": 1, "topk_group": 1},
    "routed_scaling_factor": {"routed_scaling_factor": 1.0},
    "norm_topk_prob": {"norm_topk_prob": False},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    with_feature, without = hf_model(), hf_model(**FEATURES[feature])
    without.load_state_dict(with_feature.state_dict())
    assert (reference(without) - reference(with_feature)).abs().max() > 0.05


def test_a_hub_folder_with_stacked_experts_loads(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "mistral4"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def mistral4_gguf(path, hf, qtype=None, arch="mistral4", metadata=None):
    return write_deepseek2(
        path, hf, gguf_tensors(hf, split_kv=True), qtype, arch=arch, metadata=metadata
    )


def test_a_mistral4_gguf_matches_transformers(tmp_path):
    # As the converter writes it: no temperature keys, so (as llama.cpp does) none.
    hf = hf_model(rope_parameters={**ROPE, "llama_4_scaling_beta": 0.0})
    loaded = load_model(mistral4_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "mistral4"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    hf = hf_model(rope_parameters={**ROPE, "llama_4_scaling_beta": 0.0})
    path = mistral4_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    loaded = load_model(path, torch.device("cpu"), "f32")
    round_as_q8_0_gguf(hf)
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


TEMPERATURE = {Keys.Attention.TEMPERATURE_SCALE: 0.5, Keys.Attention.TEMPERATURE_LENGTH: 4}


@pytest.mark.parametrize("arch", ["mistral4", "deepseek2"])
def test_a_gguf_with_the_query_temperature_matches_transformers(tmp_path, arch):
    # Mistral Large 3's files are deepseek2 ones with the temperature keys; one group, so
    # DeepSeek-V2's softmax routing is Mistral 4's. transformers counts the steps in YaRN's
    # original context, llama.cpp in attention.temperature_length: here both are 4.
    hf = hf_model(n_group=1, topk_group=1)
    path = mistral4_gguf(tmp_path / "m.gguf", hf, arch=arch, metadata=TEMPERATURE)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["rope_parameters"]["llama_4_scaling_length"] == 4
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_temperature_without_its_length_is_refused(tmp_path):
    hf = hf_model()
    metadata = {Keys.Attention.TEMPERATURE_SCALE: 0.5}
    path = mistral4_gguf(tmp_path / "m.gguf", hf, metadata=metadata)
    with pytest.raises(ModelFormatError, match="temperature_length"):
        load_model(path, torch.device("cpu"), "f32")


def test_llmrun_run_and_show(tmp_path):
    hf = hf_model(rope_parameters={**ROPE, "llama_4_scaling_beta": 0.0})
    path = mistral4_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)
    # One latent head of 32 + 32, key and value alike, f32, 8192 positions, 3 layers.
    check_show(path, "mistral4", 3 * 64 * 4 * 8192, moe=True)

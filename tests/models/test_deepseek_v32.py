"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention: llmrun/models/deepseek_v32.py,
glm_moe_dsa.py) against transformers' DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM:
from config.json-style dicts with the Hub's per-expert weights, a saved Hub folder with a
multi-token-prediction layer, and "deepseek32"/"glm-dsa" GGUFs written as llama.cpp's
converter writes them (deepseek2's MLA split and stacked experts, the indexer's sizes
under attention.indexer.*, its tensors blk.N.indexer.*, GLM's indexer.types, the MTP
block counted in block_count).

The tiny models keep index_topk at 6 of 40 tokens, so the indexer chooses keys in every
prefill chunk past the sixth position and in every decode step; GLM-5's has a shared
layer between two full ones. Tolerances: 1e-4 on logits within about ±7 in f32 (measured
~6e-6), whole, through the KV cache (chunked prefill, then one token at a time), the
paged cache and a Q8_0 GGUF (held to transformers on the dequantized weights). Cache
types are held to an f32 cache of the rounded keys (1e-5, test_cache_types' check).
GLM-5's own config and GGUF defaults are checked in test_glm_moe_dsa.py.
"""

import types

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_show,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model
from test_cache_types import TOLERANCE
from test_deepseek import (
    COMMON,
    IDS,
    YARN,
    deepseek2_keys,
    gguf_tensors,
    hub_state_dict,
    round_as_q8_0_gguf,
    routed_model,
)

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import dsa
from llmrun.loading.loader import load_model
from llmrun.models import glm_moe_dsa, kv_cache_bytes
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm_moe_dsa")

DSA = dict(
    q_lora_rank=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    index_topk=6,
    index_n_heads=8,
    index_head_dim=64,  # the cached head: 32 + 32 + 64, Q8_0's blocks of 32
)
CONFIGS = {
    # V3.2's YaRN (mscale_all_dim scales the softmax too)
    "deepseek_v32": dict(
        model_type="deepseek_v32",
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    "glm_moe_dsa": dict(model_type="glm_moe_dsa", indexer_types=["full", "shared", "full"]),
}
ARCHS = {"deepseek_v32": dsa.DEEPSEEK32, "glm_moe_dsa": dsa.GLM_DSA}


def hf_model(name: str, **overrides):
    """A tiny transformers model of `name`, weights as test_deepseek's routed models."""
    return routed_model({**COMMON, **DSA, **CONFIGS[name], **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours_of(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


def whole_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


# index_topk 12: the first two prefill chunks (7 and 3 tokens) attend to every key, and
# cache the indexer's keys that the later ones choose among; 36: so do the first decode
# steps (the prefills end at 33).
@pytest.mark.parametrize("topk", [6, 12, 36])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_whole_and_through_the_cache(name, topk):
    hf = hf_model(name, index_topk=topk)
    expected = reference(hf)
    ours = ours_of(hf)
    assert (whole_logits(ours) - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(ours, IDS) - expected).abs().max() < 1e-4


def switch_off(model, feature: str) -> None:
    """Take `feature` out of our model (its weights kept)."""
    for layer in model.model.layers:
        attention = layer.self_attn
        indexer = attention.indexer
        if feature == "indexer":  # attend to every key
            attention.topk = 10**6
        elif feature == "indexer rope layout" and indexer is not None:
            indexer.pairs = not indexer.pairs
        elif feature == "shared layer" and indexer is None:  # attends to every key
            attention.topk = 10**6
        elif feature == "k_norm bias" and indexer is not None:
            indexer.k_norm.bias.data.zero_()


# Each feature, taken out of our model (same weights otherwise), moves its logits far past
# the parity tolerance, so the parity test above checks every one of them.
FEATURES = {
    "indexer": ["deepseek_v32", "glm_moe_dsa"],
    "indexer rope layout": ["deepseek_v32", "glm_moe_dsa"],
    "shared layer": ["glm_moe_dsa"],
    "k_norm bias": ["deepseek_v32"],
}


@pytest.mark.parametrize("feature,name", [(f, n) for f, names in FEATURES.items() for n in names])
def test_each_feature_changes_the_logits(feature, name):
    hf = hf_model(name)
    ours = ours_of(hf)
    switch_off(ours, feature)
    assert (whole_logits(ours) - reference(hf)).abs().max() > 0.1
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() > 0.1


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"indexer_types": ["shared", "full", "full"]}, ModelFormatError, "the first full"),
        ({"indexer_types": ["full", "sometimes", "full"]}, ModelFormatError, "indexer_types"),
        ({"q_lora_rank": None}, UnsupportedError, "without q_lora_rank"),
        ({"index_head_dim": 16}, ModelFormatError, "index_head_dim"),
    ],
)
def test_configs_it_cannot_run_are_refused(change, error, match):
    config = {**COMMON, **DSA, **CONFIGS["glm_moe_dsa"], **change}
    with pytest.raises(error, match=match):
        glm_moe_dsa.ModelArgs.from_config(config)


# ---- caches ------------------------------------------------------------------------------


# index_topk 30: the first decode steps (prefills of 7 and 20) attend to every key in
# the blocks (the native kernel), the later ones to those the indexer chose.
@pytest.mark.parametrize("topk", [6, 30])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_paged_cache_gives_transformers_logits(name, topk):
    hf = hf_model(name, index_topk=topk)
    check_paged(ours_of(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys(cache_type):
    ours = ours_of(hf_model("glm_moe_dsa"))
    f16 = cache_type == "f16"
    check_rounded_cache(ours, cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_cache_holds_the_indexer_keys_beside_the_latent():
    hf = hf_model("deepseek_v32")
    ours = ours_of(hf)
    cache = ours.new_cache(1, 10, torch.float32, "cpu")
    assert cache.k.shape == (3, 1, 1, 10, 32 + 32 + 64) and cache.v is cache.k
    assert kv_cache_bytes(hf.config.to_dict(), 10) == cache.nbytes
    from llmrun.loading import inspect

    assert inspect.kv_cache_bytes(hf.config.to_dict(), 10) == cache.nbytes


def test_the_native_decode_step_is_not_attached():
    ours = ours_of(hf_model("deepseek_v32"))
    assert not decode_step.attach(ours)
    assert ours.decode_step is None


# ---- Hub folders and GGUFs -------------------------------------------------------------


def test_a_hub_folder_loads_without_its_multi_token_prediction_layer(tmp_path):
    import json

    from safetensors.torch import save_file

    hf = hf_model("glm_moe_dsa")
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}
    save_file(extra, str(folder / "model-mtp.safetensors"))
    index = {"weight_map": {k: "model.safetensors" for k in hub_state_dict(hf)}}
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(folder, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "glm_moe_dsa"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4
    # The Hub's DeepSeek-V3.2 is FP8: refused, as DeepSeek-V3's is.
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="fp8 checkpoints are not supported"):
        load_model(folder, torch.device("cpu"), "f32")


INDEXER_GGUF_NAMES = {
    "wq_b": "indexer.attn_q_b",
    "wk": "indexer.attn_k",
    "k_norm": "indexer.k_norm",
    "weights_proj": "indexer.proj",
}


def dsa_tensors(hf, mtp: bool = True) -> dict[str, np.ndarray]:
    """GGUF name -> array as the converter writes the model: deepseek2's tensors, the
    indexer's, and (with `mtp`) an MTP block after the last layer."""
    state = hf.state_dict()
    trunk = {k: v for k, v in state.items() if ".indexer." not in k}
    shim = types.SimpleNamespace(config=hf.config, state_dict=lambda: trunk)
    out = gguf_tensors(shim, split_kv=True)
    for key, value in state.items():
        if ".indexer." in key:
            _, _, layer, _, _, module, suffix = key.split(".")
            out[f"blk.{layer}.{INDEXER_GGUF_NAMES[module]}.{suffix}"] = value.numpy()
    if mtp:
        last = hf.config.num_hidden_layers
        for name, shape in (("nextn.eh_proj.weight", (64, 128)), ("attn_norm.weight", (64,))):
            out[f"blk.{last}.{name}"] = np.zeros(shape, np.float32)
    return out


def dsa_keys(hf, mtp: bool = True) -> dict:
    """The "{arch}" keys the converter writes for the model."""
    c, A = hf.config, Keys.Attention
    keys = deepseek2_keys(c, split_kv=True)
    keys.update({
        Keys.LLM.EXPERT_GATING_FUNC: 2,  # sigmoid
        A.Indexer.HEAD_COUNT: c.index_n_heads,
        A.Indexer.KEY_LENGTH: c.index_head_dim,
        A.Indexer.TOP_K: c.index_topk,
    })  # fmt: skip
    if mtp:
        keys[Keys.LLM.BLOCK_COUNT] = c.num_hidden_layers + 1
        keys[Keys.LLM.NEXTN_PREDICT_LAYERS] = 1
    if c.model_type == "glm_moe_dsa":
        keys[dsa.INDEXER_TYPES] = [t == "full" for t in c.indexer_types]
    return keys


def write_dsa(path, hf, qtype=None, metadata=None, mtp: bool = True):
    from family_checks import write_keyed_gguf

    keys = {**dsa_keys(hf, mtp), **(metadata or {})}
    return write_keyed_gguf(path, ARCHS[hf.config.model_type], keys, dsa_tensors(hf, mtp), qtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_gguf_matches_transformers(tmp_path, name):
    hf = hf_model(name)
    loaded = load_model(write_dsa(tmp_path / "m.gguf", hf), torch.device("cpu"), "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == name and config["num_hidden_layers"] == 3
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path, name):
    hf = hf_model(name)
    path = write_dsa(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    loaded = load_model(path, torch.device("cpu"), "f32")
    round_as_q8_0_gguf(hf)
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "metadata,error,match",
    [
        ({Keys.LLM.EXPERT_GATING_FUNC: None}, ModelFormatError, "expert_gating_func"),
        ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError, "sigmoid-gated"),
        ({Keys.Attention.Indexer.TOP_K: None}, ModelFormatError, "indexer.top_k"),
    ],
)
def test_a_deepseek32_gguf_it_cannot_run_is_refused(tmp_path, metadata, error, match):
    path = write_dsa(tmp_path / "m.gguf", hf_model("deepseek_v32"), metadata=metadata)
    with pytest.raises(error, match=match):
        load_model(path, torch.device("cpu"), "f32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llmrun_run_and_show(tmp_path, name):
    hf = hf_model(name)
    path = write_dsa(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)
    # One head of 32 + 32 + 64, key and value alike, f32, 8192 positions, 3 layers.
    check_show(path, ARCHS[name], 3 * 128 * 4 * 8192, moe=True)

"""Hunyuan V4 (llmrun/models/hy_v4.py) against transformers' HYV4ForCausalLM: from
config.json-style dicts with per-expert weights, Hub folders (as transformers saves
them, and as the Hub's release names its tensors, with its MTP layer), HY V4 VL's folder
(its language model, against HYV4VLForConditionalGeneration), and "hy_v4" GGUFs written as
llama.cpp's converter writes them (conversion/hy_v4.py: deepseek2's MLA split and
stacked experts, no group keys, sigmoid gating, the indexer's keys and tensors on its
full layers only, attn_sinks, attn_gate, the hyper-connections' tensors in F32 and
their count, epsilon and magnitude, swiglu_clamp_exp per layer).

The tiny models keep index_topk at 6 of 40 tokens, so the indexer chooses keys in every
prefill chunk past the sixth position and in every decode step; layer 1 is a shared one
between two full ones. swiglu_limit 0.6 clamps most of the routed experts' inputs,
hc_mult 3 and hc_magnitude 1.5 are not the defaults. Each feature, taken out of our
model, moves the logits past 0.1 (test_each_feature_changes_the_logits): the sinks,
the output gate, the indexer and its shared layer, the indexer's RoPE on the heads'
last features, the experts' clamp, the hyper-connections' magnitude and the indexer
key norm's eps (rms_norm_eps, shown with a large one).

Tolerances: 1e-4 on f32 logits within about ±7 (measured ~6e-6), whole, through the KV
cache (chunked prefill, then one token at a time), the paged cache, and GGUFs in F32 and
Q8_0 (held to transformers on the weights the file holds). Cache types are held to an
f32 cache of the rounded keys (1e-5, test_cache_types' check). serve's scheduler gives
concurrent requests their text alone; `llmrun run` prints transformers' greedy text.
"""

import json
import types

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_served_as_alone,
    check_show,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model
from test_cache_types import TOLERANCE
from test_deepseek import (
    COMMON,
    IDS,
    deepseek2_keys,
    gguf_tensors,
    hub_state_dict,
    q8_0,
    routed_model,
)

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import dsa, hy_v4
from llmrun.loading.loader import load_model
from llmrun.models import deepseek_v32, kv_cache_bytes
from llmrun.models import hy_v4 as model_hy_v4
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.hy_v4")

CPU = torch.device("cpu")
HY_V4 = {
    **{k: v for k, v in COMMON.items() if k != "first_k_dense_replace"},
    "model_type": "hy_v4",
    "pad_token_id": 0,  # HYV4Config's is past the tiny vocabulary
    "q_lora_rank": 32,
    "routed_scaling_factor": 2.5,
    "index_topk": 6,
    "index_n_heads": 8,
    "index_head_dim": 64,  # the cached head: 32 + 32 + 64, Q8_0's blocks of 32
    "indexer_types": ["full", "shared", "full"],
    "swiglu_limit": 0.6,
    "hc_mult": 3,
    "hc_magnitude": 1.5,
}
# The tensors the converter keeps in F32 beyond the 1-D ones and the routers.
F32_TENSORS = ("hc_attn_fn", "hc_ffn_fn", "output_hc_fn", "indexer.proj")


def hf_model(**overrides):
    """The tiny transformers HYV4ForCausalLM (f32, eval), weights as test_deepseek's
    routed models (selection biases large enough to change the choice)."""
    return routed_model({**HY_V4, **overrides})


def reference(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(IDS).logits


def ours_of(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


def whole_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


# index_topk 12: the first two prefill chunks attend to every key and cache the
# indexer's keys the later ones choose among; 36: so do the first decode steps.
@pytest.mark.parametrize("topk", [6, 12, 36])
def test_matches_transformers_whole_and_through_the_cache(topk):
    hf = hf_model(index_topk=topk)
    expected = reference(hf)
    ours = ours_of(hf)
    assert (whole_logits(ours) - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(ours, IDS) - expected).abs().max() < 1e-4


def test_defaults_come_as_transformers_derives_them():
    hf = transformers.HYV4Config(num_hidden_layers=7)
    args = model_hy_v4.ModelArgs.from_config({**hf.to_dict(), "first_k_dense_replace": 3})
    assert args.indexer_types == hf.indexer_types
    assert args.mlp_layer_types == hf.mlp_layer_types == ["dense"] + ["sparse"] * 6
    for name in ("hc_mult", "hc_magnitude", "hc_eps", "swiglu_limit", "index_n_heads"):
        assert getattr(args, name) == getattr(hf, name), name


def without_sinks(attention) -> None:
    plain = deepseek_v32.Attention
    attention.attend_all = types.MethodType(plain.attend_all, attention)
    attention.attend_chosen = types.MethodType(plain.attend_chosen, attention)


def switch_off(model, feature: str) -> None:
    """Take `feature` out of our model (its weights kept)."""
    for layer in model.model.layers:
        attention, indexer = layer.self_attn, layer.self_attn.indexer
        if feature == "sinks":
            without_sinks(attention)
        elif feature == "output gate":
            attention.gated_output = lambda out, x: out
        elif feature == "indexer":  # attend to every key
            attention.topk = 10**6
        elif feature == "shared layer" and indexer is None:
            attention.topk = 10**6
        elif feature == "indexer rope on the last features" and indexer is not None:
            indexer.rotate = types.MethodType(deepseek_v32.Indexer.rotate, indexer)
        elif feature == "experts' clamp" and hasattr(layer.mlp, "experts"):
            for expert in layer.mlp.experts:
                expert.limit = float("inf")
        elif feature == "hc magnitude":
            layer.attn_hc.magnitude = layer.ffn_hc.magnitude = 2.0  # DeepSeek-V4's


FEATURES = [
    "sinks",
    "output gate",
    "indexer",
    "shared layer",
    "indexer rope on the last features",
    "experts' clamp",
    "hc magnitude",
]


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_changes_the_logits(feature):
    hf = hf_model()
    ours = ours_of(hf)
    switch_off(ours, feature)
    assert (whole_logits(ours) - reference(hf)).abs().max() > 0.1
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() > 0.1


def test_the_indexer_key_norm_takes_rms_norm_eps():
    """transformers' HY V4 builds k_norm with rms_norm_eps (DeepSeek-V3.2's 1e-6): shown
    with an eps large enough to matter."""
    hf = hf_model(rms_norm_eps=0.5)
    ours = ours_of(hf)
    assert (whole_logits(ours) - reference(hf)).abs().max() < 1e-4
    for layer in ours.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.k_norm.eps = deepseek_v32.INDEXER_NORM_EPS
    assert (whole_logits(ours) - reference(hf)).abs().max() > 0.1


def unclamped(hf):
    """`hf` with its routed experts' clamp off, as HYV4Config documents swiglu_limit 0
    and llama.cpp runs it (transformers' experts clamp at 0 all the same)."""
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.swiglu_limit = float("inf")
    return hf


def test_no_swiglu_limit_leaves_the_experts_unclamped():
    hf = hf_model(swiglu_limit=0.0)
    ours = ours_of(hf)
    unclamped(hf)
    assert not hasattr(ours.model.layers[1].mlp.experts[0], "limit")
    assert (whole_logits(ours) - reference(hf)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"indexer_types": ["shared", "full", "full"]}, ModelFormatError, "the first full"),
        ({"indexer_types": ["full", "sometimes", "full"]}, ModelFormatError, "indexer_types"),
        ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, UnsupportedError, "dense layers"),
        ({"q_lora_rank": None}, UnsupportedError, "without q_lora_rank"),
    ],
)
def test_configs_it_cannot_run_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        model_hy_v4.ModelArgs.from_config({**HY_V4, **change})


# ---- caches ------------------------------------------------------------------------------


# index_topk 30: the first decode steps (prefills of 7 and 20) attend to every key in
# the blocks, the later ones to those the indexer chose.
@pytest.mark.parametrize("topk", [6, 30])
def test_the_paged_cache_gives_transformers_logits(topk):
    hf = hf_model(index_topk=topk)
    check_paged(ours_of(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys(cache_type):
    ours = ours_of(hf_model())
    f16 = cache_type == "f16"
    check_rounded_cache(ours, cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_the_cache_holds_the_indexer_keys_beside_the_latent():
    hf = hf_model()
    cache = ours_of(hf).new_cache(1, 10, torch.float32, "cpu")
    assert cache.k.shape == (3, 1, 1, 10, 32 + 32 + 64) and cache.v is cache.k
    assert kv_cache_bytes(hf.config.to_dict(), 10) == cache.nbytes
    from llmrun.loading import inspect

    assert inspect.kv_cache_bytes(hf.config.to_dict(), 10) == cache.nbytes


def test_neither_the_native_nor_the_static_decode_step_is_attached():
    ours = ours_of(hf_model())
    assert not decode_step.attach(ours)
    assert ours.decode_step is None
    from llmrun import static_decode

    assert not static_decode.supported(ours, ours.new_cache(1, 8, torch.float32, "cpu"))


# ---- Hub folders ------------------------------------------------------------------------


def hub_names(state: dict) -> dict:
    """transformers' keys as the Hub's checkpoints name them (conversion_mapping.py's
    renames, reversed)."""
    out = {}
    for key, value in state.items():
        for ours, hub in (
            (".attn_hc.", ".hc_attn_layer.hc_pre.hc_"),
            (".ffn_hc.", ".hc_mlp_layer.hc_pre.hc_"),
            (".hc_head.hc_", ".hc_head.hc_head_"),
            (".self_attn.sinks", ".self_attn.learnable_sink_param"),
            (".self_attn.gate_proj.", ".self_attn.linear_gate."),
        ):
            key = key.replace(ours, hub)
        out[key] = value
    return out


@pytest.mark.parametrize("hub", [False, True])
def test_a_hub_folder_loads(tmp_path, hub):
    """transformers' save_pretrained folder; and one under the Hub's names, with its
    multi-token-prediction layer, which llmrun skips as transformers does."""
    from safetensors.torch import save_file

    hf = hf_model()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    if hub:
        state = hub_names(hf.state_dict())
        state["model.mtp_layers.0.eh_proj.weight"] = torch.zeros(64, 128)
        (folder / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "hy_v4"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="fp8 checkpoints are not supported"):
        load_model(folder, CPU, "f32")


def hf_vl_model(**text_overrides):
    """A tiny transformers HYV4VLForConditionalGeneration of HY_V4's language model (with
    `text_overrides`) and a one-layer vision tower, randomize()'s weights."""
    from helpers import randomize

    text = {**{k: v for k, v in HY_V4.items() if k != "model_type"}, **text_overrides}
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [8, 4, 4],
    }
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        out_hidden_size=64, patch_size=4, max_image_size=16,
    )  # fmt: skip
    config = transformers.HYV4VLConfig(
        text_config=text, vision_config=vision, image_token_id=500, video_token_id=501
    )
    torch.manual_seed(0)
    model = transformers.HYV4VLForConditionalGeneration(config).float().eval()
    randomize(model)
    return model


def test_a_hy_v4_vl_folder_runs_its_language_model(tmp_path):
    """HY V4 VL as transformers saves it (the Hub's names: the language model under
    model., the vision tower under vit.): its language model, M-RoPE turning text as
    plain RoPE, the latents normalized at rms_norm_eps (large here, so that it matters)."""
    hf = hf_vl_model(rms_norm_eps=0.5)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "hy_v4_vl_text"
    assert any("multimodal Hunyuan V4" in note for note in loaded.checkpoint.notes)
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


# ---- GGUFs -------------------------------------------------------------------------------

# transformers' names after model.layers.N. -> the converter's after blk.N.
OWN_NAMES = {
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.gate_proj.weight": "attn_gate.weight",
    **{
        f"{stream}_hc.{part}": f"hc_{stream}_{part}.weight"
        for stream in ("attn", "ffn")
        for part in ("fn", "base", "scale")
    },
    **{f"self_attn.indexer.{k}.{s}": f"indexer.{v}.{s}" for k, v, s in (
        ("wq_b", "attn_q_b", "weight"),
        ("wk", "attn_k", "weight"),
        ("k_norm", "k_norm", "weight"),
        ("k_norm", "k_norm", "bias"),
        ("weights_proj", "proj", "weight"),
    )},
}  # fmt: skip


def hy_v4_tensors(hf) -> dict[str, np.ndarray]:
    """GGUF name -> array as the converter writes the model: deepseek2's tensors
    (attn_k_b/attn_v_b, stacked experts), then the family's own."""
    state = hf.state_dict()
    own = {}
    for key, value in state.items():
        if key.startswith("model.hc_head."):
            own[f"output_hc_{key.rsplit('_', 1)[-1]}.weight"] = value
            continue
        parts = key.split(".", 3)
        if len(parts) == 4 and parts[3] in OWN_NAMES:
            own[f"blk.{parts[2]}.{OWN_NAMES[parts[3]]}"] = value
    trunk = {k: v for k, v in state.items() if not k.startswith("model.hc_head.")}
    trunk = {k: v for k, v in trunk.items() if k.split(".", 3)[-1] not in OWN_NAMES}
    shim = types.SimpleNamespace(config=hf.config, state_dict=lambda: trunk)
    out = gguf_tensors(shim, split_kv=True)
    out.update({k: np.ascontiguousarray(v.float().numpy()) for k, v in own.items()})
    return out


def hy_v4_keys(hf) -> dict:
    """The "{arch}" keys the converter writes for the model."""
    c, L, A = hf.config, Keys.LLM, Keys.Attention
    dense = c.mlp_layer_types.index("sparse")
    shim = types.SimpleNamespace(
        **{**c.to_dict(), "model_type": "deepseek_v3", "n_group": None},
        first_k_dense_replace=dense,
    )
    keys = deepseek2_keys(shim, split_kv=True)
    keys.update({
        L.EXPERT_GATING_FUNC: 2,  # sigmoid
        hy_v4.SWIGLU_CLAMP_EXP: [float(c.swiglu_limit)] * c.num_hidden_layers,
        hy_v4.HC_COUNT: c.hc_mult,
        hy_v4.HC_EPSILON: float(c.hc_eps),
        hy_v4.HC_MAGNITUDE: float(c.hc_magnitude),
        A.Indexer.HEAD_COUNT: c.index_n_heads,
        A.Indexer.KEY_LENGTH: c.index_head_dim,
        A.Indexer.TOP_K: c.index_topk,
        dsa.INDEXER_TYPES: [t == "full" for t in c.indexer_types],
    })  # fmt: skip
    return keys


def write_hy_v4_gguf(path, hf, qtype=None, metadata=None):
    """A GGUF of the transformers model `hf` as llama.cpp's converter writes it: its keys
    (with `metadata` changed; None leaves a key out), stories260K's vocabulary, 2-D and
    3-D tensors but the routers, indexer.proj and the hyper-connections' mixes in `qtype`
    (default F32); returns `path`."""
    keys = {**hy_v4_keys(hf), **(metadata or {})}
    return write_keyed_gguf(path, "hy_v4", keys, hy_v4_tensors(hf), qtype, keep_f32=F32_TENSORS)


def round_as_q8_0_gguf(hf) -> None:
    """Round `hf`'s weights in place as a Q8_0 GGUF of it holds them: Q8_0 rounds each
    row's blocks, transformers' rows but for attn_k_b (kv_b_proj's key rows,
    transposed)."""
    c = hf.config
    kept = ("mlp.gate.weight", "_hc.fn", "hc_head.hc_fn", "indexer.weights_proj.weight")
    state = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if "kv_b_proj" in key:
            kv_b = data.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k = q8_0(kv_b[:, : c.qk_nope_head_dim].transpose(0, 2, 1)).transpose(0, 2, 1)
            v = q8_0(kv_b[:, c.qk_nope_head_dim :])
            data = np.concatenate([k, v], axis=1).reshape(data.shape)
        elif data.ndim > 1 and not key.endswith(kept):
            data = q8_0(data)
        state[key] = torch.from_numpy(np.ascontiguousarray(data))
    hf.load_state_dict(state)


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_hy_v4_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "hy_v4" and config["num_hidden_layers"] == 3
    assert config["indexer_types"] == ["full", "shared", "full"]
    assert (config["hc_mult"], config["swiglu_limit"]) == (3, pytest.approx(0.6))
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    hf = hf_model()
    path = write_hy_v4_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    loaded = load_model(path, CPU, "f32")
    round_as_q8_0_gguf(hf)
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_llama_cpps_defaults_where_keys_are_absent(tmp_path):
    """No swiglu_clamp_exp: unclamped experts; no expert_weights_norm: weights not
    renormalized (transformers' norm_topk_prob false); one indexer.types value for
    every layer."""
    hf = hf_model(swiglu_limit=0.0, norm_topk_prob=False, indexer_types=["full"] * 3)
    metadata = {hy_v4.SWIGLU_CLAMP_EXP: None, dsa.INDEXER_TYPES: None}
    path = write_hy_v4_gguf(tmp_path / "m.gguf", hf, metadata=metadata)
    with pytest.raises(ModelFormatError, match="indexer.types"):
        load_model(path, CPU, "f32")
    metadata = {hy_v4.SWIGLU_CLAMP_EXP: None, dsa.INDEXER_TYPES: True}
    path = write_hy_v4_gguf(tmp_path / "m.gguf", hf, metadata=metadata)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["swiglu_limit"] == 0.0
    unclamped(hf)
    assert not loaded.checkpoint.config["norm_topk_prob"]
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


YARN_KEYS = {
    Keys.Rope.SCALING_TYPE: "yarn",
    Keys.Rope.SCALING_FACTOR: 4.0,
    Keys.Rope.SCALING_ORIG_CTX_LEN: 64,
    Keys.Rope.SCALING_YARN_LOG_MUL: 0.1,
}


@pytest.mark.parametrize(
    "metadata,error,match",
    [
        ({Keys.LLM.EXPERT_GATING_FUNC: None}, UnsupportedError, "sigmoid-gated"),
        ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError, "sigmoid-gated"),
        ({Keys.Attention.Indexer.TOP_K: None}, UnsupportedError, "without DeepSeek sparse"),
        ({Keys.Attention.Indexer.HEAD_COUNT: None}, ModelFormatError, "do not make an indexer"),
        ({dsa.INDEXER_TYPES: [False, True, True]}, ModelFormatError, "the first true"),
        ({hy_v4.HC_MAGNITUDE: None}, ModelFormatError, "hyper_connection.magnitude"),
        ({hy_v4.SWIGLU_CLAMP_EXP: [0.0, 0.6, 0.7]}, UnsupportedError, "one limit"),
        (YARN_KEYS, UnsupportedError, "RoPE scaling 'yarn'"),
    ],
)
def test_a_gguf_it_cannot_run_is_refused(tmp_path, metadata, error, match):
    path = write_hy_v4_gguf(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=match):
        load_model(path, CPU, "f32")


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together) on a
    Q8_0 file: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    path = write_hy_v4_gguf(tmp_path / "m.gguf", hf_model(), GGMLQuantizationType.Q8_0)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)


def test_llmrun_run_and_show(tmp_path):
    hf = hf_model()
    path = write_hy_v4_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)
    # One head of 32 + 32 + 64, key and value alike, f32, 8192 positions, 3 layers.
    check_show(path, "hy_v4", 3 * 128 * 4 * 8192, moe=True)

"""DeepSeek-V4 (llmrun/models/deepseek_v4.py) against transformers' DeepseekV4ForCausalLM:
from a config dict with transformers' state dict (its stacked experts split as the loader
splits them), a folder transformers saved (in DeepSeek's tensor names, as the Hub's), and
"deepseek4" GGUFs written as llama.cpp's converter writes them (conversion/deepseek.py:
the checkpoint's tensors renamed, experts stacked, the hash layers' tid2eid as I32,
per-layer compress_ratios, YaRN for the compressed layers only).

The tiny model has one layer of each kind (sliding, compressed-sparse with rate 4 and an
indexer keeping 2 entries, heavily-compressed with rate 8; 128 in the GGUFs, the only
rate llama.cpp takes, over 136 tokens), a window of 6, 3 residual streams, a hash-routed
first layer, and YaRN on the compressed layers; 40 tokens close ten CSA windows and five
HCA ones. Its indexer has 8 heads: with few heads a window's relu'd score is often
exactly 0 for every head, and top-k among such ties picks differently in a whole forward
and a decode step (transformers' own two paths then differ by ~1.7; llmrun follows each).

Tolerances: 1e-4 on f32 logits within about ±7 (measured ~1e-5), whole, through the KV
cache (chunked prefill, then one token at a time), serve's paged cache and a GGUF; a
GGUF of Q8_0 matrices and Q8_0 or MXFP4 experts (the converter's types for the Hub's FP8
and FP4) is held to transformers on the weights rounded as it holds them (1e-4). Cache types are held to
an f32 cache of the rounded rows (1e-5). Each feature (sinks, the indexer, the compressed
entries, CSA's overlapping windows, the compressed layers' RoPE, the output's turn back,
hash routing, the selection bias, the SwiGLU clamp, the hyper-connections' mixing) is
switched off in turn and shown to move the logits past 1e-2.
"""

import re

import gguf
import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_and_show,
    check_served_as_alone,
    dequantize_2d_weights,
    hf_model_of,
    max_diff,
)
from gguf import GGMLQuantizationType
from helpers import STORIES_GGUF, cached_logits, save_hf_dir

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek4, inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import deepseek_v4, kv_cache_bytes
from llmrun.quant import decode_step
from llmrun.quant.linear import QuantLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG = dict(
    model_type="deepseek_v4",
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=256,
    rope_theta=10000.0,
    layer_types=["sliding_attention", CSA, HCA, CSA],
    compress_rates={CSA: 4, HCA: 8},
    compress_rope_theta=160000.0,
    hc_mult=3,
    hc_sinkhorn_iters=5,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    swiglu_limit=1.0,
    sliding_window=6,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=2,
    partial_rotary_factor=0.25,
    bos_token_id=1,
    eos_token_id=2,
    rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1
    ),
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_model(**overrides):
    """transformers' model with randomize()'s weights, a random selection bias and
    token -> experts tables (each token two distinct experts)."""
    hf = hf_model_of({**CONFIG, **overrides})
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                experts = [torch.randperm(4, generator=generator)[:2] for _ in range(512)]
                gate.tid2eid.copy_(torch.stack(experts))
            else:
                gate.e_score_correction_bias.normal_(0, 0.3, generator=generator)
    return hf


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def split_experts(state: dict) -> dict:
    """transformers' stacked experts as llmrun's per-expert keys (the loader's split)."""
    out = {}
    for key, value in state.items():
        match = _STACKED.fullmatch(key)
        if match is None:
            out[key] = value
            continue
        prefix, width = match.group(1), CONFIG["moe_intermediate_size"]
        for e, expert in enumerate(value):
            if match.group(2) == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.weight"] = expert[:width]
                out[f"{prefix}.{e}.up_proj.weight"] = expert[width:]
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = expert
    return out


def ours_of(hf) -> deepseek_v4.Model:
    config = {**hf.config.to_dict(), "model_type": "deepseek_v4"}
    model = deepseek_v4.Model(deepseek_v4.ModelArgs.from_config(config))
    missing, unexpected = model.load_state_dict(split_experts(hf.state_dict()), strict=False)
    assert not unexpected and not missing
    return model.eval()


def whole(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None])


def test_matches_transformers_whole_and_through_the_cache(hf):
    expected, ours = reference(hf), ours_of(hf)
    assert max_diff(whole(ours), expected) < 1e-4
    # Chunks across window ends, then decode steps, some closing windows.
    assert max_diff(cached_logits(ours, IDS), expected) < 1e-4
    assert max_diff(cached_logits(ours, IDS, chunks=(20,)), expected) < 1e-4


def switch_off(model, feature: str) -> None:
    """`model` without one of DeepSeek-V4's features."""
    layers = model.model.layers
    with torch.no_grad():
        if feature == "sinks":
            for layer in layers:
                layer.self_attn.sinks.fill_(-torch.inf)
        elif feature == "indexer":  # every entry attended to
            for layer in layers:
                if layer.self_attn.compressor is not None and layer.self_attn.compressor.indexer:
                    layer.self_attn.compressor.indexer.topk = 1000
        elif feature == "entries":  # sliding attention only
            for layer in layers:
                layer.self_attn.compressor = None
                layer.self_attn.kind = "sliding_attention"
        elif feature == "csa overlap":  # pool only this window's series
            for layer in layers:
                pool = layer.self_attn.compressor
                if pool is not None and pool.series == 2:
                    pool.position_bias[:, : pool.dim] = -torch.inf
        elif feature == "hash routing":
            layers[0].mlp.gate.tid2eid.zero_()
            layers[0].mlp.gate.tid2eid[:, 1] = 1
        elif feature == "selection bias":
            for layer in layers[1:]:
                layer.mlp.gate.e_score_correction_bias.zero_()
        elif feature == "swiglu clamp":
            for module in model.modules():
                if isinstance(module, deepseek_v4.Expert):
                    module.limit = 1e9
        elif feature == "hyper-connection mixing":  # streams kept apart
            for layer in layers:
                for hc in (layer.attn_hc, layer.ffn_hc):
                    n = hc.n
                    hc.base[2 * n :] = torch.eye(n).flatten() * 1e4
                    hc.fn[2 * n :] = 0
        elif feature == "compress rope":
            model.model.compress_rotary_emb = model.model.rotary_emb
            for layer in layers:
                layer.self_attn.compress_rotary[0] = model.model.rotary_emb


FEATURES = [
    "sinks",
    "indexer",
    "entries",
    "csa overlap",
    "hash routing",
    "selection bias",
    "swiglu clamp",
    "hyper-connection mixing",
    "compress rope",
]


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_changes_the_logits(hf, feature):
    """Each feature, switched off, moves the logits far past the tolerance: the parity
    tests above hold the model to it."""
    ours = ours_of(hf)
    switch_off(ours, feature)
    assert max_diff(cached_logits(ours, IDS), reference(hf)) > 1e-2


def test_turning_the_outputs_back_matters(hf, monkeypatch):
    ours = ours_of(hf)
    monkeypatch.setattr(deepseek_v4, "turn_back", lambda out, cos, sin: out)
    assert max_diff(whole(ours), reference(hf)) > 1e-2


@pytest.mark.parametrize(
    "change,error,match",
    [
        (
            dict(layer_types=["sliding_attention", "full_attention", HCA, CSA]),
            UnsupportedError,
            "full_attention",
        ),
        (dict(scoring_func="relu"), UnsupportedError, "scoring_func"),
        (dict(n_shared_experts=2), UnsupportedError, "shared experts"),
        (dict(num_key_value_heads=2), ModelFormatError, "one shared"),
        (dict(o_groups=3), ModelFormatError, "output groups"),
        (
            dict(compress_ratios=[0, 4, 64, 4], layer_types=None),
            UnsupportedError,
            "compress_ratios",
        ),
    ],
)
def test_configs_it_cannot_run_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        deepseek_v4.ModelArgs.from_config({**CONFIG, **change})


def test_legacy_config_fields_fold_in_as_transformers_folds_them():
    legacy = {k: v for k, v in CONFIG.items() if k not in ("layer_types", "mlp_layer_types")}
    legacy.update(
        compress_ratios=[0, 4, 128, 4], num_hash_layers=2, qk_rope_head_dim=8,
        partial_rotary_factor=None, compress_rates=None,
    )  # fmt: skip
    hf = transformers.DeepseekV4Config(**legacy)
    ours = deepseek_v4.ModelArgs.from_config(legacy)
    assert ours.layer_types == hf.layer_types
    assert ours.mlp_layer_types == hf.mlp_layer_types
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim == 8
    assert ours.rope_parameters["compress"]["attention_factor"] == 1.0


def test_the_paged_cache_gives_transformers_logits(hf):
    check_paged(ours_of(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_rows(hf, cache_type):
    check_rounded_cache(ours_of(hf), cache_type)


def test_the_cache_holds_one_row_per_token_and_layer(hf):
    ours = ours_of(hf)
    cache = ours.new_cache(1, 64, torch.float32, "cpu")
    # Sliding: the key, 32. CSA: key 32, kv and gate 2 x 2 x 32, entry 32, the indexer's kv
    # and gate 2 x 2 x 16, entry 16 (272, padded to 288). HCA: key, kv, gate, entry (128).
    assert cache.shapes == [(1, 32), (1, 288), (1, 128), (1, 288)]
    assert cache.values_are_keys


@pytest.mark.parametrize(
    "change", [{}, dict(layer_types=None, compress_ratios=[0, 0, 128, 128]), dict(layer_types=None)]
)
def test_show_counts_the_cache_the_model_keeps(change):
    """inspect's torch-free count (llmrun show) is the model's."""
    config = {**CONFIG, **change}
    assert inspect.kv_cache_bytes(config, 8192) == kv_cache_bytes(config, 8192)


def test_the_native_decode_step_is_not_attached(hf):
    ours = ours_of(hf)
    assert "deepseek_v4" not in decode_step.FAMILIES
    assert not decode_step.attach(ours)
    assert ours.decode_step is None


def test_a_transformers_folder_loads(tmp_path, hf):
    save_hf_dir(hf, tmp_path / "m")
    loaded = load_model(tmp_path / "m", torch.device("cpu"), "f32")
    assert loaded.model.model.layers[0].mlp.gate.tid2eid.dtype == torch.long
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_deepseeks_original_checkpoint_is_refused():
    with pytest.raises(UnsupportedError, match="fp8 checkpoints"):
        deepseek4.hf_weights(
            {}, {**CONFIG, "quantization_config": {"quant_method": "fp8"}}, "m", object
        )


# ---- GGUF, as llama.cpp's converter writes it ---------------------------------------------

# transformers' key (under model.layers.N.) -> the converter's GGUF tensor (under blk.N.).
_GGUF_NAMES = {hf: gguf for gguf, hf in deepseek4._LAYER.items() if "{expert}" not in hf}
_GGUF_ROOT = {hf: gguf for gguf, hf in deepseek4._ROOT.items()}
# Kept in F32 by the converter (the checkpoint's f32 tensors) and by write_deepseek4.
_F32 = ("hc_", "_ape", "ffn_gate_inp", "attn_sinks")


def deepseek4_tensors(hf) -> dict[str, np.ndarray]:
    tensors = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if key in _GGUF_ROOT:
            tensors[_GGUF_ROOT[key]] = data
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key).groups()
        if rest == "mlp.experts.gate_up_proj":
            width = CONFIG["moe_intermediate_size"]
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :width]
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = data[:, width:]
        elif rest == "mlp.experts.down_proj":
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = data
        elif rest == "mlp.gate.tid2eid":
            tensors[f"blk.{layer}.ffn_gate_tid2eid.weight"] = data.astype(np.int32)
        else:
            tensors[f"blk.{layer}.{_GGUF_NAMES[rest]}"] = data
    return tensors


def deepseek4_keys(hf) -> dict:
    c = hf.config
    ratios = {"sliding_attention": 0, CSA: 4, HCA: 128}
    return {
        "general.architecture": "deepseek4",
        "{arch}.block_count": c.num_hidden_layers,
        "{arch}.context_length": c.max_position_embeddings,
        "{arch}.embedding_length": c.hidden_size,
        "{arch}.attention.head_count": c.num_attention_heads,
        "{arch}.attention.head_count_kv": 1,
        "{arch}.attention.key_length": c.head_dim,
        "{arch}.attention.value_length": c.head_dim,
        "{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "{arch}.rope.freq_base": c.rope_theta,
        "{arch}.rope.dimension_count": c.qk_rope_head_dim,
        "{arch}.rope.scaling.type": "yarn",
        "{arch}.rope.scaling.factor": 4.0,
        "{arch}.rope.scaling.original_context_length": 64,
        "{arch}.rope.scaling.yarn_beta_fast": 32.0,
        "{arch}.rope.scaling.yarn_beta_slow": 1.0,
        "{arch}.expert_count": c.n_routed_experts,
        "{arch}.expert_used_count": c.num_experts_per_tok,
        "{arch}.expert_gating_func": 4,
        "{arch}.attention.q_lora_rank": c.q_lora_rank,
        "{arch}.attention.sliding_window": c.sliding_window,
        "{arch}.expert_feed_forward_length": c.moe_intermediate_size,
        "{arch}.expert_shared_count": 1,
        "{arch}.expert_weights_scale": c.routed_scaling_factor,
        "{arch}.expert_weights_norm": True,
        "{arch}.swiglu_clamp_exp": [c.swiglu_limit] * c.num_hidden_layers,
        "{arch}.swiglu_clamp_shexp": [c.swiglu_limit] * c.num_hidden_layers,
        "{arch}.attention.indexer.head_count": c.index_n_heads,
        "{arch}.attention.indexer.key_length": c.index_head_dim,
        "{arch}.attention.indexer.top_k": c.index_topk,
        "{arch}.attention.output_group_count": c.o_groups,
        "{arch}.attention.output_lora_rank": c.o_lora_rank,
        "{arch}.attention.compress_ratios": [ratios[t] for t in c.layer_types],
        "{arch}.attention.compress_rope_freq_base": c.compress_rope_theta,
        "{arch}.hyper_connection.count": c.hc_mult,
        "{arch}.hyper_connection.sinkhorn_iterations": c.hc_sinkhorn_iters,
        "{arch}.hyper_connection.epsilon": c.hc_eps,
        "{arch}.hash_layer_count": 1,
        "{arch}.embedding_length_out": c.hidden_size * c.hc_mult,
    }


def write_deepseek4(path, hf, qtype=None, keys=None, extra=None, expert_qtype=None):
    """A deepseek4 GGUF of `hf`: the converter's keys (`keys` overriding; None leaves one
    out), stories260K's vocabulary, the tensors and `extra` ones (matrices but the f32
    ones in `qtype`, the expert stacks in `expert_qtype`, by default `qtype`).
    family_checks.write_keyed_gguf writes every tensor as floats; tid2eid is I32."""
    writer = gguf.GGUFWriter(str(path), "deepseek4")
    for key, value in {**deepseek4_keys(hf), **(keys or {})}.items():
        name = key.format(arch="deepseek4")
        if value is None or name == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, list) and isinstance(value[0], float):
            writer.add_array(name, [float(v) for v in value])
        elif isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_string(name, value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, data in {**deepseek4_tensors(hf), **(extra or {})}.items():
        if data.dtype == np.int32:
            writer.add_tensor(name, data)
        elif data.ndim == 1 or qtype is None or any(part in name for part in _F32):
            writer.add_tensor(name, data.astype(np.float32))
        else:
            stored = expert_qtype if expert_qtype is not None and "_exps" in name else qtype
            raw = gguf.quants.quantize(data, stored)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's heavily-compressed layers pool 128 tokens (it refuses any other ratio), so
# the GGUF tests run 136 tokens: the HCA layer's first window closes at 127.
GGUF_RATES = {CSA: 4, HCA: 128}
LONG_IDS = torch.randint(3, 512, (1, 136), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def hf128():
    return hf_model(compress_rates=GGUF_RATES)


def gguf_logits(model) -> torch.Tensor:
    return cached_logits(model, LONG_IDS, chunks=(7, 60, 61), capacity=160)


def test_a_gguf_matches_transformers(tmp_path, hf128):
    loaded = load_model(write_deepseek4(tmp_path / "m.gguf", hf128), torch.device("cpu"), "f32")
    config = loaded.checkpoint.config
    assert config["layer_types"] == CONFIG["layer_types"]
    assert config["compress_rates"] == GGUF_RATES
    assert max_diff(gguf_logits(loaded.model), reference(hf128, LONG_IDS)) < 1e-4


@pytest.mark.parametrize("expert_qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4])
def test_a_quantized_gguf_matches_transformers_on_the_rounded_weights(tmp_path, expert_qtype):
    """Q8_0 matrices (the converter's from FP8), experts in Q8_0 or MXFP4 (the
    converter's from the Hub's FP4)."""
    hf = hf_model(compress_rates=GGUF_RATES)
    path = write_deepseek4(
        tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0, expert_qtype=expert_qtype
    )
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert isinstance(loaded.model.model.layers[1].self_attn.q_b_proj, QuantLinear)
    # The converter's F32 tensors stay; every other matrix is rounded as Q8_0.
    with torch.no_grad():
        kept = {k: p.clone() for k, p in hf.named_parameters() if p.dim() == 2 and _kept(k)}
        dequantize_2d_weights(hf, GGMLQuantizationType.Q8_0)
        for k, p in hf.named_parameters():
            if k in kept:
                p.copy_(kept[k])
        # The stacked experts are 3-D: rounded per expert, as the GGUF holds them.
        for layer in hf.model.layers:
            for stack in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                for expert in stack:
                    expert.copy_(torch.from_numpy(rounded(expert.numpy(), expert_qtype)))
    assert max_diff(gguf_logits(loaded.model), reference(hf, LONG_IDS)) < 1e-4


def rounded(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)


def _kept(key: str) -> bool:
    return any(part in key for part in ("_hc.", "hc_head", "mlp.gate.weight", "position_bias"))


def test_a_vision_variants_image_routing_bias_is_left_out(tmp_path, hf128):
    """DeepSeek-V4-Flash-Vision's GGUF routes image tokens with exp_probs_b_vl; text
    tokens take exp_probs_b, as llama.cpp routes them."""
    extra = {f"blk.{i}.exp_probs_b_vl.bias": np.full(4, 5.0, np.float32) for i in range(4)}
    path = write_deepseek4(tmp_path / "m.gguf", hf128, extra=extra)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert max_diff(gguf_logits(loaded.model), reference(hf128, LONG_IDS)) < 1e-4


@pytest.mark.parametrize(
    "keys,error,match",
    [
        ({"{arch}.expert_gating_func": 2}, UnsupportedError, "sqrt"),
        ({"{arch}.expert_weights_norm": False}, UnsupportedError, "renormalizes"),
        ({"{arch}.attention.compress_ratios": [0, 4, 64, 4]}, UnsupportedError, "ratios"),
        ({"{arch}.attention.compress_ratios": [0, 4]}, ModelFormatError, "compress_ratios"),
        ({"{arch}.hyper_connection.count": None}, ModelFormatError, "hyper_connection"),
    ],
)
def test_a_deepseek4_gguf_it_cannot_run_is_refused(tmp_path, hf128, keys, error, match):
    path = write_deepseek4(tmp_path / "m.gguf", hf128, keys=keys)
    with pytest.raises(error, match=match):
        load_model(path, torch.device("cpu"), "f32")


def test_llmrun_run_and_show(tmp_path, hf128):
    check_run_and_show(hf128, write_deepseek4(tmp_path / "m.gguf", hf128), "deepseek")


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path, hf128):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together, padded on
    the right) on a Q8_0 file: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    path = write_deepseek4(tmp_path / "m.gguf", hf128, GGMLQuantizationType.Q8_0)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)

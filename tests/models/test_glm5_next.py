"""GLM-5-Next (llmrun/models/glm5_next.py) against transformers'
Glm5NextForConditionalGeneration (its language model; the vision tower is not run):
from the Hub's state dict (Kimi Linear's names for the KDA layers, one module per
expert, hc_attn_fn, ...), from folders as transformers saves them (text_config beside a
vision_config), and from "glm5-next" GGUFs written as llama.cpp's converter writes them
(write_glm5_next_gguf: conversion/glm.py Glm5NextModel, with every key
src/models/glm5-next.cpp requires).

The tiny model: KDA layers 0 and 3, indexed attention layers 1 (its own indexer) and 2
(sharing layer 1's choice), so the KV cache's layers are not the model's; a dense first
layer, then 8 sigmoid-routed experts with a random selection bias and a shared expert;
index_topk 8 of pools of 4, so from 12 positions on every query takes 2 of its pools
and its own incomplete one (chunked prefill and decode steps alike); hc_mult 4 streams
(llama.cpp's only count) with random hyper-connection scales; swiglu_limit 1.0, which clamps many of every
SwiGLU's inputs; A_log in -1..1 with the forget gate's lower bound -5. Each feature,
taken out of our model, moves the logits past 0.05 (test_each_feature_moves_the_logits).

Tolerances: 1e-4 on f32 logits within about ±3 against transformers (measured ~2e-5),
whole, through the KV cache and recurrent state (prefills in chunks, then one token at
a time), in padded batches, from serve's paged blocks (f16 blocks: 1e-2). A typed
(f16/bf16) KV cache: 1e-5 against an f32 cache that stores the rounded values, and
(f16) less than DRIFT from f32. The chunked delta rule against the per-token recurrence at
the lower bound's steepest decays: 1e-4. A Q8_0 GGUF against an F32 GGUF of the same
weights round-tripped through Q8_0: 1e-4.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from family_checks import (
    check_run_prints_greedy_tokens,
    check_show,
    max_diff,
    write_keyed_gguf,
)
from helpers import CHUNKS, cached_logits, randomize, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_saved_folder_loads,
    check_served_greedy_text,
    check_typed_cache_with_a_float32_state,
)
from test_kimi_linear import converted_layer_tensor, hub_names

from llmrun import api, models
from llmrun.errors import LlmrunError, ModelFormatError, UnsupportedError
from llmrun.loading import glm5_next as loading_glm5_next
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import deepseek_v4, glm5_next, kimi_linear
from llmrun.models.recurrent import RecurrentState
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
TEXT = dict(
    vocab_size=512,  # stories260K's tokenizer
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    swiglu_limit=1.0,
    linear_head_dim=16,
    linear_num_heads=4,
    linear_conv_kernel_dim=4,
    index_topk=8,
    index_head_dim=16,
    index_n_heads=8,  # ties of pools scoring 0 (every head's ReLU at 0) stay rare
    index_kpool=4,
    hc_mult=4,  # llama.cpp's glm5-next takes no other
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    out_hidden_size=64,
    intermediate_size=32,
    projection_intermediate_size=32,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# bf16's rounding of the cached indexer keys flips a pool the indexer takes at one
# position of IDS (the logits there move by ~2): the choice is discrete, so only the
# rounded f32 cache's logits bound a bf16 cache's.
DRIFT = {"f16": 1e-2, "bf16": float("inf")}
# The cache's rows: the latent, the indexer's key and its pool gate scores.
ROW = 32 + 2 * 16


def hf_model(**overrides):
    """Glm5NextForConditionalGeneration of TEXT (and `overrides`) with randomize()'s
    weights (the output matrix scaled down to keep logits within about ±3), decay rates
    A = exp(A_log) in 0.37 .. 2.7, hyper-connection scales in 0.5 .. 1.5 (randomize()'s
    N(0, 0.2) would flatten their mixes) and a random selection bias (a buffer)."""
    torch.manual_seed(0)
    config = transformers.Glm5NextConfig(text_config={**TEXT, **overrides}, vision_config=VISION)
    model = transformers.Glm5NextForConditionalGeneration(config).eval()
    randomize(model, {"lm_head.weight": 0.4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith(("hc.scale", "hc_scale")):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """transformers' language-model weights under llmrun's names (the Hub's but for the
    hyper-connections): Kimi Linear's renames (test_kimi_linear.hub_names)."""
    language = {
        key.replace("model.language_model.", "model."): value
        for key, value in hf.state_dict().items()
        if key.startswith(("model.language_model.", "lm_head."))
    }
    return hub_names(language)


def ours(hf) -> torch.nn.Module:
    model = glm5_next.Model(glm5_next.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(hub_state(hf), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


# ---- the model against transformers ---------------------------------------------------


def test_whole_chunked_and_decoded_match_transformers(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 2
    cache = model.new_cache(1, 8, torch.float32, "cpu")
    assert cache.k.shape == (2, 1, 1, 8, ROW)  # the indexed layers' rows, once
    assert cache.v is cache.k
    assert sorted(cache.recurrent.shapes) == [0, 3]
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Prefills of CHUNKS (one of them a single token), then decode steps.
    assert max_diff(cached_logits(model, IDS, CHUNKS), expected) < 1e-4
    # A short prefill, then every token decoded through the cache.
    assert max_diff(cached_logits(model, IDS, (3,)), expected) < 1e-4


def test_the_forget_gate_without_a_lower_bound_matches_transformers():
    """linear_lower_bound null: Kimi's -exp(A_log) * softplus(...) decay."""
    hf = hf_model(linear_lower_bound=None)
    model = ours(hf)
    assert model.model.layers[0].self_attn.lower_bound is None
    assert max_diff(cached_logits(model, IDS, (7, 9)), reference(hf)) < 1e-4


def test_chunked_delta_rule_at_the_steepest_decays_matches_the_recurrence():
    """Decays per key channel down to the lower bound (-5 a token, e^-160 over a chunk)
    in the chunked prefill form give the per-token recurrence's outputs and state."""
    gen = torch.Generator().manual_seed(2)
    b, h, t, dk, dv = 2, 3, 70, 8, 6
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    decay = -5 * torch.rand(b, h, t, dk, generator=gen)
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    out, final = kimi_linear.recurrent_kda(q, k, v, decay, beta, state)
    got, got_final = kimi_linear.chunked_kda(q, k, v, decay, beta, state)
    assert torch.isfinite(got).all()
    assert max_diff(got, out) < 1e-4 and max_diff(got_final, final) < 1e-4


def _forgetful(part: int):
    read = RecurrentState.read

    def forgetful(self, layer):
        parts = read(self, layer)
        parts[part] = torch.zeros_like(parts[part])
        return parts

    return forgetful


def _unmixed(spread):
    """deepseek_v4.spread with the streams' mix left out (comb the identity)."""

    def unmixed(streams, out, post, comb):
        eye = torch.eye(comb.shape[-1], dtype=comb.dtype).expand_as(comb)
        return spread(streams, out, post, eye)

    return unmixed


@pytest.mark.parametrize(
    "removed",
    [
        "conv state",
        "delta state",
        "lower bound",
        "indexer",
        "shared choice",
        "pool position bias",
        "streams' mix",
        "swiglu clamp",
        "selection bias",
    ],
)
def test_each_feature_moves_the_logits(removed, monkeypatch, family):
    """Without each feature (the states a cache carries between forwards, the forget
    gate's lower bound, the indexer's choice of pools, the shared layer's reuse of it,
    the pools' position bias, the hyper-connections' mix of the streams, the SwiGLU
    clamp, the routers' selection bias) the cached logits move from transformers' by
    far more than the tolerance."""
    hf, expected = family
    model = ours(hf)
    attention = [model.model.layers[i].self_attn for i in (1, 2)]
    if removed in ("conv state", "delta state"):
        monkeypatch.setattr(RecurrentState, "read", _forgetful(0 if removed == "conv state" else 1))
    elif removed == "lower bound":
        for i in (0, 3):
            model.model.layers[i].self_attn.lower_bound = None
    elif removed == "indexer":
        for layer in attention:
            layer.topk = SEQ
    elif removed == "shared choice":
        attention[1].topk = SEQ
    elif removed == "pool position bias":
        attention[0].indexer.index_kpool_compress_ape.data.zero_()
    elif removed == "streams' mix":
        monkeypatch.setattr(deepseek_v4, "spread", _unmixed(deepseek_v4.spread))
    elif removed == "swiglu clamp":
        for module in model.modules():
            if isinstance(module, deepseek_v4.Expert):
                module.limit = float("inf")
    else:
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.data.zero_()
    assert max_diff(cached_logits(model, IDS, (7, 9)), expected) > 0.05


def test_padded_rows_of_a_batch_keep_their_own_state(family):
    """Rows padded on the right as the server pads them, prefilled together and decoded
    together, in the cache's first rows and in scattered ones: each row's logits are
    transformers' for it alone."""
    hf, _ = family
    model = ours(hf)
    check_padded_rows_decoded_together(model, lambda ids: reference(hf, ids), IDS)
    check_padded_rows_in_scattered_slots(model, lambda ids: reference(hf, ids), IDS)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_serves_from_paged_blocks(family, cache_type):
    """serve's paged KV blocks (shuffled) with the scheduler's recurrent state rows: a
    sequence prefilled in chunks that end inside blocks, then decoded."""
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected, cache_type=cache_type)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The indexed layers' rows rounded to the type; the recurrent state stays float32."""
    hf, expected = family
    check_typed_cache_with_a_float32_state(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_or_native_decode_step(family):
    """CUDA graphs' static step keeps no recurrent state, and the native decode step
    does not know the family: neither is offered."""
    model = ours(family[0])
    check_no_static_decode(model)
    assert "glm5_next" not in decode_step.FAMILIES
    assert model.decode_step is None


# ---- configs and Hugging Face folders ------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """A folder as transformers 5 saves the multimodal model: text_config, the Hub's
    names (hc_attn_fn, q_conv1d, A_log on self_attn, per-expert weights) and the vision
    tower, which is left out."""
    hf, expected = family
    check_saved_folder_loads(hf, tmp_path / "hf", IDS, expected)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for form in (config, config["text_config"]):  # show's count is the model's
        assert inspect.kv_cache_bytes(form, 8192) == 8192 * 2 * ROW * 4
        assert models.kv_cache_bytes(form, 8192) == 8192 * 2 * ROW * 4


def test_config_defaults_are_transformers():
    """Layer kinds, dense layers and indexer kinds where a config gives none, and the
    Hub's linear_attn_config form."""
    config = transformers.Glm5NextTextConfig(num_hidden_layers=8, index_topk_freq=2)
    args = glm5_next.ModelArgs.from_config(
        {"model_type": "glm5_next_text", "num_hidden_layers": 8, "index_topk_freq": 2}
    )
    assert args.layer_types == config.layer_types
    assert args.mlp_layer_types == config.mlp_layer_types
    assert args.indexer_types == config.indexer_types
    linear = dict(head_dim=32, num_heads=8, short_conv_kernel_size=3, gate_lower_bound=-4.0)
    args = glm5_next.ModelArgs.from_config({**TEXT, "linear_attn_config": linear})
    assert (args.linear_head_dim, args.linear_num_heads) == (32, 8)
    assert (args.linear_conv_kernel_dim, args.linear_lower_bound) == (3, -4.0)
    assert loading_glm5_next.MODEL_TYPES == glm5_next.MODEL_TYPES  # the torch-free copy


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("qk_rope_head_dim", 8, UnsupportedError, "qk_rope_head_dim"),
        ("q_lora_rank", None, UnsupportedError, "q_lora_rank"),
        ("index_kpool_always_select_tail", False, UnsupportedError, "select_tail"),
        ("index_topk", 10, ModelFormatError, "multiple of index_kpool"),
        ("indexer_types", ["full", "shared", "full", "full"], ModelFormatError, "layer 1"),
        (
            "layer_types",
            ["linear_attention"] * 3 + ["sliding_attention"],
            ModelFormatError,
            "sliding",
        ),
    ],
)
def test_configs_llmrun_cannot_run_are_refused(field, value, error, message):
    """RoPE in the attention, no queries' latent, pools without their tail, a top-k
    that is not whole pools, a shared indexer layer with no full one right before it, a
    layer kind the family has not."""
    with pytest.raises(error, match=message):
        glm5_next.ModelArgs.from_config({**TEXT, field: value})
    assert issubclass(error, LlmrunError)


# ---- end to end ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    """The tiny model saved with stories260K's tokenizer files."""
    return save_hf_dir(family[0], tmp_path_factory.mktemp("glm5_next") / "hf", tokenizer=True)


def test_llmrun_run_prints_transformers_greedy_text(family, folder):
    check_run_prints_greedy_tokens(family[0], folder, tokens=16)


def test_serve_gives_concurrent_requests_transformers_greedy_text(family, folder):
    """serve's scheduler: three prompts of different lengths decoded together, each
    given the text transformers' greedy search gives it alone."""
    engine = api.load(str(folder), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The cat", "One day, a little girl named Lily went"]
    check_served_greedy_text(engine, family[0], folder, prompts, parallel=3)


# ---- GGUF files ----------------------------------------------------------------------

# The text model's module -> its GGUF tensor (llama.cpp's tensor_mapping for glm5-next).
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.forget_gate.f_a_proj": "ssm_f_a",
    "self_attn.forget_gate.f_b_proj": "ssm_f_b",
    "self_attn.b_proj": "ssm_beta",
    "self_attn.g_a_proj": "ssm_g_a",
    "self_attn.g_b_proj": "ssm_g_b",
    "self_attn.o_norm": "ssm_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.indexer.wq_b": "indexer.attn_q_b",
    "self_attn.indexer.wk": "indexer.attn_k",
    "self_attn.indexer.k_norm": "indexer.k_norm",
    "self_attn.indexer.weights_proj": "indexer.proj",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# Written as `name + ".weight"` (Glm5NextModel.modify_tensors), and kept in F32.
EXACT = {
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate",
    "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape",
}


def converted_tensors(hf) -> dict[str, np.ndarray]:
    """The language model's tensors under GGUF names, as llama.cpp's converter
    transforms them: each KDA convolution [1, channels, 1, kernel], A_log as -exp(A_log),
    dt_bias as ssm_dt.bias, kv_b_proj split per head into attn_k_b (transposed) and
    attn_v_b, experts stacked, the selection bias as exp_probs_b.bias."""
    c = hf.config.text_config
    roots = {
        "model.language_model.embed_tokens.weight": "token_embd.weight",
        "model.language_model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    out = {}
    for key, tensor in hf.state_dict().items():
        x = tensor.float().numpy().copy()
        if key in roots:
            out[roots[key]] = x
            continue
        if not key.startswith("model.language_model.layers."):
            continue  # the vision tower: the mmproj file's
        _, _, _, layer, rest = key.split(".", 4)
        blk = f"blk.{layer}"
        if converted_layer_tensor(out, blk, rest, x, c):
            continue
        if rest == "self_attn.forget_gate.A_log":
            out[f"{blk}.ssm_a"] = -np.exp(x)
        elif rest in EXACT:
            out[f"{blk}.{EXACT[rest]}.weight"] = x
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"{blk}.{GGUF_NAMES[module]}.{suffix}"] = x
    return out


def write_glm5_next_gguf(path, hf, qtype=None, round_trip=None, **override) -> str:
    """The model as llama.cpp's converter writes GLM-5-Next (Glm5NextModel): TextModel's
    keys and its own (head_count_kv 0 for a KDA layer, 1 for an indexed one; the KDA,
    MLA, indexer, hyper-connection and expert keys; the SwiGLU clamp per layer), the
    tensors converted (converted_tensors), matrices in `qtype` but the routers and the
    small exact ones (hyper-connections, pool gate and position bias), or F32 rounded
    through `round_trip`. `override`: metadata keys (without the arch) to write
    instead, None to leave one out."""
    c = hf.config.text_config
    layers = c.num_hidden_layers
    meta = {
        "block_count": layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": [int(t != "linear_attention") for t in c.layer_types],
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "attention.layer_norm_epsilon": 1e-6,
        "expert_count": c.n_routed_experts,
        "expert_used_count": c.num_experts_per_tok,
        "vocab_size": c.vocab_size,
        "ssm.conv_kernel": c.linear_conv_kernel_dim,
        "kda.head_dim": c.linear_head_dim,
        "kda.gate_lower_bound": c.linear_lower_bound,
        "attention.q_lora_rank": c.q_lora_rank,
        "attention.kv_lora_rank": c.kv_lora_rank,
        "rope.dimension_count": 0,
        "attention.key_length": c.kv_lora_rank,
        "attention.value_length": c.kv_lora_rank,
        "attention.key_length_mla": c.qk_nope_head_dim,
        "attention.value_length_mla": c.v_head_dim,
        "attention.indexer.head_count": c.index_n_heads,
        "attention.indexer.key_length": c.index_head_dim,
        "attention.indexer.top_k": c.index_topk,
        "attention.indexer.kpool": c.index_kpool,
        "attention.indexer.kpool_select_tail": c.index_kpool_always_select_tail,
        "attention.indexer.types": [t == "full" for t in c.indexer_types],
        "hyper_connection.count": c.hc_mult,
        "hyper_connection.sinkhorn_iterations": c.hc_sinkhorn_iters,
        "hyper_connection.epsilon": c.hc_eps,
        "leading_dense_block_count": c.mlp_layer_types.count("dense"),
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_count": c.n_shared_experts,
        "expert_weights_scale": c.routed_scaling_factor,
        "expert_weights_norm": c.norm_topk_prob,
        "swiglu_clamp_exp": [float(c.swiglu_limit)] * layers,
        "swiglu_clamp_shexp": [float(c.swiglu_limit)] * layers,
    }
    meta.update(override)
    tensors = {}
    for name, x in converted_tensors(hf).items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        exact = any(part in name for part in ("hc_", "indexer_compressor_", "ffn_gate_inp"))
        if round_trip is not None and x.ndim in (2, 3) and x.shape[-1] % 32 == 0 and not exact:
            rounded = gguf.quants.dequantize(gguf.quants.quantize(x, round_trip), round_trip)
            x = rounded.reshape(x.shape)
        tensors[name] = x
    keys = {f"{{arch}}.{name}": value for name, value in meta.items()}
    keep = ("hc_", "indexer_compressor_")
    return write_keyed_gguf(path, "glm5-next", keys, tensors, qtype, True, keep)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_glm5_next_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "glm5_next_text"
    assert config["layer_types"] == TEXT["layer_types"]
    assert config["indexer_types"] == TEXT["indexer_types"]
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_holds_its_dequantized_weights(family, tmp_path):
    hf, expected = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = load_model(write_glm5_next_gguf(tmp_path / "q.gguf", hf, qtype=q8), CPU, "f32")
    exact = load_model(write_glm5_next_gguf(tmp_path / "r.gguf", hf, round_trip=q8), CPU, "f32")
    weights = quantized.checkpoint.weights
    assert weights["model.layers.0.self_attn.q_proj.weight"].ggml_type == q8
    got = cached_logits(quantized.model, IDS)
    assert max_diff(got, cached_logits(exact.model, IDS)) < 1e-4
    assert max_diff(got, expected) > 0  # the rounding shows


def test_a_gguf_without_a_lower_bound_or_clamp_reads_llama_cpps_defaults(tmp_path):
    """No kda.gate_lower_bound: Kimi's unbounded decay; no swiglu_clamp_*: no clamp (a
    model whose limit is past every input: transformers' logits all the same)."""
    hf = hf_model(linear_lower_bound=None, swiglu_limit=1e6)
    path = write_glm5_next_gguf(
        tmp_path / "m.gguf", hf, swiglu_clamp_exp=None, swiglu_clamp_shexp=None,
        **{"kda.gate_lower_bound": None},
    )  # fmt: skip
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["linear_lower_bound"] is None
    assert loaded.checkpoint.config["swiglu_limit"] == float("inf")
    assert max_diff(cached_logits(loaded.model, IDS, (7, 9)), reference(hf)) < 1e-4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"rope.dimension_count": 16}, "no RoPE"),
        ({"attention.indexer.kpool_select_tail": False}, "kpool_select_tail"),
        ({"attention.indexer.kpool": None}, "indexer.kpool"),
        ({"hyper_connection.count": None}, "hyper_connection.count"),
        ({"attention.layer_norm_epsilon": 1e-5}, "layer_norm_epsilon"),
        ({"swiglu_clamp_shexp": [2.0] * 4}, "clamps differ"),
    ],
)
def test_files_llmrun_cannot_run_are_refused(family, tmp_path, override, message):
    path = write_glm5_next_gguf(tmp_path / "m.gguf", family[0], **override)
    with pytest.raises(LlmrunError, match=message):
        load_model(path, CPU, "f32")


def test_llmrun_run_and_show_on_a_gguf(family, tmp_path):
    """`llmrun run` on the GGUF prints transformers' greedy text; `llmrun show` names
    the arch and counts the two indexed layers' rows."""
    hf, _ = family
    path = write_glm5_next_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path, tokens=16)
    check_show(path, "glm5-next", 8192 * 2 * ROW * 4, moe=True)

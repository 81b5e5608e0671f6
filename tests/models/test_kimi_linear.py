"""Kimi Linear against transformers' KimiLinearForCausalLM: from state dicts under the
Hub's names, from config.json folders (as transformers 5 saves them, and Moonshot's form
with linear_attn_config's 1-based layer lists), and from "kimi-linear" GGUFs written as
llama.cpp's converter writes them (conversion/kimi_linear.py: each KDA convolution
reshaped to [1, channels, 1, kernel], A_log as -exp(A_log), dt_bias as ssm_dt.bias,
kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, head_count_kv 0 for a
KDA layer and 1 for an MLA one, experts stacked, e_score_correction_bias as
exp_probs_b.bias).

The tiny model: KDA layers 0 and 2, MLA layers 1 and 3 (so the KV cache's layers are
not the model's), a dense first layer, 8 sigmoid-routed experts with a random selection
bias and a shared expert; decays slow enough (A = exp(A_log) in 0.02 .. 0.37) that the
state carries tokens far, and decays that differ per channel. Each feature's removal is
checked to move the logits (test_each_feature_moves_the_logits).

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers, whole,
through the KV cache and recurrent state (prefills in chunks, then one token at a
time), in padded batches and from serve's paged blocks. The chunked KDA rule against
the per-token recurrence: 1e-5 (1e-4, and finite, where a chunk decays by e^-2000). A Q8_0
GGUF against an F32 GGUF of the same weights round-tripped through Q8_0: 1e-4. A typed
(f16/bf16) KV cache: 1e-5 against an f32 cache that stores the rounded values, and less
than DRIFT from f32.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from family_checks import check_run_and_show, max_diff, write_keyed_gguf
from helpers import CHUNKS, cached_logits, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_paged_with_a_state_row,
    check_saved_folder_loads,
    check_served_greedy_text,
    check_typed_cache_with_a_float32_state,
)

from llmrun import api, models
from llmrun.errors import LlmrunError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import deepseek_v2, kimi_linear
from llmrun.models.base import GatedMLP
from llmrun.models.recurrent import RecurrentState

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="kimi_linear",
    vocab_size=512,  # stories260K's tokenizer
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.446,
    linear_head_dim=16,
    linear_num_heads=4,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A transformers model of CONFIG with randomize()'s weights (the output matrix
    scaled down to keep logits within about ±5), slow decays and a random selection
    bias (a buffer, which randomize() leaves at 0)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"lm_head.weight": 0.4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """transformers' weights under llmrun's names (the Hub's, experts as DeepSeek's)."""
    return hub_names(hf.state_dict())


def hub_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict under llmrun's names: the fused convolution split into
    q, k and v, the forget gate's weights on the layer, the stacked experts split per
    expert (GLM-5-Next's test takes it too)."""
    out = {}
    for key, value in state.items():
        head, sep, tail = key.partition(".mlp.experts.")
        if sep and tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}{sep}{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}{sep}{e}.up_proj.weight"] = value[e, width:]
        elif sep and tail == "down_proj":
            for e in range(value.shape[0]):
                out[f"{head}{sep}{e}.down_proj.weight"] = value[e]
        elif key.endswith("self_attn.conv1d.weight"):
            base = key.removesuffix("conv1d.weight")
            for name, part in zip("qkv", value.chunk(3), strict=True):
                out[f"{base}{name}_conv1d.weight"] = part
        else:
            out[key.replace(".forget_gate.", ".")] = value
    return out


def ours(hf) -> torch.nn.Module:
    model = kimi_linear.Model(kimi_linear.ModelArgs.from_config(hf.config.to_dict()))
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
    assert cache.k.shape == (2, 1, 1, 8, 32 + 16)  # the MLA layers' latents, once
    assert cache.v is cache.k
    assert isinstance(model.model.layers[0].mlp, GatedMLP)  # mlp_layer_types' dense layer
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Prefills of CHUNKS (one of them a single token), then decode steps.
    assert max_diff(cached_logits(model, IDS, CHUNKS), expected) < 1e-4
    # A short prefill, then every token decoded through the cache.
    assert max_diff(cached_logits(model, IDS, (3,)), expected) < 1e-4


def test_chunked_kda_matches_the_recurrence():
    """The chunked prefill form (several chunks, a partial last one, a state to start
    from) gives the per-token recurrence's outputs and final state, with decays that
    differ per key channel; and stays finite where a chunk decays by far more than a
    float's range (its pairwise decays are never formed as exp(G_i) exp(-G_j))."""
    gen = torch.Generator().manual_seed(2)
    b, h, t, dk, dv = 2, 3, 150, 8, 6
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    decay = -torch.rand(b, h, t, dk, generator=gen) * 0.3
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    out, final = kimi_linear.recurrent_kda(q, k, v, decay, beta, state)
    for chunk in (32, 16, 64):
        got, got_final = kimi_linear.chunked_kda(q, k, v, decay, beta, state, chunk)
        assert max_diff(got, out) < 1e-5 and max_diff(got_final, final) < 1e-5
    assert out.abs().max() > 1
    steep = decay * 400  # a chunk of 32 decays some channels by e^-2000
    out, final = kimi_linear.recurrent_kda(q, k, v, steep, beta, state)
    got, got_final = kimi_linear.chunked_kda(q, k, v, steep, beta, state)
    assert torch.isfinite(got).all() and max_diff(got, out) < 1e-4
    assert max_diff(got_final, final) < 1e-4


def _forgetful(part: int):
    read = RecurrentState.read

    def forgetful(self, layer):
        parts = read(self, layer)
        parts[part] = torch.zeros_like(parts[part])
        return parts

    return forgetful


def _per_head(rule):
    """A KDA rule given each head's mean decay on every channel: a scalar decay per head."""

    def scalar(q, k, v, decay, beta, state, *rest):
        return rule(q, k, v, decay.mean(-1, keepdim=True).expand_as(decay), beta, state, *rest)

    return scalar


def _silu_gated(self, x, gate):
    """Qwen3.5's gate (SiLU) in place of Kimi's sigmoid."""
    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=self.eps)
    return self.weight * normed * torch.nn.functional.silu(gate)


@pytest.mark.parametrize(
    "removed",
    [
        "conv state",
        "delta state",
        "per-channel decay",
        "l2 norm",
        "sigmoid output gate",
        "nope",
        "selection bias",
        "shared experts",
    ],
)
def test_each_feature_moves_the_logits(removed, monkeypatch, family):
    """Without each feature (the states a cache carries between forwards, the decay per
    key channel, the L2 norm of queries and keys, the output gate's sigmoid, MLA without RoPE, the routers' selection
    bias, the shared experts) the cached logits move from transformers' by far more
    than the tolerance."""
    hf, expected = family
    model = ours(hf)
    if removed in ("conv state", "delta state"):
        monkeypatch.setattr(RecurrentState, "read", _forgetful(0 if removed == "conv state" else 1))
    elif removed == "per-channel decay":
        monkeypatch.setattr(kimi_linear, "chunked_kda", _per_head(kimi_linear.chunked_kda))
        monkeypatch.setattr(kimi_linear, "recurrent_kda", _per_head(kimi_linear.recurrent_kda))
    elif removed == "l2 norm":
        monkeypatch.setattr(kimi_linear, "l2_normalize", lambda x: x)
    elif removed == "sigmoid output gate":
        monkeypatch.setattr(kimi_linear.GatedRMSNorm, "forward", _silu_gated)
    elif removed == "nope":
        monkeypatch.setattr(kimi_linear.LatentAttention, "rotate", deepseek_v2.Attention.rotate)
    elif removed == "selection bias":
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.data.zero_()
    else:
        for layer in model.model.layers[1:]:
            layer.mlp.shared_experts = None
    assert max_diff(cached_logits(model, IDS, (7, 9)), expected) > 0.05


def test_padded_rows_of_a_batch_keep_their_own_state(family):
    """Rows of 12, 7 and 10 tokens prefilled together, padded on the right as the server
    pads them (a padded token repeats its row's last position), then decoded together:
    each row's logits are transformers' for it alone."""
    hf, _ = family
    check_padded_rows_decoded_together(ours(hf), lambda ids: reference(hf, ids), IDS)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_serves_from_paged_blocks(family, cache_type):
    """serve's paged KV blocks (shuffled) with the scheduler's recurrent state rows: a
    sequence prefilled in chunks that end inside blocks, then decoded."""
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected, cache_type=cache_type)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The MLA layers' latents rounded to the type; the recurrent state stays float32."""
    hf, expected = family
    check_typed_cache_with_a_float32_state(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_decode_step(family):
    """CUDA graphs' static step keeps no recurrent state: it is not offered."""
    check_no_static_decode(ours(family[0]))


# ---- Hugging Face folders ------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """A folder as transformers 5 saves it: the Hub's names (block_sparse_moe, experts'
    w1/w2/w3, q/k/v_conv1d), and Moonshot's config.json form (linear_attn_config with
    1-based layer lists, first_k_dense_replace) alike."""
    hf, expected = family
    check_saved_folder_loads(hf, tmp_path / "hf", IDS, expected)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads"):
        del config[key]
    config.update(
        first_k_dense_replace=1,
        mla_use_nope=True,
        moe_router_activation_func="sigmoid",
        linear_attn_config=dict(
            full_attn_layers=[2, 4], kda_layers=[1, 3], head_dim=16, num_heads=4,
            short_conv_kernel_size=4,
        ),
    )  # fmt: skip
    path.write_text(json.dumps(config))
    moonshot = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(moonshot.model, IDS), expected) < 1e-4
    for form in (config, hf.config.to_dict()):  # show's count is the model's
        assert inspect.kv_cache_bytes(form, 8192) == 8192 * 2 * (32 + 16) * 4
        assert models.kv_cache_bytes(form, 8192) == 8192 * 2 * (32 + 16) * 4


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mla_use_nope", False, "mla_use_nope"),
        ("moe_router_activation_func", "softmax", "softmax"),
        ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"], "sliding_attention"),
    ],
)
def test_configs_llmrun_cannot_run_are_refused(field, value, message):
    """MLA with RoPE, another router, a layer kind the family has not."""
    with pytest.raises(UnsupportedError, match=message):
        kimi_linear.ModelArgs.from_config({**CONFIG, field: value})


def test_rope_settings_do_not_scale_the_attention():
    """The MLA layers take no RoPE, so a config's YaRN settings leave the softmax scale
    qk_head_dim^-0.5 (transformers' Kimi Linear ignores them too)."""
    yarn = dict(type="yarn", factor=4.0, mscale_all_dim=1.0, original_max_position_embeddings=64)
    args = kimi_linear.ModelArgs.from_config({**CONFIG, "rope_scaling": yarn})
    assert args.softmax_scale == (16 + 16) ** -0.5


# ---- llama.cpp's GGUFs ---------------------------------------------------------------


def converted_tensors(hf) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, as llama.cpp's converter transforms them."""
    c = hf.config
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.f_a_proj": "ssm_f_a",
        "self_attn.f_b_proj": "ssm_f_b",
        "self_attn.b_proj": "ssm_beta",
        "self_attn.g_a_proj": "ssm_g_a",
        "self_attn.g_b_proj": "ssm_g_b",
        "self_attn.o_norm": "ssm_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    out = {}
    for key, tensor in hf.state_dict().items():
        x = tensor.float().numpy().copy()
        if key in globals_:
            out[globals_[key]] = x
            continue
        _, _, layer, rest = key.split(".", 3)
        blk = f"blk.{layer}"
        if converted_layer_tensor(out, blk, rest, x, c):
            continue
        if rest == "self_attn.forget_gate.A_log":
            out[f"{blk}.ssm_a"] = -np.exp(x)
        else:
            module = rest.removesuffix(".weight").replace("forget_gate.", "")
            out[f"{blk}.{names[module]}.weight"] = x
    return out


def converted_layer_tensor(out: dict, blk: str, rest: str, x: np.ndarray, c) -> bool:
    """Puts the tensor `x` of layer `blk` (`rest`: its name in the layer) into `out` as
    llama.cpp's converter writes it alike for Kimi Linear, Ling 3 and GLM-5-Next (config
    `c`): each KDA convolution [1, channels, 1, kernel], dt_bias as ssm_dt.bias, kv_b_proj
    split per head into attn_k_b (transposed) and attn_v_b, the selection bias as
    exp_probs_b.bias, experts stacked. False for a tensor it leaves to the family."""
    if rest == "self_attn.conv1d.weight":
        for name, part in zip("qkv", np.split(x, 3), strict=True):
            out[f"{blk}.ssm_conv1d_{name}.weight"] = part.reshape(1, -1, 1, part.shape[-1])
    elif rest == "self_attn.forget_gate.dt_bias":
        out[f"{blk}.ssm_dt.bias"] = x
    elif rest == "self_attn.kv_b_proj.weight":
        per_head = x.reshape(c.num_attention_heads, -1, c.kv_lora_rank)
        k_b, v_b = np.split(per_head, [c.qk_nope_head_dim], axis=1)
        out[f"{blk}.attn_k_b.weight"] = np.ascontiguousarray(k_b.transpose(0, 2, 1))
        out[f"{blk}.attn_v_b.weight"] = np.ascontiguousarray(v_b)
    elif rest == "mlp.gate.e_score_correction_bias":
        out[f"{blk}.exp_probs_b.bias"] = x
    elif rest == "mlp.experts.gate_up_proj":
        width = x.shape[1] // 2
        out[f"{blk}.ffn_gate_exps.weight"] = np.ascontiguousarray(x[:, :width])
        out[f"{blk}.ffn_up_exps.weight"] = np.ascontiguousarray(x[:, width:])
    elif rest == "mlp.experts.down_proj":
        out[f"{blk}.ffn_down_exps.weight"] = x
    else:
        return False
    return True


def converter_quantizes(name: str, x: np.ndarray) -> bool:
    """Whether the converter writes a tensor in the file's quantized type: matrices and
    expert stacks of whole blocks, but the routers (kept F32)."""
    return x.ndim in (2, 3) and x.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name


def write_kimi_gguf(path, hf, qtype=None, round_trip=None, extra=None, **override) -> str:
    """The model as llama.cpp's converter writes Kimi Linear: TextModel's keys and
    KimiLinearModel's (head_count_kv per layer, the KDA and MLA sizes, the experts'),
    the tensors converted (converted_tensors), matrices in `qtype`, or F32 rounded
    through `round_trip`; `extra`: more tensors. `override`: metadata keys (without the
    arch) to write instead, None to leave one out."""
    c = hf.config
    arch = "kimi-linear"
    meta = {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": [int(t == "full_attention") for t in c.layer_types],
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "expert_count": c.num_local_experts,
        "expert_used_count": c.num_experts_per_tok,
        "expert_group_used_count": 1,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "vocab_size": c.vocab_size,
        "ssm.conv_kernel": c.linear_conv_kernel_dim,
        "kda.head_dim": c.linear_head_dim,
        "attention.kv_lora_rank": c.kv_lora_rank,
        "rope.dimension_count": c.qk_rope_head_dim,
        "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim,
        "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
        "attention.value_length_mla": c.v_head_dim,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_count": c.n_shared_experts,
        "leading_dense_block_count": c.mlp_layer_types.count("dense"),
        "expert_weights_scale": c.routed_scaling_factor,
        "rope.freq_base": 10000.0,
    }
    meta.update(override)
    tensors = {}
    for name, x in {**converted_tensors(hf), **(extra or {})}.items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        if round_trip is not None and converter_quantizes(name, x):
            rounded = gguf.quants.dequantize(gguf.quants.quantize(x, round_trip), round_trip)
            x = rounded.reshape(x.shape)
        tensors[name] = x
    keys = {f"{{arch}}.{name}": value for name, value in meta.items()}
    return write_keyed_gguf(path, arch, keys, tensors, qtype, whole_blocks=True)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_kimi_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "kimi_linear" and config["layer_types"] == CONFIG["layer_types"]
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_holds_its_dequantized_weights(family, tmp_path):
    hf, expected = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = load_model(write_kimi_gguf(tmp_path / "q.gguf", hf, qtype=q8), CPU, "f32")
    exact = load_model(write_kimi_gguf(tmp_path / "r.gguf", hf, round_trip=q8), CPU, "f32")
    assert quantized.checkpoint.weights["model.layers.0.self_attn.q_proj.weight"].ggml_type == q8
    got = cached_logits(quantized.model, IDS)
    assert max_diff(got, cached_logits(exact.model, IDS)) < 1e-4
    assert max_diff(got, expected) > 0  # the rounding shows


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"expert_gating_func": int(gguf.ExpertGatingFuncType.SOFTMAX)}, "gated by sigmoid"),
        ({"kda.head_dim": None}, "kda.head_dim"),
        ({"attention.head_count_kv": [0, 1, 0]}, "lists 3 layers"),
    ],
)
def test_files_llmrun_cannot_run_are_refused(family, tmp_path, override, message):
    path = write_kimi_gguf(tmp_path / "m.gguf", family[0], **override)
    with pytest.raises(LlmrunError, match=message):
        load_model(path, CPU, "f32")


def test_compressed_queries_in_a_gguf_are_refused(family, tmp_path):
    """llama.cpp's kimi-linear reads no q_lora_rank: a file with attn_q_a is refused."""
    extra = {"blk.1.attn_q_a.weight": np.zeros((32, 64), np.float32)}
    path = write_kimi_gguf(tmp_path / "m.gguf", family[0], extra=extra)
    with pytest.raises(UnsupportedError, match="attn_q_a"):
        load_model(path, CPU, "f32")


def test_llmrun_run_and_show(family, tmp_path):
    hf, _ = family
    path = write_kimi_gguf(tmp_path / "kimi.gguf", hf)
    check_run_and_show(hf, path, "kimi-linear")
    info = inspect.describe(path)
    # The two MLA layers' latents, stored once: kv_lora_rank + qk_rope_head_dim, f32.
    assert info["kv_cache_bytes_8k"] == 8192 * 2 * (32 + 16) * 4
    assert 0 < info["active_parameters"] < info["parameters"]


def test_serve_gives_concurrent_requests_transformers_greedy_text(family, tmp_path):
    """serve's scheduler: three prompts of different lengths decoded together, each
    given the text transformers' greedy search gives it alone."""
    hf, _ = family
    path = write_kimi_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The cat", "One day, a little girl named Lily went"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)

"""Granite 4.0-H (granitemoehybrid) against transformers' GraniteMoeHybridForCausalLM,
from a config.json and from "granitehybrid" GGUFs written as llama.cpp's converter
writes them (conversion/granite.py GraniteHybridModel over mamba.py Mamba2Model:
head_count_kv per layer, 0 for a Mamba-2 layer; A_log stored as -exp(A_log) [heads, 1];
D [heads, 1]; the convolution squeezed to [channels, d_conv]; the gated norm's weight
as [n_groups, inner / n_groups]; dt_bias as ssm_dt.bias; Llama's permuted q/k; the
experts' fused gate/up rows split and stacked, the shared expert as ffn_*_shexp, or as
ffn_gate/up/down without experts; rope.scaling.finetuned false for the hybrids, which
have no RoPE).

The tiny models: 4 layers (Mamba-2, attention, Mamba-2, Mamba-2), 8 Mamba heads of 16 in
2 groups of B/C with a state of 16, a kernel of 4; with 4 experts (top 2) and a shared
expert, or dense; RoPE or none; every muP multiplier away from 1.

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers: whole,
through the cache (prefills in chunks, then one token at a time), rows of different
lengths padded on the right in scattered cache rows, serve's paged blocks. The chunked
SSD against the one-token recurrence: 1e-4 on outputs and states. A Q8_0 GGUF (its
projections Q8_0, the small Mamba-2 tensors F32 as llama.cpp keeps them) against
transformers on the dequantized weights: 1e-4. An f16 or bf16 KV cache: 1e-5 against
an f32 cache holding the rounded values, drifting from f32 by less than DRIFT.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    PROMPT,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_weights_ending,
    max_diff,
)
from helpers import BASE, STORIES_GGUF, _permute, cached_logits, our_model, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_saved_folder_loads,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import granitehybrid, inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import Weight, load_model
from llmrun.models import kv_cache_bytes, recurrent_state_bytes
from llmrun.models.granitemoehybrid import ssd_chunked, ssd_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
HYBRID = dict(
    BASE,
    model_type="granitemoehybrid",
    num_hidden_layers=4,
    intermediate_size=32,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=64,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=1.5,
    position_embedding_type=None,
)
VARIANTS = {
    "moe-nope": {},
    "moe-rope": dict(position_embedding_type="rope", rope_theta=10000.0),
    # As the released dense hybrids: the shared expert as wide as intermediate_size, which
    # llama.cpp reads as its width (feed_forward_length).
    "dense": dict(num_local_experts=0, intermediate_size=64),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 2e-3 to 3e-3, bf16 1.7e-2 to 0.16 (a
# router that picks another expert for a token moves its logits by more than rounding).
DRIFT = {"f16": 1e-2, "bf16": 0.3}


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**HYBRID, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    """llmrun's model of `hf` from its config and state dict, the feed-forward renamed
    as the loader renames a Hub checkpoint's."""
    config = hf.config.to_dict()
    weights = {k: Weight(v) for k, v in hf.state_dict().items()}
    state = {k: w.tensor for k, w in granitehybrid.hf_weights(weights, config, Weight).items()}
    return our_model(config, state)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.A_log": "ssm_a",
    "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
    "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
}
# What llama.cpp quantizes: the projections and the experts' stacks, not the small Mamba-2
# tensors (nor, here, the embeddings); and those matrices' transformers names.
_QUANTIZABLE = ("attn_q", "attn_k", "attn_v", "attn_output", "ssm_in", "ssm_out", "ffn_")
_QUANTIZED = (
    "_proj.weight",  # attention's q/k/v/o, the mixer's in and out
    "router.weight",
    "shared_mlp.input_linear.weight",
    "shared_mlp.output_linear.weight",
    "experts.gate_up_proj",
    "experts.down_proj",
)


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under the GGUF names and in the shapes the converter writes."""
    config = hf.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    inner = config.mamba_expand * config.hidden_size
    experts = bool(config.num_local_experts)
    out = {}
    for name, t in hf.state_dict().items():
        t = t.float()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            short = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
            out[f"{short.get(name.rpartition('.')[0], 'output')}.weight"] = t.numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mamba.A_log":
            t = -torch.exp(t).reshape(-1, 1)
        elif rest == "mamba.D":
            t = t.reshape(-1, 1)
        elif rest == "mamba.conv1d.weight":
            t = t.squeeze()
        elif rest == "mamba.norm.weight":
            t = t.reshape(config.mamba_n_groups, inner // config.mamba_n_groups)
        elif rest == "self_attn.q_proj.weight":
            t = torch.from_numpy(_permute(t.numpy(), heads))
        elif rest == "self_attn.k_proj.weight":
            t = torch.from_numpy(_permute(t.numpy(), kv_heads))
        if rest == "block_sparse_moe.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = gate, up
        elif rest == "shared_mlp.input_linear.weight":
            gate, up = t.chunk(2, dim=0)
            suffix = "_shexp" if experts else ""
            out[blk + f"ffn_gate{suffix}.weight"] = gate
            out[blk + f"ffn_up{suffix}.weight"] = up
        elif rest == "shared_mlp.output_linear.weight":
            out[blk + ("ffn_down_shexp.weight" if experts else "ffn_down.weight")] = t
        else:
            out[blk + _NAMES[rest]] = t
    return {k: np.ascontiguousarray(v.numpy() if torch.is_tensor(v) else v) for k, v in out.items()}


def write_hybrid_gguf(path, hf, qtype=None, drop=(), rope=None):
    """hf as llama.cpp's converter writes a Granite 4.0-H: GraniteMoeModel's keys (no
    key_length: Granite's converter drops head_dim), head_count_kv per layer, the SSM
    keys, rope.scaling.finetuned false (`rope` True: written true, as for Bamba) and
    the context length 2^20 without RoPE. `drop`: keys left out."""
    config = hf.config
    use_rope = config.position_embedding_type == "rope" if rope is None else rope
    arch = granitehybrid.ARCH
    writer = gguf.GGUFWriter(str(path), arch)
    attention = [kind == "attention" for kind in HYBRID["layer_types"]]
    inner = config.mamba_expand * config.hidden_size
    keys = {
        gguf.Keys.LLM.BLOCK_COUNT: (config.num_hidden_layers, "uint32"),
        gguf.Keys.LLM.CONTEXT_LENGTH: (
            config.max_position_embeddings if use_rope else 2**20,
            "uint32",
        ),
        gguf.Keys.LLM.EMBEDDING_LENGTH: (config.hidden_size, "uint32"),
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: (config.intermediate_size, "uint32"),
        gguf.Keys.Attention.HEAD_COUNT: (config.num_attention_heads, "uint32"),
        gguf.Keys.Attention.HEAD_COUNT_KV: (
            [config.num_key_value_heads if a else 0 for a in attention],
            "array",
        ),
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: (config.rms_norm_eps, "float32"),
        gguf.Keys.Rope.FREQ_BASE: (10000.0, "float32"),
        gguf.Keys.Attention.SCALE: (config.attention_multiplier, "float32"),
        gguf.Keys.LLM.EMBEDDING_SCALE: (config.embedding_multiplier, "float32"),
        gguf.Keys.LLM.RESIDUAL_SCALE: (config.residual_multiplier, "float32"),
        gguf.Keys.LLM.LOGIT_SCALE: (config.logits_scaling, "float32"),
        gguf.Keys.SSM.CONV_KERNEL: (config.mamba_d_conv, "uint32"),
        gguf.Keys.SSM.STATE_SIZE: (config.mamba_d_state, "uint32"),
        gguf.Keys.SSM.GROUP_COUNT: (config.mamba_n_groups, "uint32"),
        gguf.Keys.SSM.INNER_SIZE: (inner, "uint32"),
        gguf.Keys.SSM.TIME_STEP_RANK: (config.mamba_n_heads, "uint32"),
        gguf.Keys.Rope.SCALING_FINETUNED: (use_rope, "bool"),
    }
    if config.num_local_experts:
        keys[gguf.Keys.LLM.EXPERT_COUNT] = (config.num_local_experts, "uint32")
        keys[gguf.Keys.LLM.EXPERT_USED_COUNT] = (config.num_experts_per_tok, "uint32")
        keys[gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH] = (
            config.shared_intermediate_size, "uint32",
        )  # fmt: skip
    for template, (value, kind) in keys.items():
        if template in drop:
            continue
        name = template.format(arch=arch)
        if kind == "array":
            writer.add_array(name, value)
        else:
            getattr(writer, f"add_{kind}")(name, value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, data in converted(hf).items():
        layer_name = name.split(".")[2] if name.startswith("blk.") else ""
        if qtype is not None and data.ndim >= 2 and layer_name.startswith(_QUANTIZABLE):
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- the model ----------------------------------------------------------------------


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_granite_4_micro_without_mamba_layers_matches_transformers(tmp_path):
    """The dense granite-4.0-micro: this model type with attention layers only, RoPE, no
    experts (llama.cpp writes it as "granite": test_granite.py), from a folder."""
    hf = hf_model(
        layer_types=["attention"] * 4, num_local_experts=0, intermediate_size=64,
        position_embedding_type="rope", rope_theta=10000.0,
    )  # fmt: skip
    hf.save_pretrained(tmp_path / "micro")
    loaded = load_model(tmp_path / "micro", CPU, "f32")
    assert loaded.model.new_cache(1, 8, torch.float32, "cpu").recurrent.tensors == {}
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_older_configs_name_the_layer_types_layers_block_type():
    from llmrun.models.granitemoehybrid import ModelArgs

    kinds = ["mamba", "attention", "mamba", "mamba"]
    config = {k: v for k, v in HYBRID.items() if k != "layer_types"}
    args = ModelArgs.from_config({**config, "layers_block_type": kinds})
    assert args.layer_types == kinds and args.attention_layers == [1]
    assert ModelArgs.from_config(config).layer_types == ["mamba"] * 4  # transformers' default


def test_the_mixers_parameters_each_move_the_logits():
    """Each Mamba-2 parameter that a mixer could drop (D, dt_bias, the convolution's
    bias, A, the gate's and norm's weights) moves transformers' logits by far more than
    the tolerance, and llmrun follows each change; so do RoPE and the shared expert."""
    hf = hf_model()
    expected = reference(hf)
    for suffix in ("mamba.D", "mamba.dt_bias", "mamba.conv1d.bias", "mamba.A_log"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        moved = reference(changed)
        assert max_diff(moved, expected) > 0.1, suffix
        assert max_diff(cached_logits(ours(changed), IDS), moved) < 1e-4
    for variant in (
        dict(position_embedding_type="rope", rope_theta=10000.0),
        dict(mamba_n_groups=1),
    ):
        hf = hf_model(**variant)
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_the_gated_norm_is_grouped():
    """RMSNorm over each of the n_groups groups, not over all features: a norm weight
    that scales one group moves the logits as transformers says."""
    hf = hf_model()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mamba.norm.weight"):
                p[: p.shape[0] // 2].mul_(3.0)
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_the_chunked_ssd_is_the_one_token_recurrence(chunk):
    gen = torch.Generator().manual_seed(0)
    batch, tokens, heads, head_dim, groups, state_size = 2, 37, 6, 4, 3, 5
    x = torch.randn(batch, tokens, heads, head_dim, generator=gen)
    dt = torch.rand(batch, tokens, heads, generator=gen) * 0.5
    dt[1, 30:] = 0  # padding: no step
    a = -torch.rand(heads, generator=gen) * 4
    b = torch.randn(batch, tokens, groups, state_size, generator=gen)
    c = torch.randn(batch, tokens, groups, state_size, generator=gen)
    state = torch.randn(batch, heads, head_dim, state_size, generator=gen)
    y, final = ssd_chunked(x, dt, a, b, c, state, chunk)
    y_ref, final_ref = ssd_step(x, dt, a, b, c, state)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)
    # The padded tokens left the state where the row's last real token left it.
    _, at_30 = ssd_step(x[1:, :30], dt[1:, :30], a, b[1:, :30], c[1:, :30], state[1:])
    torch.testing.assert_close(final[1:], at_30, atol=1e-4, rtol=1e-4)


def test_padded_rows_in_scattered_slots_keep_their_own_state(family):
    """Three prompts of different lengths padded on the right in rows 3, 0, 2 of a 4-row
    cache, then a decode step each: each row's logits are transformers' of its prompt
    alone, and a padded token's logits are its row's last real token's."""
    hf, _ = family
    check_padded_rows_in_scattered_slots(
        ours(hf), lambda ids: reference(hf, ids), IDS, padding_repeats=True
    )


def test_serves_from_paged_blocks_with_a_state_row(family):
    """serve's path: keys and values through paged blocks, the Mamba-2 state in a row of
    the scheduler's kind (RecurrentState), in chunked prefills and decode steps."""
    hf, expected = family
    model = ours(hf)
    states = model.new_cache(3, 1, "f32", "cpu").recurrent
    check_paged_with_a_state_row(model, IDS, expected, states)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_or_native_decode_step(family):
    """CUDA graphs' static step refuses the recurrent cache; the loader attaches no
    native decode step (its layers are attention layers)."""
    check_no_static_decode(ours(family[0]))


def test_unknown_layer_types_and_position_embeddings_are_refused():
    from llmrun.models.granitemoehybrid import ModelArgs

    config = {**HYBRID, "layer_types": ["mamba", "sliding_attention", "mamba", "mamba"]}
    with pytest.raises(UnsupportedError, match="sliding_attention"):
        ModelArgs.from_config(config)
    with pytest.raises(UnsupportedError, match="position_embedding_type 'alibi'"):
        ModelArgs.from_config({**HYBRID, "position_embedding_type": "alibi"})
    with pytest.raises(ModelFormatError, match="layer_types lists 3 layers"):
        ModelArgs.from_config({**HYBRID, "layer_types": ["mamba"] * 3})


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    check_saved_folder_loads(hf, tmp_path / "hf", IDS, expected)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    rope = hf.config.position_embedding_type == "rope"
    loaded = load_model(write_hybrid_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "granitemoehybrid"
    assert config["layer_types"] == HYBRID["layer_types"]
    assert config["position_embedding_type"] == ("rope" if rope else "nope")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_hybrid_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_weights_ending(hf, q8, _QUANTIZED)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_ssm_keys_is_refused(tmp_path):
    path = write_hybrid_gguf(tmp_path / "m.gguf", hf_model(), drop=(gguf.Keys.SSM.STATE_SIZE,))
    with pytest.raises(ModelFormatError, match="ssm.state_size' is missing"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model()
    path = write_hybrid_gguf(tmp_path / "granite-h.gguf", hf)
    check_run_and_show(hf, path, "granitehybrid")
    info = inspect.describe(path)
    # Only the attention layer caches keys and values; a sequence's Mamba-2 state beside
    # them is the rest of what the model's cache allocates.
    per_position = 2 * HYBRID["num_key_value_heads"] * 16 * 4
    assert info["kv_cache_bytes_8k"] == per_position * 8192
    model = ours(hf)
    allocated = model.new_cache(1, 10, torch.float32, "cpu").nbytes
    state = recurrent_state_bytes(model.args)
    assert kv_cache_bytes(hf.config.to_dict(), 10) == allocated - state == per_position * 10


def test_served_requests_equal_transformers_greedy_text(tmp_path):
    """serve's scheduler with two state rows and more requests than rows, of different
    lengths: each request's greedy text is transformers' for its prompt alone."""
    hf = hf_model(**VARIANTS["moe-rope"])
    path = write_hybrid_gguf(tmp_path / "served.gguf", hf)
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)

"""Nemotron-H and Nemotron-H MoE (nemotron_h) against transformers' NemotronHForCausalLM,
from a config.json (transformers 5's names, and the Hub's: backbone., one tensor per
expert, an mtp.* head, the older hybrid_override_pattern) and from "nemotron_h" and
"nemotron_h_moe" GGUFs written as llama.cpp's converter writes them
(conversion/nemotron.py NemotronHModel over GraniteHybridModel and Mamba2Model:
feed_forward_length and head_count_kv per layer, 0 where a layer has no such block;
attention.layer_norm_epsilon; A_log stored as -exp(A_log) [heads, 1], D [heads, 1], the
convolution squeezed to [channels, d_conv], the gated norm's weight as [n_groups,
inner / n_groups], dt_bias as ssm_dt.bias; Llama's permuted q/k; the experts stacked,
the router's correction bias as exp_probs_b.bias, the shared expert as ffn_*_shexp, the
latent projections as ffn_latent_down/up; the expert keys, key_length, no RoPE and a
context of 2^20).

The tiny models: 5 layers, Mamba-2 (8 heads of 16, 2 groups of B/C, a state of 16, a
kernel of 4), attention (4 heads, 2 KV heads of 16) and MLP or MoE layers (8 experts in
2 groups, top 2 of the best group, scaled by 2.5, a shared expert; with or without a
latent width of 32).

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers: whole,
through the cache (prefills in chunks, then one token at a time), rows of different
lengths padded on the right in scattered cache rows, serve's paged blocks with a state
row. A Q8_0 GGUF (its matrices Q8_0, the small Mamba-2 tensors and the router F32 as
llama.cpp keeps them) against transformers on the dequantized weights: 1e-4. An f16 or
bf16 KV cache: 1e-5 against an f32 cache holding the rounded values, drifting from f32
by less than DRIFT. The chunked SSD itself is held to the one-token recurrence in
test_granitemoehybrid.py (the same mixer).
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
from llmrun.loading import inspect, nemotron_h
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import Weight, load_model
from llmrun.models import kv_cache_bytes, recurrent_state_bytes
from llmrun.models.nemotron_h import ModelArgs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
DENSE = ["mamba", "mlp", "attention", "mamba", "mlp"]
MOE = ["mamba", "moe", "attention", "mamba", "moe"]
CONFIG = dict(
    {k: v for k, v in BASE.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
    model_type="nemotron_h",
    layers_block_type=DENSE,
    head_dim=16,
    intermediate_size=96,
    layer_norm_epsilon=1e-5,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=64,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
VARIANTS = {
    "dense": {},
    "moe": dict(layers_block_type=MOE),
    "moe-latent": dict(layers_block_type=MOE, moe_latent_size=32),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 up to 2e-3, bf16 up to 3e-2.
DRIFT = {"f16": 1e-2, "bf16": 0.3}


def hf_model(**overrides):
    """transformers' model with randomize()'s weights, the final norm's (norm_f, which
    randomize does not take for a norm) near 1 too, the routers' correction biases
    drawn (a buffer, which randomize leaves at 0)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        model.model.norm_f.weight.normal_(1.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """hf's tensors as the Hub's checkpoints hold them: backbone. for model., one tensor
    per expert."""
    out = {}
    for name, t in hf.state_dict().items():
        if name.startswith("model."):
            name = "backbone." + name.removeprefix("model.")
        prefix, _, projection = name.rpartition(".")
        if prefix.endswith("mixer.experts"):
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{projection}.weight"] = t[e]
            continue
        out[name] = t
    return out


def ours(hf) -> torch.nn.Module:
    """llmrun's model of `hf` from its config and its state dict (transformers 5's
    in-memory names: model., the experts stacked), split as the loader splits it."""
    weights = {k: Weight(v) for k, v in hf.state_dict().items()}
    state = {k: w.tensor for k, w in nemotron_h.hf_weights(weights, Weight).items()}
    return our_model(hf.config.to_dict(), state)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_NAMES = {
    "norm.weight": "attn_norm.weight",
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
    "mixer.up_proj.weight": "ffn_up.weight",
    "mixer.down_proj.weight": "ffn_down.weight",
    "mixer.gate.weight": "ffn_gate_inp.weight",
    "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mixer.experts.up_proj": "ffn_up_exps.weight",
    "mixer.experts.down_proj": "ffn_down_exps.weight",
    "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mixer.fc1_latent_proj.weight": "ffn_latent_down.weight",
    "mixer.fc2_latent_proj.weight": "ffn_latent_up.weight",
}
_GLOBAL = {
    "model.embeddings.weight": "token_embd.weight",
    "model.norm_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# What llama.cpp quantizes: the matrices, not the small Mamba-2 tensors nor the router
# (nor, here, the embeddings); and those matrices' transformers names.
_QUANTIZABLE = ("attn_q", "attn_k", "attn_v", "attn_output", "ssm_in", "ssm_out", "ffn_up")
_QUANTIZABLE += ("ffn_down", "ffn_latent")
_QUANTIZED = ("proj.weight", "experts.up_proj", "experts.down_proj")


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under the GGUF names and in the shapes the converter writes."""
    config = hf.config
    inner = config.mamba_num_heads * config.mamba_head_dim
    out = {}
    for name, t in hf.state_dict().items():
        t = t.float()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mixer.A_log":
            t = -torch.exp(t).reshape(-1, 1)
        elif rest == "mixer.D":
            t = t.reshape(-1, 1)
        elif rest == "mixer.conv1d.weight":
            t = t.squeeze()
        elif rest == "mixer.norm.weight":
            t = t.reshape(config.n_groups, inner // config.n_groups)
        elif rest == "mixer.q_proj.weight":
            t = torch.from_numpy(_permute(t.numpy(), config.num_attention_heads))
        elif rest == "mixer.k_proj.weight":
            t = torch.from_numpy(_permute(t.numpy(), config.num_key_value_heads))
        out[f"blk.{layer}.{_NAMES[rest]}"] = t
    return {k: np.ascontiguousarray(v.numpy()) for k, v in out.items()}


def converter_keys(hf, drop=()) -> dict[str, tuple]:
    """The metadata NemotronHModel.set_gguf_parameters writes for `hf` (key template ->
    (value, writer method)), `drop` left out."""
    config = hf.config
    kinds = config.layers_block_type
    moe = "moe" in kinds
    ffn_width = config.moe_intermediate_size if moe else config.intermediate_size
    keys = {
        gguf.Keys.LLM.BLOCK_COUNT: (len(kinds), "uint32"),
        gguf.Keys.LLM.CONTEXT_LENGTH: (2**20, "uint32"),  # no RoPE: GraniteHybridModel's
        gguf.Keys.LLM.EMBEDDING_LENGTH: (config.hidden_size, "uint32"),
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: (
            [ffn_width if k in ("mlp", "moe") else 0 for k in kinds],
            "array",
        ),  # fmt: skip
        gguf.Keys.Attention.HEAD_COUNT: (config.num_attention_heads, "uint32"),
        gguf.Keys.Attention.HEAD_COUNT_KV: (
            [config.num_key_value_heads if k == "full_attention" else 0 for k in kinds],
            "array",
        ),  # fmt: skip
        gguf.Keys.Attention.LAYERNORM_EPS: (config.layer_norm_epsilon, "float32"),
        gguf.Keys.Attention.KEY_LENGTH: (config.head_dim, "uint32"),
        gguf.Keys.Attention.VALUE_LENGTH: (config.head_dim, "uint32"),
        gguf.Keys.SSM.CONV_KERNEL: (config.conv_kernel, "uint32"),
        gguf.Keys.SSM.STATE_SIZE: (config.ssm_state_size, "uint32"),
        gguf.Keys.SSM.GROUP_COUNT: (config.n_groups, "uint32"),
        gguf.Keys.SSM.INNER_SIZE: (config.mamba_num_heads * config.mamba_head_dim, "uint32"),
        gguf.Keys.SSM.TIME_STEP_RANK: (config.mamba_num_heads, "uint32"),
        gguf.Keys.Rope.SCALING_FINETUNED: (False, "bool"),
    }
    if moe:
        keys.update({
            gguf.Keys.LLM.EXPERT_COUNT: (config.n_routed_experts, "uint32"),
            gguf.Keys.LLM.EXPERT_USED_COUNT: (config.num_experts_per_tok, "uint32"),
            gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: (config.moe_intermediate_size, "uint32"),
            gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: (
                config.moe_shared_expert_intermediate_size, "uint32",
            ),
            gguf.Keys.LLM.EXPERT_SHARED_COUNT: (config.n_shared_experts, "uint32"),
            gguf.Keys.LLM.EXPERT_WEIGHTS_NORM: (config.norm_topk_prob, "bool"),
            gguf.Keys.LLM.EXPERT_WEIGHTS_SCALE: (float(config.routed_scaling_factor), "float32"),
            gguf.Keys.LLM.EXPERT_GROUP_COUNT: (config.n_group, "uint32"),
            gguf.Keys.LLM.EXPERT_GROUP_USED_COUNT: (config.topk_group, "uint32"),
        })  # fmt: skip
        if config.moe_latent_size is not None:
            keys[gguf.Keys.LLM.MOE_LATENT_SIZE] = (config.moe_latent_size, "uint32")
    return {k: v for k, v in keys.items() if k not in drop}


def write_nemotron_gguf(path, hf, qtype=None, drop=(), keys=None, tensors=None):
    """hf as llama.cpp's converter writes it (nemotron_h_moe where it has experts): the
    converter's keys (`keys` overriding them, `drop` left out), stories260K's vocabulary,
    converted(hf)'s tensors (and `tensors`), the matrices in `qtype` (default F32)."""
    arch = "nemotron_h_moe" if "moe" in hf.config.layers_block_type else "nemotron_h"
    writer = gguf.GGUFWriter(str(path), arch)
    for template, (value, kind) in {**converter_keys(hf, drop), **(keys or {})}.items():
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
    for name, data in {**converted(hf), **(tensors or {})}.items():
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
    assert max_diff(cached_logits(model, IDS, chunks=(3, 11, 9)), expected) < 1e-4


def test_older_configs_give_the_pattern_as_a_string_and_other_names():
    """The Hub's remote-code configs: hybrid_override_pattern ("M-*E"), num_hidden_layers
    beside it, attention_head_dim, mamba_n_groups and mamba_d_conv."""
    config = {k: v for k, v in CONFIG.items() if k not in ("layers_block_type", "head_dim")}
    config = {k: v for k, v in config.items() if k not in ("n_groups", "conv_kernel")}
    args = ModelArgs.from_config({
        **config, "hybrid_override_pattern": "M-*ME", "num_hidden_layers": 5,
        "attention_head_dim": 16, "mamba_n_groups": 4, "mamba_d_conv": 3,
    })  # fmt: skip
    assert args.layers_block_type == ["mamba", "mlp", "attention", "mamba", "moe"]
    assert (args.num_hidden_layers, args.attention_layers) == (5, [2])
    assert (args.head_dim, args.n_groups, args.conv_kernel) == (16, 4, 3)


def test_each_feature_moves_the_logits_and_llmrun_follows():
    """Each thing the family does that a model could leave out moves transformers'
    logits by far more than the tolerance, and llmrun follows each change: the Mamba-2
    D, dt_bias, convolution bias and A; the router's correction bias, its grouping, its
    scale and renormalization; the shared expert; the latent projections; the grouped
    gated norm."""
    base = dict(layers_block_type=MOE)
    expected = reference(hf_model(**base))
    for suffix in ("mixer.D", "mixer.dt_bias", "mixer.conv1d.bias", "mixer.A_log",
                   "e_score_correction_bias", "shared_experts.down_proj.weight"):  # fmt: skip
        changed = hf_model(**base)
        with torch.no_grad():
            for name, p in [*changed.named_parameters(), *changed.named_buffers()]:
                if name.endswith(suffix):
                    p.zero_()
        moved = reference(changed)
        assert max_diff(moved, expected) > 0.1, suffix
        assert max_diff(cached_logits(ours(changed), IDS), moved) < 1e-4, suffix
    for variant in (
        dict(n_group=1, topk_group=1),
        dict(routed_scaling_factor=1.0),
        dict(norm_topk_prob=False),
        dict(moe_latent_size=32),
        dict(n_groups=1),
    ):
        hf = hf_model(**base, **variant)
        moved = reference(hf)
        assert max_diff(moved, expected) > 0.1, variant
        assert max_diff(cached_logits(ours(hf), IDS), moved) < 1e-4, variant


def test_the_mlp_is_squared_relu_and_the_attention_has_no_rope():
    """The dense layers' relu(x)^2 (not relu, not SiLU) and attention without a position
    encoding: transformers' logits of the same weights with relu instead move, and a
    prompt's attention output does not depend on where the keys are (a model whose
    every layer attends gives a repeated token the same logits at each position)."""
    hf = hf_model()
    model = ours(hf)
    relu = hf_model()
    for layer in relu.model.layers:
        if layer.block_type == "mlp":
            layer.mixer.act_fn = torch.nn.ReLU()
    assert max_diff(reference(relu), reference(hf)) > 0.1
    attention_only = hf_model(layers_block_type=["attention", "mlp"])
    same = torch.full((1, 6), 17)
    logits = reference(attention_only, same)[0]
    assert max_diff(logits, logits[:1].expand_as(logits)) < 1e-4
    with torch.no_grad():
        ours_logits = ours(attention_only)(same, torch.arange(6)[None])[0]
    assert max_diff(ours_logits, logits) < 1e-4
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


def test_padded_rows_in_scattered_slots_keep_their_own_state(family):
    """Three prompts of different lengths padded on the right in rows 3, 0, 2 of a 4-row
    cache, then a decode step each: each row's logits are transformers' of its prompt
    alone."""
    hf, _ = family
    check_padded_rows_in_scattered_slots(ours(hf), lambda ids: reference(hf, ids), IDS)


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


def test_no_static_decode_step(family):
    """CUDA graphs' static step refuses the recurrent cache."""
    check_no_static_decode(ours(family[0]))


def test_unsupported_configs_are_refused():
    with pytest.raises(UnsupportedError, match="mlp_hidden_act 'silu'"):
        ModelArgs.from_config({**CONFIG, "mlp_hidden_act": "silu"})
    with pytest.raises(UnsupportedError, match="layer types \\['sliding_attention'\\]"):
        ModelArgs.from_config({**CONFIG, "layers_block_type": ["mamba", "sliding_attention"]})
    with pytest.raises(ModelFormatError, match="do not route in 3 groups"):
        ModelArgs.from_config({**CONFIG, "layers_block_type": MOE, "n_group": 3})


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    check_saved_folder_loads(hf, tmp_path / "hf", IDS, expected)


def test_a_hub_folder_with_backbone_names_and_an_mtp_head_loads(tmp_path):
    """The Hub's layout (which save_pretrained writes too): backbone.*, one tensor per
    expert, and the mtp.* head beside them (which transformers does not run either)."""
    from safetensors.torch import save_file

    hf = hf_model(**VARIANTS["moe"])
    folder = tmp_path / "hub"
    hf.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hub_state(hf).items()}
    state["mtp.layers.0.enorm.weight"] = torch.ones(CONFIG["hidden_size"])
    save_file(state, folder / "model.safetensors")
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_nemotron_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "nemotron_h"
    assert config["layers_block_type"] == [
        {"linear_attention": "mamba", "full_attention": "attention"}.get(k, k)
        for k in hf.config.layers_block_type
    ]
    assert loaded.model.decode_step is None
    # The converter's q/k permutation undone: no RoPE tells it apart, the weights do.
    ours_q = loaded.model.model.layers[2].mixer.q_proj.weight
    assert torch.equal(ours_q, hf.model.layers[2].mixer.q_proj.weight)
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(**VARIANTS["moe-latent"])
    loaded = load_model(write_nemotron_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_weights_ending(hf, q8, _QUANTIZED)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_with_an_mtp_block_runs_its_trunk(tmp_path):
    """nextn_predict_layers 1: block_count and the per-layer arrays count one more block,
    whose tensors (blk.5.*) llama.cpp's inference skips; so does llmrun."""
    hf = hf_model(**VARIANTS["moe"])
    keys = converter_keys(hf)
    extra = {
        gguf.Keys.LLM.BLOCK_COUNT: (6, "uint32"),
        gguf.Keys.LLM.NEXTN_PREDICT_LAYERS: (1, "uint32"),
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: (keys[gguf.Keys.LLM.FEED_FORWARD_LENGTH][0] + [32], "array"),
        gguf.Keys.Attention.HEAD_COUNT_KV: (keys[gguf.Keys.Attention.HEAD_COUNT_KV][0] + [2], "array"),
    }  # fmt: skip
    mtp = {"blk.5.nextn.eh_proj.weight": np.zeros((64, 128), np.float32)}
    path = write_nemotron_gguf(tmp_path / "mtp.gguf", hf, keys=extra, tensors=mtp)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["num_hidden_layers"] == 5
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_llama_cpp_defaults_where_the_expert_keys_are_absent(tmp_path):
    """Without expert_weights_norm, expert_weights_scale and the group keys llama.cpp
    neither renormalizes nor scales nor groups: transformers with those settings. Without
    expert_feed_forward_length the experts are feed_forward_length / expert_used_count
    wide (here 64 / 2)."""
    drop = (
        gguf.Keys.LLM.EXPERT_WEIGHTS_NORM, gguf.Keys.LLM.EXPERT_WEIGHTS_SCALE,
        gguf.Keys.LLM.EXPERT_GROUP_COUNT, gguf.Keys.LLM.EXPERT_GROUP_USED_COUNT,
        gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    )  # fmt: skip
    widths = {gguf.Keys.LLM.FEED_FORWARD_LENGTH: ([0, 64, 0, 0, 64], "array")}
    hf = hf_model(layers_block_type=MOE)
    path = write_nemotron_gguf(tmp_path / "d.gguf", hf, drop=drop, keys=widths)
    loaded = load_model(path, CPU, "f32")
    plain = hf_model(
        layers_block_type=MOE, norm_topk_prob=False, routed_scaling_factor=1.0,
        n_group=1, topk_group=1,
    )  # fmt: skip
    assert max_diff(reference(plain), reference(hf)) > 0.1
    assert max_diff(cached_logits(loaded.model, IDS), reference(plain)) < 1e-4


def test_bad_ggufs_are_refused(tmp_path):
    hf = hf_model(layers_block_type=MOE)
    path = write_nemotron_gguf(tmp_path / "a.gguf", hf, drop=(gguf.Keys.SSM.STATE_SIZE,))
    with pytest.raises(ModelFormatError, match="ssm.state_size' is missing"):
        load_model(path, CPU, "f32")
    path = write_nemotron_gguf(tmp_path / "b.gguf", hf, drop=(gguf.Keys.Attention.LAYERNORM_EPS,))
    with pytest.raises(ModelFormatError, match="layer_norm_epsilon' is missing"):
        load_model(path, CPU, "f32")
    widths = {gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: ([0, 32, 0, 0, 16], "array")}
    path = write_nemotron_gguf(tmp_path / "c.gguf", hf, keys=widths)
    with pytest.raises(ModelFormatError, match="expert_feed_forward_length differs"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model(**VARIANTS["moe"])
    path = write_nemotron_gguf(tmp_path / "nemotron-h.gguf", hf)
    check_run_and_show(hf, path, "nemotron_h")
    info = inspect.describe(path)
    # Only the attention layer caches keys and values; a sequence's Mamba-2 state beside
    # them is the rest of what the model's cache allocates.
    per_position = 2 * CONFIG["num_key_value_heads"] * 16 * 4
    assert info["kv_cache_bytes_8k"] == per_position * 8192
    assert 0 < info["active_parameters"] < info["parameters"]
    model = ours(hf)
    allocated = model.new_cache(1, 10, torch.float32, "cpu").nbytes
    state = recurrent_state_bytes(model.args)
    assert kv_cache_bytes(hf.config.to_dict(), 10) == allocated - state == per_position * 10
    # show's torch-free count, of transformers 5's config.json (the pattern's length is the
    # layer count) and of the Hub's (hybrid_override_pattern, num_hidden_layers).
    assert inspect.kv_cache_bytes(hf.config.to_dict(), 10) == per_position * 10
    hub = {k: v for k, v in CONFIG.items() if k != "layers_block_type"}
    hub.update(hybrid_override_pattern="M-*ME*", num_hidden_layers=6)
    assert inspect.kv_cache_bytes(hub, 10) == 2 * per_position * 10


def test_served_requests_equal_transformers_greedy_text(tmp_path):
    """serve's scheduler with two state rows and more requests than rows, of different
    lengths: each request's greedy text is transformers' for its prompt alone."""
    hf = hf_model(**VARIANTS["moe"])
    path = write_nemotron_gguf(tmp_path / "served.gguf", hf)
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)

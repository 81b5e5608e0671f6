"""Falcon-H1 against transformers' FalconH1ForCausalLM, from a config.json and from
"falcon-h1" GGUFs written as llama.cpp's converter writes them (conversion/falcon_h1.py
over mamba.py Mamba2Model: every muP multiplier folded into the weights as the
converter folds them, the mup vector into in_proj's row blocks; A_log stored as
-exp(A_log) [heads, 1], D [heads, 1], the convolution squeezed to [channels, d_conv],
the gated norm's weight as [n_groups, inner / n_groups], dt_bias as ssm_dt.bias; q/k
rows as they are; the SSM keys, key_length, context_length the config's).

The tiny models: 3 layers, each attention (GQA 4:2, heads of 16) beside a Mamba-2 mixer
of 6 heads of 16 (mamba_d_ssm 96, not 2 * hidden) in 2 groups of B/C with a state of 8,
a kernel of 4; every multiplier away from 1 and each of the five ssm_multipliers
different. Variants: the grouped norm after the gate (llama.cpp's order), before it,
or no norm (mamba_rms_norm false). Each multiplier moves transformers' logits by far
more than the tolerance and llmrun follows each (asserted).

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers: whole,
through the cache (prefills in chunks, then one token at a time), rows of different
lengths padded on the right in scattered cache rows, serve's paged blocks with a state
row, the scheduler's greedy text. A Q8_0 GGUF against transformers on the folded and
dequantized weights: 1e-4. An f16 or bf16 KV cache: 1e-5 against an f32 cache holding
the rounded values, drifting from f32 by less than DRIFT.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    PROMPT,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import ModelFormatError
from llmrun.loading import falcon_h1 as falcon_h1_loading
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import falcon_h1, kv_cache_bytes, recurrent_state_bytes

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
MULTIPLIERS = dict(
    embedding_multiplier=1.5,
    lm_head_multiplier=0.7,
    key_multiplier=0.6,
    attention_in_multiplier=1.4,
    attention_out_multiplier=0.8,
    ssm_in_multiplier=1.3,
    ssm_out_multiplier=0.6,
    ssm_multipliers=[0.5, 1.5, 0.7, 1.6, 0.4],
    mlp_multipliers=[1.4, 0.6],
)
UNSCALED = dict(
    {name: 1.0 for name in MULTIPLIERS},
    ssm_multipliers=[1.0] * 5,
    mlp_multipliers=[1.0, 1.0],
)
FALCON = dict(
    BASE,
    model_type="falcon_h1",
    num_hidden_layers=3,
    intermediate_size=48,
    head_dim=16,
    mamba_d_ssm=96,
    mamba_n_heads=6,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    mamba_rms_norm=True,
    mamba_norm_before_gate=False,
    rope_theta=10000.0,
    **MULTIPLIERS,
)
VARIANTS = {
    "norm-after-gate": {},
    "norm-before-gate": dict(mamba_norm_before_gate=True),
    "no-norm": dict(mamba_rms_norm=False),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 6e-3 to 1.1e-2, bf16 5e-2 to 8e-2.
DRIFT = {"f16": 3e-2, "bf16": 0.25}
Q8 = gguf.GGMLQuantizationType.Q8_0


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**FALCON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------


def folded(hf) -> dict[str, torch.Tensor]:
    """hf's state dict with the multipliers folded in as the converter folds them
    (FalconH1Model.modify_tensors), under the Hugging Face names."""
    c = hf.config
    inner, group_width = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state
    widths = [inner, inner, group_width, group_width, c.mamba_n_heads]
    mup = torch.cat([torch.full((w,), m) for w, m in zip(widths, c.ssm_multipliers, strict=True)])
    scales = {
        "feed_forward.down_proj": c.mlp_multipliers[1],
        "feed_forward.gate_proj": c.mlp_multipliers[0],
        "self_attn.k_proj": c.key_multiplier * c.attention_in_multiplier,
        "self_attn.q_proj": c.attention_in_multiplier,
        "self_attn.v_proj": c.attention_in_multiplier,
        "self_attn.o_proj": c.attention_out_multiplier,
        "mamba.out_proj": c.ssm_out_multiplier,
        "lm_head": c.lm_head_multiplier,
        "embed_tokens": c.embedding_multiplier,
    }
    out = {}
    for name, t in hf.state_dict().items():
        t = t.float().clone()
        if "mamba.in_proj" in name:
            t = t * c.ssm_in_multiplier * mup[:, None]
        for part, scale in scales.items():
            if part in name:
                t = t * scale
        out[name] = t
    return out


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    # gguf-py maps the whole name to FFN_PRE_NORM, "blk.N.ffn_norm", with no ".weight"
    "pre_ff_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.A_log": "ssm_a",
    "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.final_layernorm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def converted(hf, state=None) -> dict[str, np.ndarray]:
    """hf's folded tensors (or `state`'s) under the GGUF names, in the converter's shapes."""
    c = hf.config
    out = {}
    for name, t in (state or folded(hf)).items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t.numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mamba.A_log":
            t = -torch.exp(t).reshape(-1, 1)
        elif rest == "mamba.D":
            t = t.reshape(-1, 1)
        elif rest == "mamba.conv1d.weight":
            t = t.squeeze(1)
        elif rest == "mamba.norm.weight":
            t = t.reshape(c.mamba_n_groups, c.mamba_d_ssm // c.mamba_n_groups)
        out[f"blk.{layer}.{_NAMES[rest]}"] = np.ascontiguousarray(t.numpy())
    return out


def write_falcon_gguf(path, hf, qtype=None, **changed):
    """hf as llama.cpp's converter writes a Falcon-H1 (its keys; multipliers folded).
    `changed`: keys replaced (None: left out)."""
    c = hf.config
    keys = {
        gguf.Keys.LLM.CONTEXT_LENGTH: c.max_position_embeddings,
        gguf.Keys.LLM.EMBEDDING_LENGTH: c.hidden_size,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: c.intermediate_size,
        gguf.Keys.LLM.BLOCK_COUNT: c.num_hidden_layers,
        gguf.Keys.LLM.VOCAB_SIZE: c.vocab_size,
        gguf.Keys.Attention.HEAD_COUNT: c.num_attention_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: c.num_key_value_heads,
        gguf.Keys.Attention.KEY_LENGTH: c.head_dim,
        gguf.Keys.Attention.VALUE_LENGTH: c.head_dim,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        gguf.Keys.SSM.CONV_KERNEL: c.mamba_d_conv,
        gguf.Keys.SSM.INNER_SIZE: c.mamba_d_ssm,
        gguf.Keys.SSM.STATE_SIZE: c.mamba_d_state,
        gguf.Keys.SSM.TIME_STEP_RANK: c.mamba_n_heads,
        gguf.Keys.SSM.GROUP_COUNT: c.mamba_n_groups,
        gguf.Keys.Rope.FREQ_BASE: c.rope_parameters["rope_theta"],
    }
    keys.update(changed)
    return write_keyed_gguf(
        path, falcon_h1_loading.ARCH, keys, converted(hf), qtype, whole_blocks=True
    )


# ---- the model ----------------------------------------------------------------------


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def _one_multiplier_unscaled() -> list[dict]:
    """Overrides that set one multiplier, or one entry of the two lists, back to 1."""
    scalars = [{name: 1.0} for name, value in MULTIPLIERS.items() if isinstance(value, float)]
    lists = [
        {name: [1.0 if i == part else m for i, m in enumerate(values)]}
        for name in ("ssm_multipliers", "mlp_multipliers")
        for part, values in enumerate([MULTIPLIERS[name]] * len(MULTIPLIERS[name]))
    ]
    return scalars + lists


@pytest.mark.parametrize(
    "unscaled", _one_multiplier_unscaled(), ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items())
)
def test_each_multiplier_moves_the_logits_and_llmrun_follows(unscaled):
    """Each multiplier (and each part of the mup vector) set back to 1 moves transformers'
    logits by far more than the tolerance, and llmrun follows the change."""
    hf = hf_model(**unscaled)
    moved = reference(hf)
    assert max_diff(moved, reference(hf_model())) > 0.05
    assert max_diff(cached_logits(ours(hf), IDS), moved) < 1e-4


def test_the_mixer_inner_size_is_mamba_d_ssm_and_defaults_as_transformers():
    args = falcon_h1.ModelArgs.from_config(FALCON)
    assert (args.mamba_d_ssm, args.mamba_d_head) == (96, 16)
    config = {k: v for k, v in FALCON.items() if k not in ("mamba_d_ssm", "mamba_n_heads")}
    assert falcon_h1.ModelArgs.from_config(config).mamba_d_ssm == 1024  # transformers' default
    args = falcon_h1.ModelArgs.from_config({**FALCON, "mamba_d_ssm": None, "mamba_n_heads": 8})
    assert args.mamba_d_ssm == 128 and args.mamba_d_head == 16  # mamba_expand * hidden
    with pytest.raises(ModelFormatError, match="Mamba-2 heads do not fit"):
        falcon_h1.ModelArgs.from_config({**FALCON, "mamba_n_heads": 7})
    with pytest.raises(ModelFormatError, match="ssm_multipliers holds 4"):
        falcon_h1.ModelArgs.from_config({**FALCON, "ssm_multipliers": [1.0] * 4})


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


def test_no_static_or_native_decode_step(family):
    """CUDA graphs' static step refuses the recurrent cache; the loader attaches no
    native decode step (test_an_hf_folder... and test_a_gguf... check the loaded model)."""
    check_no_static_decode(ours(family[0]))


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize("variant", ["norm-after-gate", "no-norm"])
def test_a_gguf_matches_transformers(variant, tmp_path):
    hf = hf_model(**VARIANTS[variant])
    loaded = load_model(write_falcon_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "falcon_h1"
    assert config["mamba_rms_norm"] == hf.config.mamba_rms_norm
    assert (config["mamba_d_ssm"], config["mamba_d_head"]) == (96, 16)
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    """The projections Q8_0 where their rows are whole blocks (the rest F32, as the
    converter falls back), against transformers without multipliers on the folded
    weights, those dequantized."""
    hf = hf_model()
    loaded = load_model(write_falcon_gguf(tmp_path / "q.gguf", hf, Q8), CPU, "f32")
    state = folded(hf)
    for name, t in state.items():
        if t.dim() == 2 and t.shape[-1] % 32 == 0 and "conv1d" not in name:
            blocks = gguf.quants.quantize(t.numpy(), Q8)
            state[name] = torch.from_numpy(gguf.quants.dequantize(blocks, Q8))
    plain = hf_model(**UNSCALED)
    plain.load_state_dict(state)
    assert max_diff(cached_logits(loaded.model, IDS), reference(plain)) < 1e-4


def test_a_gguf_without_ssm_keys_is_refused(tmp_path):
    path = write_falcon_gguf(tmp_path / "m.gguf", hf_model(), **{gguf.Keys.SSM.STATE_SIZE: None})
    with pytest.raises(ModelFormatError, match="ssm.state_size' is missing"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model()
    path = write_falcon_gguf(tmp_path / "falcon-h1.gguf", hf)
    check_run_and_show(hf, path, "falcon-h1")
    info = inspect.describe(path)
    # Every layer caches keys and values; a sequence's Mamba-2 state beside them is the
    # rest of what the model's cache allocates.
    per_position = 3 * 2 * FALCON["num_key_value_heads"] * 16 * 4
    assert info["kv_cache_bytes_8k"] == per_position * 8192
    model = ours(hf)
    allocated = model.new_cache(1, 10, torch.float32, "cpu").nbytes
    state = recurrent_state_bytes(model.args)
    assert kv_cache_bytes(hf.config.to_dict(), 10) == allocated - state == per_position * 10


def test_served_requests_equal_transformers_greedy_text(tmp_path):
    """serve's scheduler with two state rows and more requests than rows, of different
    lengths: each request's greedy text is transformers' for its prompt alone."""
    hf = hf_model()
    path = write_falcon_gguf(tmp_path / "served.gguf", hf)
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)

"""MiniMax-Text-01 against transformers' MiniMaxForCausalLM, from a config.json (the Hub's
per-expert keys) and from a "minimax-01" GGUF written as llama.cpp's converter writes
it (conversion/minimax.py: TextModel's keys, residual_scale, rope.dimension_count, the
experts stacked; no key for the lightning layers, which llama.cpp then takes to be all
but every eighth).

The tiny models: 8 layers as the released ones lay them out (7 lightning, then softmax
attention), 8 experts, the top 2; GQA 4:2 in the softmax layer; lightning prefill in
blocks of 16 tokens; alpha 1.3 on every residual. Each feature moves the logits by far
more than the tolerance (asserted below): the decay, the output gate, the norm over the
heads, alpha.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the cache (prefills in chunks, then one token at a time), rows of a batch padded
on the right, contiguous or paged with a state row; the block form against the per-token
recurrence 1e-5. A Q8_0 GGUF against transformers on the weights gguf dequantizes: 1e-4.
An f16 or bf16 KV cache: 1e-5 against an f32 cache holding the rounded values, drifting
from f32 by less than DRIFT.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_run_and_show,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)
from moe_helpers import GLOBAL_GGUF_NAMES, hub_state_dict, stacked_gguf_state

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import minimax as minimax_loading
from llmrun.loading.loader import load_model
from llmrun.models import minimax

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
LAYERS = ["linear_attention"] * 7 + ["full_attention"]
ALPHA = 1.3
MINIMAX = dict(
    BASE,
    model_type="minimax",
    num_hidden_layers=8,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    layer_types=LAYERS,
    block_size=16,
    rope_theta=10000.0,
    full_attn_alpha_factor=ALPHA,
    linear_attn_alpha_factor=ALPHA,
    mlp_alpha_factor=ALPHA,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
Q8 = gguf.GGMLQuantizationType.Q8_0
# A typed cache's drift from f32 logits (a router that picks another expert for a token
# moves its logits by more than rounding).
DRIFT = {"f16": 1e-2, "bf16": 0.3}


def hf_model(**overrides):
    """transformers' tiny MiniMax (f32, eval), randomize()'s weights with the attention
    outputs 0.3x (the routers then use every expert)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**MINIMAX, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.3, "out_proj.weight": 0.3})
    return model


def reference(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """hf's weights under the Hub's keys: per-expert ones, no decay tables."""
    return minimax_loading.hf_weights(hub_state_dict(hf, "mixtral"))


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hub_state(hf))


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.out_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.output_gate": "attn_gate",
    "self_attn.norm": "attn_norm_2",
}


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, the experts stacked [E, rows, cols]."""
    state = hub_state(hf)
    moe = {k: v for k, v in state.items() if ".block_sparse_moe." in k}
    # the Hub's per-expert keys are Mixtral's
    stacks = stacked_gguf_state(moe, {"model_type": "mixtral", "num_local_experts": 8})
    out = {k: v.numpy() for k, v in stacks.items()}
    for name, t in state.items():
        if name in GLOBAL_GGUF_NAMES:
            out[GLOBAL_GGUF_NAMES[name]] = t.numpy()
        elif ".block_sparse_moe." not in name:
            _, _, layer, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            out[f"blk.{layer}.{_LAYER[module]}.{suffix}"] = t.numpy()
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_minimax_gguf(path, hf, qtype=None, **changed):
    """hf as llama.cpp's converter writes MiniMax-Text-01: TextModel's keys (no
    key_length: the config has no head_dim), residual_scale, rope.dimension_count, the
    expert counts. `changed`: keys replaced (None: left out)."""
    config = hf.config
    keys = {
        gguf.Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        gguf.Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        gguf.Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: config.intermediate_size,
        gguf.Keys.Attention.HEAD_COUNT: config.num_attention_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: config.num_key_value_heads,
        gguf.Keys.Rope.FREQ_BASE: config.rope_parameters["rope_theta"],
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: config.rms_norm_eps,
        gguf.Keys.LLM.EXPERT_COUNT: config.num_local_experts,
        gguf.Keys.LLM.EXPERT_USED_COUNT: config.num_experts_per_tok,
        gguf.Keys.LLM.RESIDUAL_SCALE: float(config.full_attn_alpha_factor),
        gguf.Keys.Rope.DIMENSION_COUNT: config.hidden_size // config.num_attention_heads,
    }
    keys.update(changed)
    return write_keyed_gguf(path, minimax_loading.ARCH, keys, converted(hf), qtype)


# ---- the model ----------------------------------------------------------------------


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_the_block_form_is_the_per_token_recurrence():
    """LightningAttention.block (blocks of pairs of tokens) against S = l S + k^T v,
    o = q S one token at a time, with a padded token (decay 0) and a state to start."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 3, 9, 4) for _ in range(3))
    log_decay = -torch.rand(2, 3, 9)
    log_decay[1, :, 6:] = 0.0
    k[1, :, 6:] = 0.0
    state = torch.randn(2, 3, 4, 4)
    y, after = minimax.LightningAttention.block(q, k, v, log_decay, state)
    s, expected = state.clone(), []
    for t in range(9):
        s = s * log_decay[:, :, t, None, None].exp() + k[:, :, t, :, None] @ v[:, :, t, None]
        expected.append(q[:, :, t, None] @ s)
    assert max_diff(y, torch.cat(expected, dim=2)) < 1e-5
    assert max_diff(after, s) < 1e-5


def test_each_feature_moves_the_logits(family):
    hf, expected = family
    assert max_diff(reference(hf_model(mlp_alpha_factor=1.0)), expected) > 0.1
    for change in ("decay", "gate", "norm", "alpha"):
        model = ours(hf)
        for layer in model.model.layers:
            attn = layer.self_attn
            if change == "alpha":
                layer.attn_alpha = 1.0
            elif not isinstance(attn, minimax.LightningAttention):
                continue
            elif change == "decay":
                attn.slope.zero_()
            elif change == "gate":
                attn.output_gate.weight.data.fill_(1e3)
            else:
                attn.norm = torch.nn.Identity()
        assert max_diff(cached_logits(model, IDS), expected) > 0.1, change


def test_rows_padded_on_the_right_give_each_row_its_logits(family):
    hf, _ = family
    model = ours(hf)
    check_padded_rows_in_scattered_slots(model, lambda ids: reference(hf, ids), IDS)
    check_padded_rows_decoded_together(model, lambda ids: reference(hf, ids), IDS)


def test_serves_from_paged_blocks_with_a_state_row(family):
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The softmax layer's keys and values in the cache's type (the lightning layers'
    state stays f32, as llama.cpp keeps it)."""
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_decode_step(family):
    check_no_static_decode(ours(family[0]))


def test_the_config_is_checked():
    with pytest.raises(UnsupportedError, match="'mamba'"):
        minimax.ModelArgs.from_config({**MINIMAX, "layer_types": ["mamba"] * 8})
    with pytest.raises(ModelFormatError, match="lists 7 layers"):
        minimax.ModelArgs.from_config({**MINIMAX, "layer_types": LAYERS[:7]})
    default = minimax.ModelArgs.from_config({**MINIMAX, "layer_types": None})
    assert default.attention_layers == [0, 2, 4, 6]  # MiniMaxConfig's: every other one


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None  # the native step does not know MiniMax
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_minimax_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["layer_types"] == LAYERS and config["mlp_alpha_factor"] == pytest.approx(ALPHA)
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_listing_its_recurrent_layers_reads_them(tmp_path):
    layers = ["linear_attention"] * 3 + ["full_attention"]
    layers *= 2
    hf = hf_model(layer_types=layers)
    flags = [kind == "linear_attention" for kind in layers]
    path = write_minimax_gguf(tmp_path / "m.gguf", hf, **{minimax_loading.RECURRENT_LAYERS: flags})
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["layer_types"] == layers
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_rotating_part_of_each_head_reads_it(family, tmp_path):
    """rope.dimension_count under the head size (the released models turn 64 of 128
    features; transformers' MiniMax turns whole heads): llama.cpp's NEOX RoPE over the
    first features, llmrun's partial_rotary_factor, which moves the logits."""
    hf, expected = family
    path = write_minimax_gguf(tmp_path / "m.gguf", hf, **{gguf.Keys.Rope.DIMENSION_COUNT: 8})
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert loaded.model.model.rotary_emb.rotary_dim == 8
    assert max_diff(cached_logits(loaded.model, IDS), expected) > 1e-3


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    hf = hf_model()
    loaded = load_model(write_minimax_gguf(tmp_path / "q.gguf", hf, Q8), CPU, "f32")
    with torch.no_grad():  # the parameters alone: not the decay tables (buffers)
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                blocks = gguf.quants.quantize(p.numpy(), Q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8)))
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize(
    ("changed", "error", "message"),
    [
        ({gguf.Keys.LLM.RESIDUAL_SCALE: None}, ModelFormatError, "residual_scale' is missing"),
        ({gguf.Keys.LLM.EXPERT_USED_COUNT: None}, ModelFormatError, "expert_used_count is 0"),
        ({minimax_loading.RECURRENT_LAYERS: [True] * 3}, ModelFormatError, "does not list 8"),
        ({gguf.Keys.Attention.VALUE_LENGTH: 8}, UnsupportedError, "as wide as its key"),
    ],
)
def test_what_is_refused(tmp_path, changed, error, message):
    path = write_minimax_gguf(tmp_path / "bad.gguf", hf_model(), **changed)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_serves_concurrent_requests_with_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    path = write_minimax_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "Lily", "The little dog ran to the park and saw"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(family, tmp_path):
    hf, _ = family
    path = write_minimax_gguf(tmp_path / "minimax.gguf", hf)
    check_run_and_show(hf, path, "minimax-01")
    # one softmax layer x 2 KV heads x 16 features x keys and values x 4 bytes x 8192
    check_show(path, "minimax-01", 2 * 16 * 2 * 4 * 8192, moe=True)


@pytest.mark.parametrize("layer_types", [LAYERS, None], ids=["listed", "default"])
def test_show_counts_the_kv_cache_of_the_softmax_layers_alone(layer_types):
    """inspect's torch-free count is the model's own (one or four softmax layers)."""
    from llmrun.loading.inspect import kv_cache_bytes
    from llmrun.models import kv_cache_bytes as allocated

    config = {**MINIMAX, "layer_types": layer_types}
    for context in (1, 12, 8192):
        assert kv_cache_bytes(config, context) == allocated(config, context)
    attending = 1 if layer_types else 4
    assert kv_cache_bytes(config, 8192) == attending * 2 * 16 * 2 * 4 * 8192

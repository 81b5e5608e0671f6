"""IBM Bamba against transformers' BambaForCausalLM, from a config.json (BambaConfig's
names, the checkpoint's feed_forward, pre_ff_layernorm and final_layernorm renamed at the
loader edge) and from a "granitehybrid" GGUF written as llama.cpp's converter writes
BambaForCausalLM (conversion/granite.py GraniteHybridModel over mamba.py Mamba2Model:
head_count_kv per layer, 0 for a Mamba-2 layer; A_log stored as -exp(A_log) [heads, 1];
D [heads, 1]; the convolution squeezed to [channels, d_conv]; the gated norm's weight as
[n_groups, inner / n_groups]; dt_bias as ssm_dt.bias; q/k rows permuted as Llama's over
whole heads; rope.scaling.finetuned true; the rotated width, attn_rotary_emb, as
rope.dimension_count; no muP scale keys).

The tiny model: 4 layers (Mamba-2, attention, Mamba-2, Mamba-2), 8 Mamba heads of 16 in
2 groups of B/C with a state of 16, a kernel of 4; heads of 16 of which the first 8
rotate (transformers' partial_rotary_factor 0.5 for every Bamba).

Its features each move the logits by far more than the tolerance: RoPE on half of each
head (not all of it), and which layers attend (attn_layer_indices).

llama.cpp's reading differs: its "normal" RoPE over rope.dimension_count features of
rows permuted over the whole head turns row i with row head_dim / 2 + i, where
transformers turns row i with row rotary_dim / 2 + i (emulated below: the logits move by
units). llmrun undoes the permutation and computes transformers' Bamba.

Tolerances: f32 logits 1e-4 max abs against transformers: whole, through the cache
(prefills in chunks, then one token at a time), padded rows in scattered cache rows,
serve's paged blocks with a state row; serve's scheduler and `llmrun run` print
transformers' greedy text. A Q8_0 GGUF (its projections Q8_0, the small
Mamba-2 tensors F32 as llama.cpp keeps them) against transformers on the dequantized
weights: 1e-4. An f16 or bf16 KV cache: 1e-5 against an f32 cache holding the rounded
values, drifting from f32 by less than DRIFT.
"""

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
from family_checks import hf_model_of as hf_model_from
from gguf import Keys
from helpers import BASE, _permute, cached_logits, our_model, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import ModelFormatError
from llmrun.loading import bamba, gguf_io, inspect
from llmrun.loading.loader import load_model
from llmrun.models import granitemoehybrid, kv_cache_bytes
from llmrun.models.bamba import ModelArgs
from llmrun.models.base import rotate_pairs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
BAMBA = dict(
    BASE,
    model_type="bamba",
    num_hidden_layers=4,
    attn_layer_indices=[1],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    rope_theta=10000.0,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.2e-2, bf16 3.0e-2.
DRIFT = {"f16": 3e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """The tiny random BambaForCausalLM (f32, eval; vocabulary of 512)."""
    return hf_model_from({**BAMBA, **overrides})


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    """llmrun's model of `hf` from its config and state dict, renamed as the loader
    renames a Bamba checkpoint's."""
    return our_model(hf.config.to_dict(), bamba.hf_weights(hf.state_dict()))


# GGUF tensor names of a layer's Bamba tensors (after "model.layers.N.").
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "pre_ff_layernorm.weight": "ffn_norm.weight",
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
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.final_layernorm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# What llama.cpp quantizes: the projections and the output, not the small Mamba-2
# tensors (nor, here, the embeddings); and those matrices' transformers names.
_KEEP_F32 = ("token_embd", "ssm_conv1d", "ssm_norm", "ssm_a", "ssm_d")
_QUANTIZED = ("_proj.weight", "lm_head.weight")


def write_bamba_gguf(path, hf, qtype=None, rope_dims=None):
    """hf as llama.cpp's converter writes BambaForCausalLM: GraniteHybridModel's keys
    (GraniteMoeModel's with no scale keys, head_count_kv per layer, the SSM keys,
    rope.scaling.finetuned true, rope.dimension_count the rotated width), the Mamba-2
    tensors in llama.cpp's shapes, q/k rows permuted as Llama's, the projections in
    `qtype` (default F32). rope_dims: another rotated width."""
    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    inner = config.mamba_expand * config.hidden_size
    attending = config.attn_layer_indices
    keys = {
        Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        Keys.LLM.FEED_FORWARD_LENGTH: config.intermediate_size,
        Keys.LLM.VOCAB_SIZE: config.vocab_size,
        Keys.Attention.HEAD_COUNT: config.num_attention_heads,
        Keys.Attention.HEAD_COUNT_KV: [
            config.num_key_value_heads if i in attending else 0
            for i in range(config.num_hidden_layers)
        ],
        Keys.Attention.LAYERNORM_RMS_EPS: config.rms_norm_eps,
        Keys.Rope.FREQ_BASE: config.rope_parameters["rope_theta"],
        Keys.Rope.DIMENSION_COUNT: rope_dims or head_dim // 2,  # attn_rotary_emb
        Keys.Rope.SCALING_FINETUNED: True,
        Keys.SSM.CONV_KERNEL: config.mamba_d_conv,
        Keys.SSM.STATE_SIZE: config.mamba_d_state,
        Keys.SSM.GROUP_COUNT: config.mamba_n_groups,
        Keys.SSM.INNER_SIZE: inner,
        Keys.SSM.TIME_STEP_RANK: config.mamba_n_heads,
    }
    heads = {
        "self_attn.q_proj.weight": config.num_attention_heads,
        "self_attn.k_proj.weight": config.num_key_value_heads,
    }
    tensors = {}
    for name, t in hf.state_dict().items():
        t = t.float()
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = t.numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mamba.A_log":
            t = -torch.exp(t).reshape(-1, 1)
        elif rest == "mamba.D":
            t = t.reshape(-1, 1)
        elif rest == "mamba.conv1d.weight":
            t = t.squeeze(1)
        elif rest == "mamba.norm.weight":
            t = t.reshape(config.mamba_n_groups, inner // config.mamba_n_groups)
        elif rest in heads:
            t = torch.from_numpy(_permute(t.numpy(), heads[rest]))
        tensors[f"blk.{layer}.{_NAMES[rest]}"] = t.contiguous().numpy()
    return write_keyed_gguf(path, "granitehybrid", keys, tensors, qtype, keep_f32=_KEEP_F32)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """Another attention layer (llmrun follows it), and RoPE over whole heads: each
    changes the logits by far more than the tolerance."""
    hf, expected = family
    other = hf_model(attn_layer_indices=[2])
    assert max_diff(reference(other), expected) > 0.1
    assert max_diff(cached_logits(ours(other), IDS), reference(other)) < 1e-4
    monkeypatch.setattr("llmrun.models.bamba.PARTIAL_ROTARY_FACTOR", 1.0)
    assert max_diff(cached_logits(ours(hf), IDS), expected) > 0.1


def test_the_config_maps_onto_granite_4_0_h():
    args = ModelArgs.from_config(BAMBA)
    assert args.layer_types == ["mamba", "attention", "mamba", "mamba"]
    assert args.position_embedding_type == "rope" and args.num_local_experts == 0
    assert args.rope_parameters["partial_rotary_factor"] == 0.5
    assert (args.embedding_multiplier, args.residual_multiplier, args.logits_scaling) == (1, 1, 1)
    with pytest.raises(ModelFormatError, match="attn_layer_indices \\[4\\]"):
        ModelArgs.from_config({**BAMBA, "attn_layer_indices": [4]})


def test_padded_rows_in_scattered_slots_keep_their_own_state(family):
    hf, _ = family
    check_padded_rows_in_scattered_slots(
        ours(hf), lambda ids: reference(hf, ids), IDS, padding_repeats=True
    )


def test_serves_from_paged_blocks_with_a_state_row(family):
    hf, expected = family
    model = ours(hf)
    states = model.new_cache(3, 1, "f32", "cpu").recurrent
    check_paged_with_a_state_row(model, IDS, expected, states)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_or_native_decode_step(family):
    check_no_static_decode(ours(family[0]))


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    # Only the attention layer caches keys and values (what show counts).
    per_position = 2 * BAMBA["num_key_value_heads"] * 16 * 4
    assert kv_cache_bytes(hf.config.to_dict(), 10) == per_position * 10
    assert inspect.describe(tmp_path / "hf")["kv_cache_bytes_8k"] == per_position * 8192


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_bamba_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "granitemoehybrid"
    assert config["layer_types"] == ["mamba", "attention", "mamba", "mamba"]
    assert config["position_embedding_type"] == "rope"
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_llama_cpps_reading_of_the_file_is_another_model(family, tmp_path, monkeypatch):
    """llama.cpp's reading, emulated: the file's permuted rows as they are, adjacent
    pairs of the first rope.dimension_count features turned (rotate_pairs). It moves the
    logits by units from transformers', which llmrun's reading matches (above)."""
    hf, expected = family
    path = write_bamba_gguf(tmp_path / "m.gguf", hf)
    monkeypatch.setattr(gguf_io, "unpermute_rows", lambda rows, heads: rows)
    monkeypatch.setattr(
        granitemoehybrid.Attention, "rotate", lambda self, x, frame: rotate_pairs(x, frame)
    )
    llama_cpp = load_model(path, CPU, "f32").model
    assert max_diff(cached_logits(llama_cpp, IDS), expected) > 1


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_bamba_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(_QUANTIZED):
                blocks = gguf.quants.quantize(p.numpy(), q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, q8)))
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, write_bamba_gguf(tmp_path / "bamba.gguf", hf), "granitehybrid")
    check_run_and_show(hf, save_hf_dir(hf, tmp_path / "hf", tokenizer=True), "bamba")


def test_served_requests_equal_transformers_greedy_text(family, tmp_path):
    """serve's scheduler with two state rows and more requests than rows, of different
    lengths: each request's greedy text is transformers' for its prompt alone."""
    hf, _ = family
    path = write_bamba_gguf(tmp_path / "served.gguf", hf)
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)

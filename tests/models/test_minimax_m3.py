"""MiniMax-M3 (text) against transformers' MiniMaxM3VLForCausalLM: from config.json-style
dicts with the Hub checkpoint's weights (block_sparse_moe.experts.N.w1/w2/w3, the shared
expert and dense layers' gate_proj/up_proj, self_attn.index_*), from a multimodal Hub
folder (its text_config and language_model.* weights, the vision tower left out), and
from "minimax-m3" GGUFs written as llama.cpp's converter writes them (conversion/minimax.py
MiniMaxM3Model: MiniMaxM2Model's keys and stacked experts, expert_shared_count,
expert_weights_scale, expert_weights_norm, the indexer's keys, leading_dense_block_count,
every *norm.weight stored as 1 + w).

The tiny models attend sparsely from the ninth token on (blocks of 4, top 2 blocks, 40
tokens), so the indexer's choice shapes the logits; each feature is checked to move them
by far more than the tolerance (test_each_feature_changes_the_logits).

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time) or serve's paged blocks. A Q8_0 GGUF is
held to transformers running the dequantized weights at 1e-4. Cache types are held to an
f32 cache holding the rounded values (test_cache_types).

transformers reads no rotary_dim (it turns whole heads unless partial_rotary_factor is
given); MiniMax's checkpoints and llama.cpp turn rotary_dim of each head, which llmrun
follows: the reference is given partial_rotary_factor.
"""

import copy

import numpy as np
import pytest
import torch
from family_checks import check_paged, check_rounded_cache, check_run_and_show, write_keyed_gguf
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, our_model, randomize
from moe_helpers import save_hub_dir

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
configuration = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")

CPU = torch.device("cpu")
SPARSE, DENSE = "minimax_m3_sparse", "full_attention"
# MiniMax-M3's shape, small: a leading dense layer (dense attention and feed-forward),
# then sparse attention with experts; heads of 16 of which 8 turn.
MINIMAX = dict(
    BASE,
    model_type="minimax_m3_vl_text",
    num_hidden_layers=3,
    head_dim=16,
    rotary_dim=8,
    partial_rotary_factor=0.5,
    intermediate_size=32,
    dense_intermediate_size=64,
    shared_intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=[DENSE, SPARSE, SPARSE],
    mlp_layer_types=["dense", "sparse", "sparse"],
    index_n_heads=2,
    index_head_dim=16,
    index_block_size=4,
    index_topk_blocks=2,
    index_local_blocks=1,
)
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers MiniMax-M3 text model with random weights, selection biases
    large enough to change the experts chosen."""
    config = {k: v for k, v in {**MINIMAX, **overrides}.items() if k != "model_type"}
    torch.manual_seed(0)
    model = modeling.MiniMaxM3VLForCausalLM(configuration.MiniMaxM3VLTextConfig(**config))
    randomize(model.eval())
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.normal_(0, 0.5)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights under the Hub checkpoint's keys, which transformers renames on load
    (conversion_mapping.py "minimax_m3_vl"): one key per expert and projection, gate and
    up apart, the MoE block as block_sparse_moe, the indexer as self_attn.index_*."""
    out = {}
    for key, value in model.state_dict().items():
        key = key.replace(".self_attn.indexer.", ".self_attn.index_")
        if ".mlp.experts." in key:
            head = key.split(".mlp.")[0] + ".block_sparse_moe.experts"
            for e, matrix in enumerate(value):
                if key.endswith("gate_up_proj"):
                    gate, up = matrix.chunk(2)
                    out[f"{head}.{e}.w1.weight"], out[f"{head}.{e}.w3.weight"] = gate, up
                else:
                    out[f"{head}.{e}.w2.weight"] = matrix.clone()
            continue
        key = key.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        if (
            ".mlp.gate." in key
            or ".mlp.shared_experts." in key
            or key.endswith(".mlp.e_score_correction_bias")
        ):
            key = key.replace(".mlp.", ".block_sparse_moe.")
        if key.endswith("gate_up_proj.weight"):
            gate, up = value.chunk(2)
            out[key.replace("gate_up_proj", "gate_proj")] = gate.clone()
            out[key.replace("gate_up_proj", "up_proj")] = up.clone()
            continue
        out[key] = value
    return out


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


LAYOUTS = {
    "leading dense": {},
    "all sparse": {"layer_types": [SPARSE] * 3, "mlp_layer_types": ["sparse"] * 3},
    "all dense attention": {"layer_types": [DENSE] * 3},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_transformers_whole_and_through_the_cache(layout):
    hf = hf_model(**LAYOUTS[layout])
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(model, IDS) - expected).abs().max() < 1e-4


CHANGED = {
    "sparse attention": {"index_topk_blocks": 100},
    "local blocks": {"index_local_blocks": 0},
    "two local blocks": {"index_local_blocks": 2},
    "routed scaling": {"routed_scaling_factor": 1.0},
    "swiglu limit": {"swiglu_limit": 0.5},
    "swiglu alpha": {"swiglu_alpha": 1.0},
}


@pytest.mark.parametrize("feature", [*CHANGED, "shared expert", "selection bias", "(1 + w) norms"])
def test_each_feature_changes_the_logits(feature):
    """Each feature, changed in the reference (same weights otherwise), moves the logits
    by far more than the parity tolerance: the parity tests check every one."""
    hf = hf_model()
    if feature in CHANGED:
        changed = hf_model(**CHANGED[feature])
        changed.load_state_dict(hf.state_dict())
    else:
        changed = copy.deepcopy(hf)
        with torch.no_grad():
            for name, p in [*changed.named_parameters(), *changed.named_buffers()]:
                if feature == "shared expert" and "shared_experts.down_proj" in name:
                    p.zero_()
                elif feature == "selection bias" and name.endswith("e_score_correction_bias"):
                    p.zero_()
                elif feature == "(1 + w) norms" and name.endswith("norm.weight"):
                    p.add_(1.0)  # as if x * w
    assert (reference(changed) - reference(hf)).abs().max() > 0.1


def test_paged_cache_gives_the_contiguous_logits():
    """serve's paged KV cache (test_paged.py's checks)."""
    hf = hf_model()
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type: the logits of an f32 cache holding the rounded values."""
    check_rounded_cache(ours(hf_model()), cache_type, moves=False)


def test_the_native_and_static_decode_steps_are_not_attached():
    from llmrun import static_decode

    model = ours(hf_model())
    assert model.decode_step is None
    assert not static_decode.supported(model, model.new_cache(1, 64, torch.float32, "cpu"))


def test_a_multimodal_hub_folder_runs_its_language_model(tmp_path):
    """config.json as MiniMaxAI writes it: model_type minimax_m3_vl, the text model's
    fields in text_config with the indexer's in sparse_attention_config and the layer
    kinds as moe_layer_freq / sparse_attention_freq; weights under language_model.model.,
    the vision tower's and the projector's left out."""
    hf = hf_model()
    text = {
        k: v
        for k, v in MINIMAX.items()
        if not k.startswith("index_") and k not in ("layer_types", "mlp_layer_types")
    }
    text.update(
        moe_layer_freq=[0, 1, 1],
        sparse_attention_config=dict(
            sparse_attention_freq=[0, 1, 1],
            sparse_num_index_heads=2,
            sparse_index_dim=16,
            sparse_block_size=4,
            sparse_topk_blocks=2,
            sparse_local_block=1,
        ),
    )
    config = {"model_type": "minimax_m3_vl", "text_config": text}
    state = {}
    for key, value in hub_state_dict(hf).items():
        state["language_model." + key] = value.contiguous()
    state["vision_tower.vision_model.pre_layrnorm.weight"] = torch.ones(8)
    state["patch_merge_mlp.linear_1.weight"] = torch.ones(8, 8)
    state["language_model.model.mtp.layers.0.weight"] = torch.ones(8)  # ignored, as transformers
    folder = save_hub_dir(tmp_path / "hf", config, state)
    loaded = load_model(folder, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_more_indexer_heads_than_kv_heads_are_refused():
    from llmrun.models import model_module

    with pytest.raises(UnsupportedError, match="indexer heads"):
        model_module("minimax_m3").ModelArgs.from_config({**MINIMAX, "index_n_heads": 4})


# ---- GGUF, as llama.cpp's converter writes "minimax-m3" --------------------------------

# The checkpoint's layer tensors -> llama.cpp's (the experts stacked apart).
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.index_q_proj": "indexer.q_proj",
    "self_attn.index_k_proj": "indexer.k_proj",
    "self_attn.index_q_norm": "indexer.q_norm",
    "self_attn.index_k_norm": "indexer.k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.shared_experts.gate_proj": "ffn_gate_shexp",
    "block_sparse_moe.shared_experts.up_proj": "ffn_up_shexp",
    "block_sparse_moe.shared_experts.down_proj": "ffn_down_shexp",
}
INDEXER = "{arch}.attention.indexer."
EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """GGUF name -> array as the converter writes it: norms as 1 + w, experts stacked
    [E, rows, cols], the selection bias as exp_probs_b.bias, rows as they are."""
    state = hub_state_dict(hf)
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"] + 1.0,
        "output.weight": state["lm_head.weight"],
    }
    for i in range(hf.config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for name, gguf in GGUF_NAMES.items():
            value = state.get(f"{layer}{name}.weight")
            if value is not None:
                out[f"blk.{i}.{gguf}.weight"] = value + 1.0 if name.endswith("norm") else value
        bias = state.get(f"{layer}block_sparse_moe.e_score_correction_bias")
        if bias is not None:
            out[f"blk.{i}.exp_probs_b.bias"] = bias
            for w, gguf in EXPERTS.items():
                stack = [
                    state[f"{layer}block_sparse_moe.experts.{e}.{w}.weight"]
                    for e in range(hf.config.num_local_experts)
                ]
                out[f"blk.{i}.{gguf}.weight"] = torch.stack(stack)
    return {k: v.detach().float().numpy() for k, v in out.items()}


def minimax_keys(c) -> dict:
    """The "{arch}" keys MiniMaxM3Model writes (TextModel's, MiniMaxM2Model's, its own)."""
    L, A, R = Keys.LLM, Keys.Attention, Keys.Rope
    dense = c.mlp_layer_types.index("sparse")
    return {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.dense_intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.num_local_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GATING_FUNC: 2,  # ExpertGatingFuncType.SIGMOID
        A.KEY_LENGTH: c.head_dim,
        A.VALUE_LENGTH: c.head_dim,
        L.EXPERT_FEED_FORWARD_LENGTH: c.intermediate_size,
        R.DIMENSION_COUNT: c.rotary_dim,
        L.EXPERT_SHARED_COUNT: c.shared_intermediate_size // c.intermediate_size,
        L.EXPERT_WEIGHTS_SCALE: float(c.routed_scaling_factor),
        L.EXPERT_WEIGHTS_NORM: True,
        # Keys.Attention.Indexer's (block_size and local_blocks newer than this gguf).
        INDEXER + "head_count": c.index_n_heads,
        INDEXER + "key_length": c.index_head_dim,
        INDEXER + "top_k": c.index_topk_blocks,
        INDEXER + "block_size": c.index_block_size,
        INDEXER + "local_blocks": c.index_local_blocks,
        L.LEADING_DENSE_BLOCK_COUNT: dense,
    }


def write_minimax(path, hf, qtype=None, metadata=None):
    keys = {**minimax_keys(hf.config), **(metadata or {})}
    return write_keyed_gguf(path, "minimax-m3", keys, gguf_tensors(hf), qtype)


def test_a_minimax_m3_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_minimax(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "minimax_m3"
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Every matrix but the router in Q8_0; the reference holds the same rounded values."""
    import gguf

    hf = hf_model()
    path = write_minimax(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                rounded = gguf.quants.dequantize(gguf.quants.quantize(p.detach().numpy(), q8), q8)
                p.copy_(torch.from_numpy(rounded.reshape(p.shape)))
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


REFUSED = {
    "softmax gating": ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError),
    "weights not renormalized": ({Keys.LLM.EXPERT_WEIGHTS_NORM: False}, UnsupportedError),
    "no indexer top k": ({INDEXER + "top_k": None}, ModelFormatError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_minimax(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_counts_the_cached_indexer_keys(tmp_path):
    """3 layers of keys and values: 2 heads of 16 features and the indexer's 16, f32."""
    from family_checks import check_show

    path = write_minimax(tmp_path / "m.gguf", hf_model())
    check_show(path, "minimax-m3", 3 * 2 * 2 * 32 * 4 * 8192, moe=True)
    model = load_model(path, CPU, "f32").model
    assert model.new_cache(1, 8192, torch.float32, "cpu").nbytes == 3 * 2 * 2 * 32 * 4 * 8192


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model()
    path = write_minimax(tmp_path / "m.gguf", hf)
    check_run_and_show(hf, path, "minimax-m3")


def test_an_fp8_multimodal_release_is_refused(tmp_path):
    quantized = dict(quant_method="fp8", fmt="float8_e4m3fn", weight_block_size=[128, 128])
    text = {k: v for k, v in MINIMAX.items()}
    config = {"model_type": "minimax_m3_vl", "text_config": text, "quantization_config": quantized}
    state = {"language_model." + k: v for k, v in hub_state_dict(hf_model()).items()}
    folder = save_hub_dir(tmp_path / "hf", config, state)
    with pytest.raises(UnsupportedError, match="fp8 checkpoints are not supported"):
        load_model(folder, CPU, "f32")

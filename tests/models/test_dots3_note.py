"""Dots 3 Note (llmrun/models/dots3_note.py) against transformers' Dots3NoteForCausalLM:
from the config transformers saves and from the released config.json's own names
(swa_*, use_dsa, sliding_window_size, swa_rope_theta, ...), a Hub folder with a
multi-token-prediction layer and the towers the language model does not run, and
"dots3note" GGUFs written as llama.cpp's converter writes them (conversion/dots3.py:
deepseek2's MLA split into attn_k_b and attn_v_b in each layer's own shapes, stacked
experts, head_count per layer, the sliding layers' *_swa sizes, the window and its
per-layer flags, the indexer's sizes and per-layer flags, the latents' scale folded
into the q_a and kv_a norms).

The tiny model has six layers: indexed layers 0, 1 and 5 (index_topk 6 of 40 tokens,
eight indexer heads: with fewer, ties at a score of 0 make the top-k choice depend on
the keys' layout), sliding layers 2-4 (window 5) with their own heads, LoRA rank, head
sizes and RoPE base. Tolerances: 1e-4 on logits within about ±6 in f32 (measured
~8e-6), whole, through the KV cache (chunked prefill, then one token at a time), the
paged cache and GGUFs (Q8_0 held to transformers on the dequantized weights). Cache
types are held to an f32 cache of the rounded values (1e-5, test_cache_types' check).
Each of the family's features is shown to move the logits past 0.1 when taken out.
"""

import json
import math

import gguf
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
from test_deepseek import IDS, hub_state_dict, q8_0, routed_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import dots3, inspect
from llmrun.loading.loader import load_model
from llmrun.models import dots3_note, kv_cache_bytes
from llmrun.models.base import RotaryEmbedding
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.dots3_note")

# transformers' Dots3NoteTextConfig of the released config.json's names: layers 0, 1
# and 5 indexed, 2-4 sliding.
CONFIG = dict(
    model_type="dots3_note_text",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,  # llama.cpp's: the routed experts' width
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    routed_scaling_factor=2.5,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    head_dim=64,
    index_topk=6,
    index_n_heads=8,
    index_head_dim=64,  # an indexed layer caches 32 + 32 + 64, Q8_0's blocks of 32
    swa_num_attention_heads=2,
    swa_num_key_value_heads=2,
    swa_q_lora_rank=32,
    swa_kv_lora_rank=64,  # a sliding layer caches 64 + 32
    swa_head_dim=48,
    swa_qk_nope_head_dim=16,
    swa_v_head_dim=16,
    sliding_window_size=5,
    rope_theta=10000.0,
    swa_rope_theta=20.0,  # far from 10000: RoPE within a window of 5 shows it
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# What the released config.json says beside those (conversion/dots3.py checks them).
RELEASED = dict(
    model_type="dots3_note",
    use_dsa=True,
    apply_mla_qkv_lora_rescale=True,
    k_rope_only_layernorm=True,
    attention_gate_type="headwise",
    swa_attention_gate_type="headwise",
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    first_k_dense_replace=1,
    moe_layer_freq=1,
    norm_topk_prob=True,
    layer_types=["full_attention"] * 2 + ["sliding_attention"] * 3 + ["full_attention"],
)


def hf_model(**overrides):
    """The tiny transformers model (f32, eval) of CONFIG with `overrides`: test_deepseek's
    routed weights (smaller attention outputs, drawn selection biases)."""
    return routed_model({**CONFIG, **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours_of(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


def whole_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


# index_topk 12: the first prefill chunks attend to every key and cache the indexer's
# keys the later ones choose among; 36: so do the first decode steps.
@pytest.mark.parametrize("topk", [6, 12, 36])
def test_matches_transformers_whole_and_through_the_cache(topk):
    hf = hf_model(index_topk=topk)
    expected = reference(hf)
    ours = ours_of(hf)
    assert (whole_logits(ours) - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(ours, IDS) - expected).abs().max() < 1e-4


def test_without_dsa_the_global_layers_attend_to_every_key():
    """use_dsa false (the released names): "full_attention" layers, no indexer."""
    hf = hf_model(use_dsa=False)
    assert (
        "full_attention" in hf.config.layer_types and hf.model.layers[0].self_attn.indexer is None
    )
    ours = ours_of(hf)
    assert all(layer.self_attn.indexer is None for layer in ours.model.layers)
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() < 1e-4


def test_shared_experts_of_their_own_width():
    hf = hf_model(moe_shared_expert_intermediate_size=48)
    assert hf.model.layers[1].mlp.shared_experts.gate_proj.weight.shape == (48, 64)
    assert (cached_logits(ours_of(hf), IDS) - reference(hf)).abs().max() < 1e-4


def test_the_released_config_names_give_transformers_model():
    hf = hf_model()
    released = {**CONFIG, **RELEASED}
    args = dots3_note.ModelArgs.from_config(released)
    assert args.layer_types == hf.config.layer_types
    assert args.mlp_layer_types == hf.config.mlp_layer_types
    ours = our_model(released, hub_state_dict(hf))
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() < 1e-4


def switch_off(model, feature: str) -> None:
    """Take `feature` out of our model (its weights kept)."""
    args = model.args
    if feature == "sliding window":
        args.sliding_window = 10**6
    elif feature == "sliding layers' RoPE base":
        model.model.rotary_emb_local = RotaryEmbedding(
            args.rope_parameters, args.qk_rope_head_dim, args.max_position_embeddings
        )
    for layer in model.model.layers:
        attention = layer.self_attn
        indexer = attention.indexer
        if feature == "indexer":  # attend to every key
            attention.topk = 10**6
        elif feature == "indexer rope layout" and indexer is not None:
            indexer.pairs = False
        elif feature == "latent scale":
            attention.q_a_layernorm.scale = attention.kv_a_layernorm.scale = 1.0
        elif feature == "rope key norm":
            attention.rope_key = lambda k_rope: k_rope
        elif feature == "head gate":
            attention.gated_output = lambda out, x: out


FEATURES = [
    "indexer",
    "indexer rope layout",
    "latent scale",
    "rope key norm",
    "head gate",
    "sliding window",
    "sliding layers' RoPE base",
]


# Each feature, taken out of our model (same weights otherwise), moves its logits 500 times
# the parity tolerance or more, so the parity tests above check every one of them.
@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_changes_the_logits(feature):
    hf = hf_model()
    ours = ours_of(hf)
    switch_off(ours, feature)
    assert (whole_logits(ours) - reference(hf)).abs().max() > 0.05
    assert (cached_logits(ours, IDS) - reference(hf)).abs().max() > 0.05


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"apply_mla_qkv_lora_rescale": False}, UnsupportedError, "apply_mla_qkv_lora_rescale"),
        ({"attention_gate_type": "elementwise"}, UnsupportedError, "attention_gate_type"),
        ({"k_rope_only_layernorm": False}, UnsupportedError, "k_rope_only_layernorm"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedError, "yarn"),
        ({"per_layer_config": {"2": {"sliding_window": 9}}}, UnsupportedError, "sliding_window"),
        ({"layer_types": ["indexed_attention"] * 5}, ModelFormatError, "layer_types"),
        ({"swa_num_key_value_heads": 1}, ModelFormatError, "num_key_value_heads"),
        ({"n_shared_experts": 0}, ModelFormatError, "shared expert"),
    ],
)
def test_configs_it_cannot_run_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        dots3_note.ModelArgs.from_config({**CONFIG, **RELEASED, **change})


# ---- caches ------------------------------------------------------------------------------


def test_the_paged_cache_gives_transformers_logits(monkeypatch):
    hf = hf_model()
    check_paged(ours_of(hf), IDS, reference(hf), windowed="dots3_note", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys(cache_type):
    ours = ours_of(hf_model())
    f16 = cache_type == "f16"
    check_rounded_cache(ours, cache_type, TOLERANCE["f16"] if f16 else None, moves=f16)


def test_each_layer_caches_its_latent_in_its_own_width():
    hf = hf_model()
    cache = ours_of(hf).new_cache(1, 10, torch.float32, "cpu")
    widths = [cache.layer_shape(i) for i in range(6)]
    assert widths == [(1, 128)] * 2 + [(1, 96)] * 3 + [(1, 128)]
    assert cache.v is cache.k
    for config in (hf.config.to_dict(), {**CONFIG, **RELEASED}):
        assert kv_cache_bytes(config, 10) == cache.nbytes
        assert inspect.kv_cache_bytes(config, 10) == cache.nbytes
    # The sliding layers keep their window where the cache is longer.
    assert ours_of(hf).new_cache(1, 64, torch.float32, "cpu").ring_layers[2:5] == (True,) * 3


def test_the_native_decode_step_and_the_static_one_are_not_offered():
    """Neither knows MLA, per-layer cache widths or the indexer: Dots 3 Note decodes
    through its forward."""
    from llmrun import static_decode

    ours = ours_of(hf_model())
    assert not decode_step.attach(ours)
    assert ours.decode_step is None
    assert not static_decode.supported(ours, ours.new_cache(1, 64, torch.float32, "cpu"))


# ---- Hub folders -------------------------------------------------------------------------


def test_a_released_hub_folder_loads_its_language_model(tmp_path):
    """The released layout: the text config at the top level (model_type dots3_note),
    the towers and a multi-token-prediction layer beside the language model."""
    from safetensors.torch import save_file

    hf = hf_model()
    folder = tmp_path / "hf"
    folder.mkdir()
    state = {k: v.contiguous() for k, v in hub_state_dict(hf).items()}
    state.update({
        "vision_encoder.blocks.0.attn.qkv.weight": torch.zeros(6, 4),
        "audio_encoder.audio_adapter.proj.0.weight": torch.zeros(4),
        "model.mtp.embed_tokens.weight": torch.zeros(4, 4),
        "model.layers.6.eh_proj.weight": torch.zeros(4, 8),
    })  # fmt: skip
    save_file(state, str(folder / "model.safetensors"))
    config = {**CONFIG, **RELEASED, "vision_config": {}, "audio_config": {}}
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder, torch.device("cpu"), "f32")
    assert loaded.checkpoint.notes and "language model only" in loaded.checkpoint.notes[0]
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="fp8 checkpoints are not supported"):
        load_model(folder, torch.device("cpu"), "f32")


def test_a_multimodal_folder_of_transformers_names_loads_its_language_model(tmp_path):
    """Dots3NoteForConditionalGeneration's layout: the text config as text_config, the
    language model under model.language_model.*, the towers beside it."""
    from safetensors.torch import save_file

    hf = hf_model()
    folder = tmp_path / "hf"
    folder.mkdir()
    state = {
        k if k.startswith("lm_head.") else k.replace("model.", "model.language_model.", 1): v
        for k, v in hub_state_dict(hf).items()
    }
    state["model.vision_tower.blocks.0.attn.qkv.weight"] = torch.zeros(6, 4)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    text = {k: v for k, v in hf.config.to_dict().items() if k != "tie_word_embeddings"}
    config = {"model_type": "dots3_note", "text_config": text, "vision_config": {}}
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    loaded = load_model(folder, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "dots3_note_text"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_transformers_saved_folder_loads(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", torch.device("cpu"), "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


# ---- GGUF, as llama.cpp's converter writes "dots3note" -----------------------------------

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.k_rope_only_layernorm": "attn_k_norm",
    "self_attn.g_proj": "attn_gate",
    "self_attn.o_proj": "attn_output",
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


def gguf_tensors(hf, mtp: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> array as the converter writes the model: the latents' scale folded
    into their norms, kv_b_proj split per layer in its own shapes, experts stacked; with
    `mtp`, an MTP block after the last layer (which the converter keeps)."""
    c = hf.config
    out = {}
    for key, value in hf.state_dict().items():
        data = value.float().numpy()
        if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
            out[f"{name.get(key.rpartition('.')[0], 'output')}.weight"] = data
            continue
        _, _, layer, rest = key.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        attention = hf.model.layers[int(layer)].self_attn
        if module == "self_attn.q_a_layernorm":  # conversion/dots3.py's lora rescale
            data = data * math.sqrt(c.hidden_size / attention.q_lora_rank)
        elif module == "self_attn.kv_a_layernorm":
            data = data * math.sqrt(c.hidden_size / attention.kv_lora_rank)
        if rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = data
        elif rest == "mlp.experts.gate_up_proj":
            width = data.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :width]
            out[f"blk.{layer}.ffn_up_exps.weight"] = data[:, width:]
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = data
        elif module == "self_attn.kv_b_proj":
            nope, v_dim = attention.qk_nope_head_dim, attention.v_head_dim
            kv_b = data.reshape(attention.num_heads, nope + v_dim, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = kv_b[:, :nope].transpose(0, 2, 1)
            out[f"blk.{layer}.attn_v_b.weight"] = kv_b[:, nope:]
        else:
            out[f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"] = data
    if mtp:
        last, hidden = c.num_hidden_layers, c.hidden_size
        for name, shape in (("nextn.eh_proj.weight", (hidden, 2 * hidden)),
                            ("attn_norm.weight", (hidden,))):  # fmt: skip
            out[f"blk.{last}.{name}"] = np.zeros(shape, np.float32)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def gguf_keys(hf, mtp: bool = False) -> dict:
    """The "{arch}" keys the converter writes for the model, from the released
    config.json's fields (TextModel's, deepseek2's and dots3's own)."""
    c, L, A, R = hf.config, Keys.LLM, Keys.Attention, Keys.Rope
    sliding = [kind == "sliding_attention" for kind in c.layer_types]
    # Each kind's attention sizes, as its layers have them.
    full = hf.model.layers[sliding.index(False)].self_attn
    swa = hf.model.layers[sliding.index(True)].self_attn
    rope = full.qk_rope_head_dim
    if c.moe_intermediate_size != c.shared_experts_intermediate_size:
        raise ValueError("llama.cpp's dots3note has shared experts of the routed ones' width")
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers + int(mtp),
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: [swa.num_heads if s else full.num_heads for s in sliding]
        + [swa.num_heads] * int(mtp),  # the MTP block is sliding-shaped
        A.HEAD_COUNT_KV: 1,  # MLA written as MQA
        R.FREQ_BASE: float(c.rope_parameters["indexed_attention"]["rope_theta"]),
        R.FREQ_BASE_SWA: float(c.rope_parameters["sliding_attention"]["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.EXPERT_COUNT: c.n_routed_experts,
        L.EXPERT_USED_COUNT: c.num_experts_per_tok,
        L.EXPERT_GATING_FUNC: 2,  # scoring_func sigmoid
        L.LEADING_DENSE_BLOCK_COUNT: c.mlp_layer_types.index("sparse"),
        L.VOCAB_SIZE: c.vocab_size,
        A.Q_LORA_RANK: full.q_lora_rank,
        A.KV_LORA_RANK: full.kv_lora_rank,
        A.KEY_LENGTH: full.kv_lora_rank + rope,
        A.VALUE_LENGTH: full.kv_lora_rank,
        A.KEY_LENGTH_MLA: full.qk_nope_head_dim + rope,
        A.VALUE_LENGTH_MLA: full.v_head_dim,
        L.EXPERT_FEED_FORWARD_LENGTH: c.moe_intermediate_size,
        L.EXPERT_SHARED_COUNT: c.n_shared_experts,
        L.EXPERT_WEIGHTS_SCALE: float(c.routed_scaling_factor),
        L.EXPERT_WEIGHTS_NORM: True,
        R.DIMENSION_COUNT: rope,
        A.SLIDING_WINDOW: c.sliding_window,
        A.SLIDING_WINDOW_PATTERN: sliding,
        dots3.KV_LORA_RANK_SWA: swa.kv_lora_rank,
        A.KEY_LENGTH_SWA: swa.kv_lora_rank + rope,
        A.VALUE_LENGTH_SWA: swa.kv_lora_rank,
        dots3.KEY_LENGTH_MLA_SWA: swa.qk_nope_head_dim + rope,
        dots3.VALUE_LENGTH_MLA_SWA: swa.v_head_dim,
        A.Indexer.HEAD_COUNT: c.index_n_heads,
        A.Indexer.KEY_LENGTH: c.index_head_dim,
        A.Indexer.TOP_K: c.index_topk,
        dots3.INDEXER_TYPES: [not s for s in sliding],
    }
    if mtp:
        keys[L.NEXTN_PREDICT_LAYERS] = 1
    return keys


def write_dots3_note_gguf(path, hf_model, qtype=None, metadata=None, mtp: bool = False):
    """A "dots3note" GGUF of `hf_model` as llama.cpp's converter writes it, with the
    metadata llama.cpp's loader requires (`metadata` changed; None leaves a key out) and
    stories260K's vocabulary; matrices in `qtype` (default F32) where their rows are whole
    blocks of it (the rest F32, as the converter falls back); returns `path`."""
    keys = {**gguf_keys(hf_model, mtp), **(metadata or {})}
    tensors = gguf_tensors(hf_model, mtp)
    return write_keyed_gguf(path, dots3.ARCH, keys, tensors, qtype, whole_blocks=True)


def round_as_q8_0_gguf(hf) -> None:
    """Round `hf`'s weights in place as a Q8_0 GGUF of it holds them: each matrix but the
    router whose rows are whole blocks, kv_b_proj's key part as attn_k_b's transposed
    rows."""
    block = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]

    def rounded(x: np.ndarray) -> np.ndarray:
        return q8_0(x) if x.shape[-1] % block == 0 else x

    state = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if "kv_b_proj" in key:
            attention = hf.model.layers[int(key.split(".")[2])].self_attn
            nope = attention.qk_nope_head_dim
            kv_b = data.reshape(attention.num_heads, nope + attention.v_head_dim, -1)
            k = rounded(kv_b[:, :nope].transpose(0, 2, 1)).transpose(0, 2, 1)
            data = np.concatenate([k, rounded(kv_b[:, nope:])], axis=1).reshape(data.shape)
        elif data.ndim > 1 and not key.endswith("mlp.gate.weight"):
            data = rounded(data)
        state[key] = torch.from_numpy(np.ascontiguousarray(data))
    hf.load_state_dict(state)


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_dots3_note_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"), "f32")
    config = loaded.checkpoint.config
    assert (
        config["model_type"] == "dots3_note_text" and config["layer_types"] == hf.config.layer_types
    )
    assert loaded.model.decode_step is None
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_gguf_with_its_multi_token_prediction_block_runs_the_trunk(tmp_path):
    hf = hf_model()
    path = write_dots3_note_gguf(tmp_path / "m.gguf", hf, mtp=True)
    loaded = load_model(path, torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["num_hidden_layers"] == 6
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    hf = hf_model()
    path = write_dots3_note_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    loaded = load_model(path, torch.device("cpu"), "f32")
    round_as_q8_0_gguf(hf)
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "metadata,error,match",
    [
        ({Keys.LLM.EXPERT_GATING_FUNC: None}, ModelFormatError, "expert_gating_func"),
        ({Keys.LLM.EXPERT_GATING_FUNC: 1}, UnsupportedError, "sigmoid-gated"),
        ({dots3.KV_LORA_RANK_SWA: None}, ModelFormatError, "kv_lora_rank_swa"),
        ({Keys.Attention.SLIDING_WINDOW_PATTERN: None}, ModelFormatError, "sliding_window_pattern"),
        ({dots3.INDEXER_TYPES: [False] * 6}, UnsupportedError, "neither sliding"),
        ({Keys.Rope.FREQ_BASE_SWA: None}, ModelFormatError, "freq_base_swa"),
    ],
)
def test_a_gguf_it_cannot_run_as_llama_cpp_does_is_refused(tmp_path, metadata, error, match):
    path = write_dots3_note_gguf(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=match):
        load_model(path, torch.device("cpu"), "f32")


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together) on a
    Q8_0 file: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    path = write_dots3_note_gguf(tmp_path / "m.gguf", hf_model(), GGMLQuantizationType.Q8_0)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)


def test_llmrun_run_and_show(tmp_path):
    hf = hf_model()
    path = write_dots3_note_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)
    # One latent head a layer, f32, 8192 positions: three indexed layers of 128 and three
    # sliding ones of 96 holding their window of 5.
    check_show(path, dots3.ARCH, (3 * 128 * 8192 + 3 * 96 * 5) * 4, moe=True)


def test_show_reads_a_released_config_as_the_model_does():
    """The torch-free reading of the config (llmrun show) agrees with the model's."""
    config = {**CONFIG, **RELEASED}
    shapes, windows = dots3.cache_layout(config)
    args = dots3_note.ModelArgs.from_config(config)
    assert shapes == args.cache_shapes() and windows == args.layer_windows()

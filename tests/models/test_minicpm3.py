"""MiniCPM3 against transformers' MiniCPM3ForCausalLM: from config.json-style dicts with
its state dict, from a folder transformers saves, and from "minicpm3" GGUFs written as
llama.cpp's converter writes them (conversion/minicpm.py MiniCPM3Model: the shapes and
the two LoRA ranks, the key width and the rotated width, LongRoPE's factors as tensors,
DeepSeek-V2's tensor names, rows as they are; no RoPE base, value width or scalars).

llama.cpp's graph fixes MiniCPM's scalars at MiniCPM3-4B's (embeddings times 12,
sublayers times 1.4 / sqrt(layers), the final state times 256 / hidden) and normalizes
the attention latents with the layers' eps, where transformers takes the config's
scalars and 1e-6: the GGUF tests' reference has those scalars and an eps of 1e-6.

Features: MLA with halves rotated (not DeepSeek's pairs), the three scalars, LongRoPE,
tied or separate output matrices, q_lora_rank null (HF only: llama.cpp requires it).
Each scalar and LongRoPE move the logits by far more than the tolerance
(test_each_feature_changes_the_logits); the rotation's layout and the residual scaling
of each sublayer were checked by breaking llmrun's code: the parity tests fail.

Tolerances: f32 logits 1e-4 max abs against transformers, whole and through the KV cache
(chunked prefill, then one token at a time), contiguous, paged or in the static decode
step. A Q8_0 GGUF: 1e-4 against transformers running the weights gguf dequantizes.
Cache types: test_cache_types' checks.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_show,
    check_static_decode,
    dequantize_2d_weights,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, our_model, randomize
from test_cache_types import TOLERANCE

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ARCH = "minicpm3"
CONFIG = dict(
    model_type="minicpm3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    scale_emb=4.0,
    scale_depth=2.0,
    dim_model_base=16,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# What llama.cpp's graph computes: MiniCPM3-4B's scalars, the latents' eps the layers'.
LLAMA_CPP = dict(scale_emb=12.0, scale_depth=1.4, dim_model_base=256, rms_norm_eps=1e-6)


def longrope(original: int) -> dict:
    """LongRoPE over the 8 rotated features, pretrained on `original` positions."""
    return {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": [1.0 + 2.0 * i for i in range(4)],
            "short_factor": [1.0 + 0.5 * i for i in range(4)],
            "original_max_position_embeddings": original,
        }
    }


IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny transformers MiniCPM3 (vocab 512, f32, eval) with randomize()'s weights."""
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


VARIANTS = {
    "separate head": {},
    "tied head": {"tie_word_embeddings": True},
    "no query LoRA": {"q_lora_rank": None},
    "LongRoPE, long factors": longrope(32),  # 40 tokens outgrow 32
    "default scalars": {"scale_depth": None, "dim_model_base": None, "scale_emb": 1},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_whole_and_through_the_cache(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time (a cache of 64 positions:
    # LongRoPE's long factors for all of them, as transformers takes them for 40 tokens).
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


# Each feature of the family, switched off in the reference (same weights otherwise):
# the logits move by far more than the parity tolerance, so the parity tests above
# check every one of them.
FEATURES = {
    "scale_emb": {"scale_emb": 1.0},
    "scale_depth": {"scale_depth": None},
    "dim_model_base": {"dim_model_base": None},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(feature):
    with_feature, without = hf_model(), hf_model(**FEATURES[feature])
    load_matching_weights(with_feature, without)
    assert max_diff(reference(without), reference(with_feature)) > 0.1


def test_longrope_changes_the_logits():
    with_feature, without = hf_model(**longrope(32)), hf_model()
    load_matching_weights(with_feature, without)
    assert max_diff(reference(without), reference(with_feature)) > 0.1


def test_a_partial_rotary_factor_is_refused():
    from llmrun.models import minicpm3

    with pytest.raises(UnsupportedError, match="partial_rotary_factor"):
        minicpm3.ModelArgs.from_config({**CONFIG, "partial_rotary_factor": 0.5})


def test_paged_cache_gives_the_contiguous_logits():
    """serve's paged KV cache, as every family is held to (tests/models/test_paged.py):
    one latent head a token."""
    hf = hf_model()
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_give_the_logits_of_their_rounded_keys_and_values(cache_type):
    """--cache-type, as test_cache_types holds every family to; a latent of 24 + 8
    features, whole q8_0 blocks."""
    check_rounded_cache(ours(hf_model(kv_lora_rank=24)), cache_type, TOLERANCE[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(monkeypatch):
    """A dense family: CUDA graphs' static step applies (run eager here)."""
    check_static_decode(ours(hf_model()), monkeypatch)


def test_a_saved_folder_loads(tmp_path):
    hf = hf_model(**longrope(32))
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None  # not a family the native step knows
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


# ---- GGUF, as llama.cpp's converter writes "minicpm3" -------------------------------------

GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def minicpm3_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> array: DeepSeek-V2's names, rows as they are, no output matrix where
    it is the embedding's, LongRoPE's factors as rope_factors_long/short."""
    out = {}
    tied = model.config.tie_word_embeddings
    for key, value in model.state_dict().items():
        module, _, suffix = key.rpartition(".")
        if module == "lm_head" and tied:
            continue
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            name = f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"
        else:
            name = f"{GGUF_NAMES[module]}.{suffix}"
        out[name] = value.float().numpy()
    rope = model.config.rope_parameters
    if rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def minicpm3_keys(config) -> dict:
    """The "{arch}" keys llama.cpp's converter writes for the config
    (MiniCPM3Model.set_gguf_parameters)."""
    c, L, A, R = config, Keys.LLM, Keys.Attention, Keys.Rope
    return {
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.FEED_FORWARD_LENGTH: c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        A.HEAD_COUNT_KV: c.num_key_value_heads,
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        L.VOCAB_SIZE: c.vocab_size,
        A.Q_LORA_RANK: c.q_lora_rank,
        A.KV_LORA_RANK: c.kv_lora_rank,
        A.KEY_LENGTH: c.qk_nope_head_dim + c.qk_rope_head_dim,
        R.DIMENSION_COUNT: c.qk_rope_head_dim,
    }


def write_minicpm3_gguf(path, hf_model, qtype=None, metadata=None):
    """A minicpm3 GGUF of `hf_model` as llama.cpp's converter writes it: its metadata
    (with `metadata` changed; None leaves a key out), its tensors, 2-D ones in `qtype`
    (default F32), stories260K's tokenizer."""
    keys = {**minicpm3_keys(hf_model.config), **(metadata or {})}
    return write_keyed_gguf(path, ARCH, keys, minicpm3_tensors(hf_model), qtype)


GGUF_VARIANTS = {
    "separate head": {},
    "tied head": {"tie_word_embeddings": True},
    # MiniCPM3-4B's: pretrained on the whole context, so the short factors.
    "LongRoPE": longrope(CONFIG["max_position_embeddings"]),
}


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_a_minicpm3_gguf_matches_transformers(tmp_path, variant):
    hf = hf_model(**LLAMA_CPP, **GGUF_VARIANTS[variant])
    loaded = load_model(write_minicpm3_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "minicpm3"
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_reads_llama_cpps_scalars_not_the_configs(tmp_path):
    """The file of a model with other scalars runs with llama.cpp's (its graph's
    constants): the reference of llama.cpp's scalars, not the model's own."""
    hf = hf_model(rms_norm_eps=1e-6)
    path = write_minicpm3_gguf(tmp_path / "m.gguf", hf)
    as_llama_cpp = hf_model(**LLAMA_CPP)
    load_matching_weights(hf, as_llama_cpp)
    logits = cached_logits(load_model(path, CPU, "f32").model, IDS)
    assert max_diff(logits, reference(as_llama_cpp)) < 1e-4
    assert max_diff(logits, reference(hf)) > 0.1


def test_a_gguf_normalizes_the_latents_with_the_layers_eps(tmp_path):
    """llama.cpp's q_a/kv_a norms take rms_norm_eps (1e-2 here, which moves the logits),
    transformers' 1e-6: the file runs as llama.cpp runs it."""
    hf = hf_model(**{**LLAMA_CPP, "rms_norm_eps": 1e-2})
    with torch.no_grad():
        for layer in hf.model.layers:  # latents small enough for the eps to matter
            layer.self_attn.q_a_proj.weight.mul_(0.02)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(0.02)
    expected = reference(hf)
    for layer in hf.model.layers:
        layer.self_attn.q_a_layernorm.variance_epsilon = 1e-2
        layer.self_attn.kv_a_layernorm.variance_epsilon = 1e-2
    path = write_minicpm3_gguf(tmp_path / "m.gguf", hf)
    logits = cached_logits(load_model(path, CPU, "f32").model, IDS)
    assert max_diff(logits, reference(hf)) < 1e-4
    assert max_diff(logits, expected) > 1e-2


def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(tmp_path):
    hf = hf_model(**LLAMA_CPP)
    path = write_minicpm3_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    dequantize_2d_weights(hf, GGMLQuantizationType.Q8_0)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


REFUSED = {
    "no query LoRA rank": ({Keys.Attention.Q_LORA_RANK: None}, ModelFormatError),
    "no key/value LoRA rank": ({Keys.Attention.KV_LORA_RANK: None}, ModelFormatError),
    "every feature rotated": ({Keys.Rope.DIMENSION_COUNT: 24}, ModelFormatError),
    "YaRN": ({Keys.Rope.SCALING_TYPE: "yarn", Keys.Rope.SCALING_FACTOR: 4.0}, UnsupportedError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = REFUSED[case]
    path = write_minicpm3_gguf(tmp_path / "m.gguf", hf_model(**LLAMA_CPP), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_describes_a_minicpm3_gguf(tmp_path):
    path = write_minicpm3_gguf(tmp_path / "m.gguf", hf_model(**LLAMA_CPP))
    # One latent head of 32 + 8 features a token and layer, in f32, stored once.
    check_show(path, ARCH, 3 * (32 + 8) * 4 * 8192)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(**LLAMA_CPP)
    check_run_prints_greedy_tokens(hf, write_minicpm3_gguf(tmp_path / "m.gguf", hf))

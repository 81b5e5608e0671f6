"""Phi-1/1.5/2 against transformers' PhiForCausalLM, from a config.json and from a
"phi2" GGUF written as llama.cpp's converter writes it (conversion/phi.py Phi2Model:
context, embedding and feed-forward (4 * hidden) lengths, head counts, the LayerNorms'
epsilon, rope.dimension_count, no RoPE base; separate attn_q/k/v from transformers'
checkpoints, or one attn_qkv from the original ones' mixer.Wqkv).

Its features each move the logits by far more than the tolerance (asserted below): the
parallel block, the partial rotation, the q/k LayerNorms, lm_head's bias; the other
biases and the LayerNorms' are weights the model must take.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import base, phi
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
PHI = dict(
    model_type="phi",
    hidden_size=64,
    intermediate_size=256,  # 4 * hidden: the feed-forward length the converter writes
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # the converter writes head_count_kv = head_count
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    max_position_embeddings=256,
    layer_norm_eps=1e-5,
    partial_rotary_factor=0.5,  # 8 of each head's 16 features rotate
    hidden_act="gelu_new",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1e-3, bf16 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random PhiForCausalLM (f32, eval), PHI with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**PHI, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping for phi2).
_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.dense": "attn_output",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
    # Not phi2's: the converter refuses these; a file made by hand may carry them.
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
}
_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.final_layernorm": "output_norm",
    "lm_head": "output",
}


def gguf_tensor_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def write_phi_gguf(path, hf, qtype=None, fused=False, **keys):
    """The model as llama.cpp's converter writes Phi-2: Phi2Model's keys, the tensors
    unpermuted, 2-D weights in `qtype` (default F32). `fused`: q, k and v as one
    attn_qkv (weight and bias), as the converter writes an original checkpoint's
    mixer.Wqkv. `keys`: metadata to change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    n_embd, n_head = config.hidden_size, config.num_attention_heads
    rot_pct = config.rope_parameters["partial_rotary_factor"]
    metadata = {
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": n_embd,
        "{arch}.feed_forward_length": 4 * n_embd,
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_head,
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_eps),
        "{arch}.rope.dimension_count": int(rot_pct * n_embd) // n_head,
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    tensors = {
        gguf_tensor_name(name): t.detach().float().numpy() for name, t in hf.state_dict().items()
    }
    if fused:
        for layer in range(config.num_hidden_layers):
            for suffix in ("weight", "bias"):
                parts = [tensors.pop(f"blk.{layer}.attn_{p}.{suffix}") for p in "qkv"]
                tensors[f"blk.{layer}.attn_qkv.{suffix}"] = np.concatenate(parts)
    return write_keyed_gguf(path, "phi2", metadata, tensors, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


@pytest.mark.parametrize("variant", [{}, {"qk_layernorm": True}, {"partial_rotary_factor": 0.4}])
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**variant)
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """The partial rotation (against whole heads), the q/k LayerNorms, lm_head's bias and
    the parallel block (against a sequential one, in llmrun) each change the logits by
    far more than the tolerance."""
    hf, expected = family
    for variant in (dict(partial_rotary_factor=1.0), dict(qk_layernorm=True)):
        other = hf_model(**variant)
        assert max_diff(reference(other), expected) > 0.1, variant
        assert max_diff(cached_logits(ours(other), IDS), reference(other)) < 1e-4, variant
    model = ours(hf)
    with torch.no_grad():
        model.lm_head.bias.zero_()
    assert max_diff(cached_logits(model, IDS), expected) > 0.1

    def sequential(self, x, frame, cache):
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.input_layernorm(x))

    monkeypatch.setattr(phi.DecoderLayer, "forward", sequential)
    assert max_diff(cached_logits(ours(hf), IDS), expected) > 0.1


def test_a_config_without_partial_rotary_factor_rotates_half_of_each_head(family):
    """transformers' PhiConfig default (0.5), where config.json says nothing."""
    config = {k: v for k, v in family[0].config.to_dict().items() if k != "partial_rotary_factor"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    args = phi.ModelArgs.from_config(config)
    assert args.rope_parameters["partial_rotary_factor"] == 0.5
    assert base.RotaryEmbedding(args.rope_parameters, args.head_dim, 256).rotary_dim == 8


def test_a_config_of_the_older_style_reads_the_same():
    """rope_theta and partial_rotary_factor at the top level, as microsoft/phi-2 has them."""
    config = {k: v for k, v in hf_model().config.to_dict().items() if k != "rope_parameters"}
    config.update(rope_theta=10000.0, partial_rotary_factor=0.4)
    args = phi.ModelArgs.from_config(config)
    assert args.rope_parameters["partial_rotary_factor"] == 0.4


@pytest.mark.parametrize("fused", [False, True], ids=["separate-qkv", "fused-qkv"])
def test_a_gguf_matches_transformers(family, fused, tmp_path):
    hf, expected = family
    path = write_phi_gguf(tmp_path / "m.gguf", hf, fused=fused)
    assert ("blk.0.attn_qkv.weight" in read_gguf(path, with_tensors=False).tensors) == fused
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "phi" and not config["tie_word_embeddings"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["separate-qkv", "fused-qkv"])
def test_a_q8_0_gguf_matches_its_dequantized_weights(fused, tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    loaded = load_model(write_phi_gguf(tmp_path / "q.gguf", hf, q8, fused=fused), CPU, "f32")
    dequantize_2d_weights(hf, q8)  # rows of q, k, v quantize alike fused or not
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_a_rope_dimension_count_rotates_whole_heads(tmp_path):
    """llama.cpp's n_rot is the head width where the file gives none."""
    hf = hf_model(partial_rotary_factor=1.0)
    path = write_phi_gguf(tmp_path / "m.gguf", hf, **{"{arch}.rope.dimension_count": None})
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(tmp_path):
    hf = hf_model(qk_layernorm=True)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "phi"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """The native step knows no parallel block or partial rotation: the loader leaves
    Phi to the torch layers."""
    loaded = load_model(write_phi_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(ours(family[0]))


def test_q_k_norms_in_a_gguf_are_refused(family, tmp_path):
    """llama.cpp's phi2 has no q/k norm tensors (the converter cannot write them)."""
    path = write_phi_gguf(tmp_path / "m.gguf", hf_model(qk_layernorm=True))
    with pytest.raises(UnsupportedError, match="no q/k norms"):
        load_model(path, CPU, "f32")


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.attention.key_length": 8}, UnsupportedError, "hidden size / heads"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_phi_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_a_fused_qkv_of_the_wrong_height_is_refused(family, tmp_path):
    path = write_phi_gguf(
        tmp_path / "m.gguf", family[0], fused=True, **{"{arch}.attention.head_count_kv": 2}
    )
    with pytest.raises(ModelFormatError, match="attn_qkv of layer 0 has 192 rows"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_phi_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_phi2_gguf(family, tmp_path):
    path = write_phi_gguf(tmp_path / "m.gguf", family[0], fused=True)
    # Two layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    check_show(path, "phi2", 2 * 2 * 4 * 16 * 4 * 8192)

"""Mixture-of-experts GGUF files written as llama.cpp's converter writes them (experts
stacked in ffn_{gate,up,down}_exps, Mixtral as arch llama with expert_count, its
expert metadata keys) load to transformers' logits, in every weight type.

Tolerances: F32 files vs transformers 1e-4 max abs. Quantized files vs the same
weights dequantized by gguf's numpy code and written as F32: float reassociation,
1e-4 x max |logit|, in a prompt (experts grouped; more than 16 rows an expert: the
dequantized-tile GEMM) and one token at a time (the native matvec per expert).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import Keys
from moe_helpers import (
    F16_SCALES,
    MOE_CONFIGS,
    hub_state_dict,
    quantized_and_dequantized,
    stacked_gguf_state,
    tiny_moe_model,
    write_moe_gguf,
)

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model, open_checkpoint

pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 2, 44, 501, 7, 8, 99, 123]])
POSITIONS = torch.arange(IDS.shape[1])[None]


def logits(path, ids=IDS):
    model = load_model(path, CPU, "f32").model
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        full = model(ids, positions)
        cache = model.new_cache(1, ids.shape[1], torch.float32, "cpu")
        split = ids.shape[1] - 4
        steps = [model(ids[:, :split], positions[:, :split], cache)]
        steps += [
            model(ids[:, t : t + 1], positions[:, t : t + 1], cache)
            for t in range(split, ids.shape[1])
        ]
    return full, torch.cat(steps, dim=1)


def gguf_of(name: str, tmp_path, **overrides):
    hf, config = tiny_moe_model(name, **overrides)
    tensors = stacked_gguf_state(hub_state_dict(hf, config["model_type"]), config)
    return hf, config, tensors


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_f32_gguf_matches_transformers(name, tmp_path):
    hf, config, tensors = gguf_of(name, tmp_path)
    path = write_moe_gguf(tmp_path / "m.gguf", config, tensors)
    checkpoint = open_checkpoint(path)
    assert checkpoint.config["model_type"] == config["model_type"]
    with torch.no_grad():
        expected = hf(IDS).logits
    full, cached = logits(path)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(cached, expected, atol=1e-4, rtol=0)


def test_mixtral_gguf_is_llama_with_experts(tmp_path):
    """llama.cpp writes Mixtral as arch llama (q/k rows permuted) plus expert_count."""
    _, config, tensors = gguf_of("mixtral", tmp_path)
    checkpoint = open_checkpoint(write_moe_gguf(tmp_path / "m.gguf", config, tensors))
    assert checkpoint.gguf.architecture == "llama"
    got = checkpoint.config
    assert (got["model_type"], got["num_local_experts"], got["num_experts_per_tok"]) == (
        "mixtral",
        8,
        2,
    )
    # Each expert a 2-D view of the stacked tensor's bytes: no copy.
    stack = checkpoint.weights["model.layers.0.block_sparse_moe.experts.0.w1.weight"].tensor
    other = checkpoint.weights["model.layers.0.block_sparse_moe.experts.3.w1.weight"].tensor
    assert stack.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
    assert other.data_ptr() - stack.data_ptr() == 3 * stack.nbytes


def assert_reassociation_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(expected).all()
    tolerance = 1e-4 * expected.abs().max().item()
    assert (got - expected).abs().max().item() <= tolerance


# Every width a multiple of 256, as K-quants need; 4 of 8 experts a token, so a prompt
# of 48 tokens gives each expert about 24 rows (the GEMM path).
QUANT_SHAPE = dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=4)
LONG_IDS = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("type_name", sorted(F16_SCALES) + ["F16", "BF16"])
def test_expert_blocks_of_every_type_give_their_dequantized_logits(type_name, tmp_path):
    """Experts in a type (the rest F32) give the logits of the same model with
    the experts' blocks dequantized by gguf's numpy code."""
    ggml_type = T[type_name]
    hf, config, tensors = gguf_of("qwen3_moe", tmp_path, **QUANT_SHAPE)
    if ggml_type == T.BF16:
        types, stacks = {}, [n for n in tensors if "_exps" in n]
        tensors = {n: (v.bfloat16().float() if n in stacks else v) for n, v in tensors.items()}
        quantized = {
            n: (v.bfloat16().view(torch.int16).numpy().view(np.uint8), T.BF16) if n in stacks else v
            for n, v in tensors.items()
        }
        dequantized = tensors
    else:
        types = {"_exps": ggml_type}
        quantized, dequantized = quantized_and_dequantized(tensors, types, np.random.default_rng(0))
    q = write_moe_gguf(tmp_path / "q.gguf", config, quantized)
    ref = write_moe_gguf(tmp_path / "ref.gguf", config, dequantized)
    for got, expected in zip(logits(q, LONG_IDS), logits(ref, LONG_IDS), strict=True):
        assert_reassociation_close(got, expected)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_mixed_types_per_tensor(name, tmp_path):
    """As in Q4_K_M files: each stack its own type (down in Q6_K, gate and up in
    Q4_K), Q8_0 attention, a Q8_0 router in one layer and an F16 one in the other;
    the shared expert (Qwen2-MoE) in Q5_0."""
    hf, config, tensors = gguf_of(
        name,
        tmp_path,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    )
    types = {
        "ffn_gate_exps": T.Q4_K,
        "ffn_up_exps": T.Q4_K,
        "ffn_down_exps": T.Q6_K,
        "blk.0.ffn_gate_inp.": T.Q8_0,
        "blk.1.ffn_gate_inp.": T.F16,
        "shexp": T.Q5_0,
        "attn_": T.Q8_0,
        "token_embd": T.Q4_0,
        "output.": T.Q6_K,
    }
    quantized, dequantized = quantized_and_dequantized(tensors, types, np.random.default_rng(1))
    q = write_moe_gguf(tmp_path / "q.gguf", config, quantized)
    ref = write_moe_gguf(tmp_path / "ref.gguf", config, dequantized)
    checkpoint = open_checkpoint(q)
    weight_types = checkpoint.weight_types
    assert {"Q4_K", "Q6_K", "Q8_0", "F16"} <= set(weight_types)
    for got, expected in zip(logits(q, LONG_IDS), logits(ref, LONG_IDS), strict=True):
        assert_reassociation_close(got, expected)


def test_quantized_experts_are_not_read_at_load(tmp_path):
    """The experts stay views of the mapped file, in its layout (never repacked, even
    where the kernels have a packed layout for the type)."""
    _, config, tensors = gguf_of("qwen3_moe", tmp_path, **QUANT_SHAPE)
    quantized, _ = quantized_and_dequantized(tensors, {"_exps": T.Q4_K}, np.random.default_rng(0))
    loaded = load_model(write_moe_gguf(tmp_path / "q.gguf", config, quantized), CPU, "f32")
    buffer = loaded.checkpoint.gguf.buffer
    base = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
    expert = loaded.model.model.layers[1].mlp.experts[5].down_proj
    assert not expert.packed
    assert 0 <= expert.weight.data_ptr() - base < len(buffer)


def rewrite(tmp_path, name="qwen3_moe", tensors_change=None, **kwargs):
    _, config, tensors = gguf_of(name, tmp_path)
    if tensors_change:
        tensors = tensors_change(tensors)
    return write_moe_gguf(tmp_path / "bad.gguf", config, tensors, **kwargs)


@pytest.mark.parametrize(
    "case,kwargs,error,message",
    [
        ("used > count", dict(metadata={Keys.LLM.EXPERT_USED_COUNT: 17}), ModelFormatError,
         "qwen3moe.expert_used_count is 17, but qwen3moe.expert_count is 16"),
        ("no count", dict(skip_keys=(Keys.LLM.EXPERT_COUNT,)), ModelFormatError,
         "qwen3moe.expert_count is missing or 0"),
        ("sigmoid", dict(metadata={Keys.LLM.EXPERT_GATING_FUNC: 2}), UnsupportedError,
         "qwen3moe.expert_gating_func is sigmoid; qwen3moe experts are gated by softmax"),
        ("unknown gating", dict(metadata={Keys.LLM.EXPERT_GATING_FUNC: 9}), UnsupportedError,
         "qwen3moe.expert_gating_func is 9 (unknown)"),
        ("scale", dict(metadata={Keys.LLM.EXPERT_WEIGHTS_SCALE: (2.5, "float32")}),
         UnsupportedError, "qwen3moe.expert_weights_scale is 2.5"),
        ("one expert short", dict(tensors_change=lambda t: {
            k: (v[:-1] if k == "blk.1.ffn_up_exps.weight" else v) for k, v in t.items()}),
         ModelFormatError, "tensor 'blk.1.ffn_up_exps.weight' has shape [15, 32, 64], but "
         "expert_count is 16: it should hold [16 experts, rows, columns]"),
        ("2-D", dict(tensors_change=lambda t: {
            k: (v[0] if k == "blk.0.ffn_down_exps.weight" else v) for k, v in t.items()}),
         ModelFormatError, "tensor 'blk.0.ffn_down_exps.weight' has shape [64, 32]"),
        ("wrong width", dict(tensors_change=lambda t: {
            k: (v[:, :16] if k == "blk.0.ffn_gate_exps.weight" else v) for k, v in t.items()}),
         ModelFormatError, "tensor 'blk.0.ffn_gate_exps.weight' has experts of shape [16, 64], "
         "but the metadata implies [32, 64]"),
        ("missing stack", dict(tensors_change=lambda t: {
            k: v for k, v in t.items() if k != "blk.1.ffn_gate_exps.weight"}),
         ModelFormatError, "tensor 'blk.1.ffn_gate_exps.weight' is missing"),
    ],
)  # fmt: skip
def test_bad_expert_metadata_and_tensors(case, kwargs, error, message, tmp_path):
    path = rewrite(tmp_path, **kwargs)
    with pytest.raises(error) as raised:
        load_model(path, CPU, "f32")
    assert message in str(raised.value)
    assert str(path) in str(raised.value)


def test_mixtral_without_renormalization_refused(tmp_path):
    path = rewrite(tmp_path, "mixtral", metadata={Keys.LLM.EXPERT_WEIGHTS_NORM: (False, "bool")})
    with pytest.raises(UnsupportedError, match="llama.expert_weights_norm is false"):
        open_checkpoint(path)


def test_expert_weights_norm_key_sets_norm_topk_prob(tmp_path):
    """qwen2moe defaults to plain top-k weights and qwen3moe to renormalized ones, as
    llama.cpp computes them; an expert_weights_norm key says otherwise."""
    for name, default in [("qwen2_moe", False), ("qwen3_moe", True)]:
        assert open_checkpoint(rewrite(tmp_path, name)).config["norm_topk_prob"] is default
        changed = rewrite(
            tmp_path, name, metadata={Keys.LLM.EXPERT_WEIGHTS_NORM: (not default, "bool")}
        )
        assert open_checkpoint(changed).config["norm_topk_prob"] is (not default)

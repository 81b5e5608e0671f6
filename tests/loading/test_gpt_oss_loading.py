"""gpt-oss from every file it comes in, against transformers: a directory transformers
saves (fused float experts), one as OpenAI ships it on the Hub (MXFP4 expert blocks and
scales), and GGUF files as llama.cpp's converter writes them (experts split and stacked,
F32 or MXFP4, with llama.cpp's metadata; what a GGUF cannot carry taken as llama.cpp
takes it).

Tolerances: 1e-4 max abs against transformers in float32 (with MXFP4 experts:
transformers holding gguf's dequantization of the same blocks), in a prompt (experts
grouped, more than 16 rows an expert: the dequantized-tile GEMM) and one token at a time
(a token's experts in two native calls, biases and the clamped SwiGLU between them).
"""

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import Keys
from gpt_oss_helpers import (
    LLAMA_CPP,
    gguf_tensors,
    llmrun_state,
    save_hub_mxfp4_dir,
    tiny_gpt_oss,
    with_mxfp4_experts,
    write_gpt_oss_gguf,
)

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model, open_checkpoint
from llmrun.quant import kernels
from llmrun.quant.experts import ExpertList
from llmrun.quant.linear import QuantLinear

pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(5))


def logits(path, ids=IDS):
    """A loaded model's logits for `ids`, whole and as a prefill plus one token at a
    time in a cache whose windowed layers keep only their window."""
    model = load_model(path, CPU, "f32").model
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        full = model(ids, positions)
        cache = model.new_cache(1, 32, torch.float32, "cpu")
        split = ids.shape[1] - 6
        steps = [model(ids[:, :split], positions[:, :split], cache)]
        steps += [
            model(ids[:, t : t + 1], positions[:, t : t + 1], cache)
            for t in range(split, ids.shape[1])
        ]
    return model, full, torch.cat(steps, dim=1)


def assert_matches(path, expected):
    model, full, steps = logits(path)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(steps, expected, atol=1e-4, rtol=0)
    return model


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch, fresh_native):
    """The native kernels (this CPU's best family), and the pure-torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "supports", lambda ggml_type, n_cols, packed=False: False)
    return request.param


def test_a_directory_transformers_saves(tmp_path):
    hf, _ = tiny_gpt_oss()
    hf.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        expected = hf(IDS).logits
    assert open_checkpoint(tmp_path / "m").config["model_type"] == "gpt_oss"
    assert_matches(tmp_path / "m", expected)


def test_the_hubs_mxfp4_directory(tmp_path, kernel_path):
    hf, config = tiny_gpt_oss()
    blocks = with_mxfp4_experts(hf, config)
    path = save_hub_mxfp4_dir(tmp_path / "hub", hf, config, blocks)
    checkpoint = open_checkpoint(path)
    expert = checkpoint.weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert expert.ggml_type == T.MXFP4 and expert.shape == (32, 64)
    with torch.no_grad():
        expected = hf(IDS).logits
    model = assert_matches(path, expected)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, ExpertList) and isinstance(experts[0].gate_proj, QuantLinear)
    assert experts[0].gate_proj.ggml_type == T.MXFP4
    # The one-token path binds (MXFP4, with biases) where the kernels are in use.
    assert (experts._bind() is not None) == (
        kernel_path == "native" and kernels.supports(T.MXFP4, 64)
    )


def test_f32_gguf_as_llama_cpp_writes_it(tmp_path):
    hf, config = tiny_gpt_oss(**LLAMA_CPP)
    tensors = gguf_tensors(llmrun_state(hf, config), config)
    assert "blk.0.attn_sinks.weight" in tensors and "blk.0.ffn_gate_exps.bias" in tensors
    path = write_gpt_oss_gguf(tmp_path / "m.gguf", config, tensors)
    with torch.no_grad():
        expected = hf(IDS).logits
    assert_matches(path, expected)


def test_mxfp4_gguf_equals_the_hub_directory(tmp_path, kernel_path):
    """The same MXFP4 experts from llama.cpp's GGUF and from OpenAI's safetensors give the
    same logits, and transformers' on the dequantized weights."""
    hf, config = tiny_gpt_oss(**LLAMA_CPP)
    blocks = with_mxfp4_experts(hf, config, seed=3)
    tensors = gguf_tensors(llmrun_state(hf, config), config, blocks)
    gguf_path = write_gpt_oss_gguf(tmp_path / "m.gguf", config, tensors)
    hub = save_hub_mxfp4_dir(tmp_path / "hub", hf, config, blocks)
    with torch.no_grad():
        expected = hf(IDS).logits
    _, from_gguf, steps_gguf = logits(gguf_path)
    _, from_hub, steps_hub = logits(hub)
    for got in (from_gguf, steps_gguf, from_hub, steps_hub):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(from_gguf, from_hub, atol=1e-5, rtol=0)
    # Each expert a view of the file's stacked blocks: no copy.
    checkpoint = open_checkpoint(gguf_path)
    stack = checkpoint.gguf.tensors["blk.1.ffn_up_exps.weight"]
    first = checkpoint.weights["model.layers.1.mlp.experts.0.up_proj.weight"].tensor
    base = torch.frombuffer(checkpoint.gguf.buffer, dtype=torch.uint8, count=1).data_ptr()
    assert first.data_ptr() - base == stack.offset


def test_gguf_metadata_read_as_llama_cpp_reads_it(tmp_path):
    hf, config = tiny_gpt_oss(**LLAMA_CPP)
    tensors = gguf_tensors(llmrun_state(hf, config), config)
    # The converter writes the betas; llama.cpp reads neither (nor would llmrun).
    metadata = {Keys.Rope.SCALING_YARN_BETA_FAST: (8.0, "float32")}
    got = open_checkpoint(
        write_gpt_oss_gguf(tmp_path / "m.gguf", config, tensors, metadata=metadata)
    ).config
    assert got["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (got["sliding_window"], got["num_local_experts"], got["num_experts_per_tok"]) == (
        5,
        8,
        2,
    )
    assert (got["swiglu_alpha"], got["swiglu_limit"], got["intermediate_size"]) == (1.702, 7.0, 32)
    rope = got["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == (
        "yarn",
        8.0,
        32,
    )
    assert (rope["beta_fast"], rope["beta_slow"], rope["truncate"]) == (32.0, 1.0, True)
    assert rope["attention_factor"] == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)


def test_gguf_problems_are_refused(tmp_path):
    hf, config = tiny_gpt_oss(**LLAMA_CPP)
    tensors = gguf_tensors(llmrun_state(hf, config), config)
    path = write_gpt_oss_gguf(
        tmp_path / "a.gguf", config, tensors, skip_keys=(Keys.Attention.SLIDING_WINDOW,)
    )
    with pytest.raises(ModelFormatError, match="gpt-oss.attention.sliding_window' is missing"):
        open_checkpoint(path)
    metadata = {Keys.Rope.FREQ_BASE_SWA: (500.0, "float32")}
    path = write_gpt_oss_gguf(tmp_path / "b.gguf", config, tensors, metadata=metadata)
    with pytest.raises(UnsupportedError, match="freq_base_swa differs"):
        open_checkpoint(path)
    bad = dict(tensors)
    bad["blk.0.ffn_up_exps.bias"] = bad["blk.0.ffn_up_exps.bias"][:, :7]
    path = write_gpt_oss_gguf(tmp_path / "c.gguf", config, bad)
    with pytest.raises(ModelFormatError, match=r"ffn_up_exps.bias' is F32 \[8, 7\]"):
        open_checkpoint(path)

"""Random-weight models written as GGUF with llama.cpp's conventions load to the
same logits as their safetensors copy and as transformers.

Tolerances: F32 GGUF vs transformers 1e-4 max abs; F16 GGUF vs the same weights
in F16 safetensors, both run in f32: 1e-5 (identical weights, same arithmetic),
and vs transformers in f32 on those weights: 1e-4.
"""

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import CONFIGS, save_hf_dir, tiny_hf_model, write_gguf

from llmrun.loading.loader import load_model

pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 2, 44, 501]])
POSITIONS = torch.arange(IDS.shape[1])[None]


def logits(path, dtype="f32"):
    with torch.no_grad():
        return load_model(path, CPU, dtype).model(IDS, POSITIONS)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "llama3-scaled"])
def test_gguf_f32_matches_transformers_and_safetensors(name, tmp_path):
    hf, config = tiny_hf_model(name)
    with torch.no_grad():
        expected = hf(IDS).logits
    gguf_path = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    hf_dir = save_hf_dir(hf, tmp_path / "hf")
    if name != "phi3-longrope":  # llama.cpp writes longrope factors as tensors; see below
        torch.testing.assert_close(logits(gguf_path), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits(hf_dir), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3"])
def test_gguf_f16_matches_f16_safetensors(name, tmp_path):
    hf, config = tiny_hf_model(name)
    hf.half().float()  # weights exactly representable in f16, so both files hold the same values
    gguf_path = write_gguf(tmp_path / "m.gguf", config, hf.state_dict(), GGMLQuantizationType.F16)
    hf_dir = save_hf_dir(hf, tmp_path / "hf", dtype=torch.float16)
    torch.testing.assert_close(logits(gguf_path), logits(hf_dir), atol=1e-5, rtol=0)
    # Half weights stay half on the CPU (native kernels, f32 arithmetic): the
    # logits are transformers' f32 logits of the same (f16-exact) weights.
    with torch.no_grad():
        expected = hf(IDS).logits
    torch.testing.assert_close(logits(gguf_path), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
def test_quantized_gguf_matches_its_dequantized_weights(qtype, tmp_path):
    """A Q8_0/Q4_0 GGUF gives the logits of the same model with weights dequantized
    by gguf's own numpy code (1e-4 max abs), and stays near the f32 model."""
    import gguf

    hf, config = tiny_hf_model("llama")
    state = hf.state_dict()
    dequantized = {
        k: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), qtype), qtype))
        if v.dim() == 2
        else v
        for k, v in state.items()
    }
    quant = logits(write_gguf(tmp_path / "q.gguf", config, state, qtype))
    reference = logits(write_gguf(tmp_path / "deq.gguf", config, dequantized))
    torch.testing.assert_close(quant, reference, atol=1e-4, rtol=0)
    f32 = logits(write_gguf(tmp_path / "f32.gguf", config, state))
    # Logits span about ±4 here; 8-bit blocks move them by ~0.01, 4-bit by ~0.3.
    bound = {GGMLQuantizationType.Q8_0: 0.05, GGMLQuantizationType.Q4_0: 0.8}[qtype]
    assert (quant - f32).abs().max() < bound


def test_llama3_rope_factors_from_rope_freqs_tensor(tmp_path):
    """llama.cpp stores Llama 3.1 RoPE scaling as per-frequency divisors (rope_freqs)."""
    import gguf
    import numpy as np

    from llmrun.models.base import RotaryEmbedding, rope_parameters

    hf, config = tiny_hf_model("llama3-scaled")
    rope = RotaryEmbedding(rope_parameters(config), 16, 256)
    plain = RotaryEmbedding({"rope_type": "default", "rope_theta": 500000.0}, 16, 256)
    factors = (plain.inv_freq / rope.inv_freq).numpy().astype(np.float32)
    path = tmp_path / "m.gguf"
    plain_config = {**config, "rope_parameters": {"rope_theta": 500000.0}}
    state = dict(hf.state_dict())
    write_gguf(path, plain_config, state)
    # Re-write with the rope_freqs tensor appended, as llama.cpp does.
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "scaled.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(
            t.name,
            np.array(t.data),
            raw_shape=list(reversed(t.shape.tolist())),
            raw_dtype=t.tensor_type,
        )
    writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        expected = hf(IDS).logits
    torch.testing.assert_close(logits(tmp_path / "scaled.gguf"), expected, atol=1e-4, rtol=0)

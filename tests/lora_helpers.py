"""LoRA adapters for the tests: PEFT (the reference implementation) around a tiny
transformers model with random non-zero A and B, saved as PEFT writes it, and the same
adapter as a GGUF written the way llama.cpp's convert_lora_to_gguf.py writes one."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import _permute, gguf_name

# Skips where peft is missing without importing it at collection (seconds in every worker).
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="no peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_PREFIX = "base_model.model."


def peft_model(hf, rank: int = 8, alpha: float = 16.0, seed: int = 1, **settings):
    """PEFT's LoRA model around a copy of `hf` (f32, eval) with A and B ~ N(0, 0.1) (PEFT
    starts B at zero, which would test nothing); `settings`: LoraConfig's other fields."""
    from peft import LoraConfig, get_peft_model

    settings.setdefault("target_modules", TARGETS)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, **settings)
    model = get_peft_model(copy.deepcopy(hf), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    return model.eval()


def peft_logits(model, ids: list[int]) -> torch.Tensor:
    """PEFT's logits [T, vocab] of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def lora_pairs(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's (A [r, in], B [out, r]) under each target's HF module name."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    pairs = {}
    for key, tensor in state.items():
        module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        a, b = pairs.get(module, (None, None))
        pairs[module] = (tensor, b) if part == "A.weight" else (a, tensor)
    return pairs


def write_gguf_lora(
    path: Path,
    model,
    config: dict,
    alpha: float,
    qtype=None,
    arch: str | None = None,
    extra: Callable | None = None,
) -> Path:
    """The adapter of PEFT `model` as convert_lora_to_gguf.py writes it for a base of
    `config`: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and each
    pair as NAME.weight.lora_a [r, in] and .lora_b [out, r] under the base's GGUF name,
    lora_b of arch llama's q and k permuted as the converter permutes the weights; 2-D
    tensors in `qtype` (default F32) where their rows are whole blocks of it, else F16 (the
    converter's fallback); `extra(writer)` adds keys of its own."""
    import gguf

    qtype = qtype or gguf.GGMLQuantizationType.F32
    model_type = config["model_type"]
    arch = arch or {"mistral": "llama"}.get(model_type, model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    if extra is not None:
        extra(writer)
    for module, (a, b) in lora_pairs(model).items():
        name = gguf_name(module + ".weight", model_type)
        b = b.float().numpy()
        if arch == "llama" and module.endswith("q_proj"):
            b = _permute(b, config["num_attention_heads"])
        elif arch == "llama" and module.endswith("k_proj"):
            b = _permute(b, config["num_key_value_heads"])
        for suffix, data in (("lora_a", a.float().numpy()), ("lora_b", b)):
            _add(writer, f"{name}.{suffix}", np.ascontiguousarray(data), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer, name: str, data: np.ndarray, qtype) -> None:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data.astype(np.float32))
        return
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == gguf.GGMLQuantizationType.F16 or data.shape[-1] % block:
        writer.add_tensor(name, data.astype(np.float16))
        return
    raw = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

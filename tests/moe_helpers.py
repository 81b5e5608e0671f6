"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): transformers
models, their weights under the Hub's per-expert checkpoint keys, and GGUF files
written as llama.cpp's converter writes them (experts stacked in 3-D tensors). For the
families whose experts transformers fuses (AFMoE, EXAONE MoE, GLM-4.5, Hunyuan V3,
Laguna, MiniMax-M2): their tensors under llama.cpp's names, and their weights rounded
as a Q8_0 GGUF holds them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from helpers import BASE, STORIES_GGUF, _permute, gguf_name, randomize

# Enough experts and tokens that every expert is chosen somewhere (tests check it).
MOE_CONFIGS = {
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        rope_theta=1000000.0,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        head_dim=32,
        norm_topk_prob=True,
        rope_theta=1000000.0,
    ),
}
# The per-expert names of the gate, up and down projections on the Hub.
EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}
# llama.cpp's names for the stacked experts, in the same order, and the rest of a block.
GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
GGUF_MOE_NAMES = {
    "gate": "ffn_gate_inp",
    "shared_expert.gate_proj": "ffn_gate_shexp",
    "shared_expert.up_proj": "ffn_up_shexp",
    "shared_expert.down_proj": "ffn_down_shexp",
    "shared_expert_gate": "ffn_gate_inp_shexp",
}
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def tiny_moe_model(name: str, seed: int = 0, **overrides):
    """A transformers model of MOE_CONFIGS[name] (and `overrides`) with helpers.randomize's
    weights but attention outputs 30x smaller, and its config dict. Attention far from
    uniform moves every token towards the few keys it favours; at full size that shared
    part makes tokens look alike to the routers, which then leave some experts unused
    (tests check that none is)."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**BASE, **MOE_CONFIGS[name], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.03})
    return model, config.to_dict()


def moe_prefix(model_type: str) -> str:
    return "block_sparse_moe" if model_type == "mixtral" else "mlp"


def hub_state_dict(model, model_type: str) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's keys: transformers 5 holds each layer's
    experts fused (experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I]); the
    published checkpoints have one key per expert and projection."""
    gate, up, down = EXPERT_NAMES[model_type]
    prefix = moe_prefix(model_type)
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition(".mlp.")
        if not sep:
            out[key] = value
        elif tail == "experts.gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}.{prefix}.experts.{e}.{gate}.weight"] = value[e, :width].clone()
                out[f"{head}.{prefix}.experts.{e}.{up}.weight"] = value[e, width:].clone()
        elif tail == "experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{head}.{prefix}.experts.{e}.{down}.weight"] = value[e].clone()
        else:
            out[f"{head}.{prefix}.{tail}"] = value
    return out


def save_hub_dir(path: Path, config: dict, state: dict, shards: int = 2) -> Path:
    """A Hugging Face directory as the Hub has it: config.json and the per-expert
    weights in `shards` safetensors files with their index."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    keys = sorted(state)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, name in enumerate(names):
        part = keys[i::shards]
        save_file({k: state[k].contiguous() for k in part}, str(path / name))
        weight_map.update({k: name for k in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def stacked_gguf_state(
    state: dict, config: dict
) -> dict[str, torch.Tensor | tuple[np.ndarray, object]]:
    """GGUF tensor name -> tensor: the experts of each layer stacked [E, rows, cols] as
    llama.cpp's converter stacks them (torch.stack over the expert index)."""
    model_type = config["model_type"]
    prefix, names = moe_prefix(model_type), EXPERT_NAMES[model_type]
    n_experts = config.get("num_local_experts") or config["num_experts"]
    out: dict = {}
    for key, value in state.items():
        if f".{prefix}." not in key:
            out[gguf_name(key)] = value
            continue
        head, _, tail = key.partition(f".{prefix}.")
        layer = head.split(".")[2]
        if tail.startswith("experts."):
            _, e, proj, _ = tail.split(".")
            if e != "0":
                continue
            stacked = torch.stack(
                [state[f"{head}.{prefix}.experts.{i}.{proj}.weight"] for i in range(n_experts)]
            )
            out[f"blk.{layer}.{GGUF_EXPERTS[names.index(proj)]}.weight"] = stacked
        else:
            module = tail.rpartition(".")[0]
            out[f"blk.{layer}.{GGUF_MOE_NAMES[module]}.weight"] = value
    return out


def write_moe_gguf(
    path: Path,
    config: dict,
    tensors: dict,
    types: dict | None = None,
    metadata: dict | None = None,
    skip_keys: tuple = (),
    arch: str | None = None,
    tokenizer: Callable | None = None,
) -> Path:
    """Write GGUF tensors (stacked_gguf_state) with llama.cpp's MoE metadata. `types`
    maps a GGUF name fragment (say "ffn_down_exps") to the type its tensors are
    quantized to (default F32; 1-D tensors stay F32); a tensor may also be given as
    (uint8 blocks, type), written as is. `metadata`: extra or replaced keys (a
    "{arch}" in a key is filled in; a value (list, "array") is an array); `skip_keys`:
    keys left out; `arch`: the GGUF architecture where it is not the model_type's;
    `tokenizer(writer)` adds the tokenizer's keys instead of stories260K's."""
    import gguf
    from gguf import Keys

    from llmrun.loading.gguf_io import read_gguf

    model_type = config["model_type"]
    arch = arch or GGUF_ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    n_experts = config.get("num_local_experts") or config["num_experts"]
    rope = config.get("rope_parameters") or {}
    expert_ff = config.get("moe_intermediate_size") or config["intermediate_size"]
    keys = {
        Keys.LLM.BLOCK_COUNT: (config["num_hidden_layers"], "uint32"),
        Keys.LLM.CONTEXT_LENGTH: (config["max_position_embeddings"], "uint32"),
        Keys.LLM.EMBEDDING_LENGTH: (config["hidden_size"], "uint32"),
        Keys.LLM.FEED_FORWARD_LENGTH: (config["intermediate_size"], "uint32"),
        Keys.Attention.HEAD_COUNT: (n_head, "uint32"),
        Keys.Attention.HEAD_COUNT_KV: (n_kv, "uint32"),
        Keys.Attention.KEY_LENGTH: (head_dim, "uint32"),
        Keys.Attention.VALUE_LENGTH: (head_dim, "uint32"),
        Keys.Attention.LAYERNORM_RMS_EPS: (config["rms_norm_eps"], "float32"),
        Keys.Rope.FREQ_BASE: (rope.get("rope_theta", 10000.0), "float32"),
        Keys.Rope.DIMENSION_COUNT: (head_dim, "uint32"),
        Keys.LLM.EXPERT_COUNT: (n_experts, "uint32"),
        Keys.LLM.EXPERT_USED_COUNT: (config["num_experts_per_tok"], "uint32"),
    }
    if model_type != "mixtral":
        keys[Keys.LLM.EXPERT_FEED_FORWARD_LENGTH] = (expert_ff, "uint32")
    if model_type == "qwen2_moe":
        keys[Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH] = (
            config["shared_expert_intermediate_size"],
            "uint32",
        )
    for key, value in (metadata or {}).items():
        keys[key] = value if isinstance(value, tuple) else (value, "uint32")
    for key, (value, kind) in keys.items():
        if key in skip_keys:
            continue
        full = key.format(arch=arch)
        if kind == "uint32":
            writer.add_uint32(full, value)
        elif kind == "float32":
            writer.add_float32(full, value)
        elif kind == "bool":
            writer.add_bool(full, value)
        elif kind == "array":
            writer.add_array(full, value)
    if tokenizer is not None:
        tokenizer(writer)
    else:
        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list(meta["tokenizer.ggml.tokens"])
        writer.add_token_scores(meta["tokenizer.ggml.scores"])
        writer.add_token_types(meta["tokenizer.ggml.token_type"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for name, tensor in tensors.items():
        qtype = next((t for frag, t in (types or {}).items() if frag in name), None)
        if isinstance(tensor, tuple):  # raw blocks [.., rows, row bytes] and their type
            raw, raw_type = tensor
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                raw = _permute(raw, n_head if ".attn_q." in name else n_kv)
            writer.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=raw_type)
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = _permute(data, n_head)
        elif arch == "llama" and ".attn_k." in name:
            data = _permute(data, n_kv)
        if data.ndim == 1 or qtype in (None, gguf.GGMLQuantizationType.F32):
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Byte offsets of the f16 scales in a block of each quantized type, and the types.
F16_SCALES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_blocks(ggml_type, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random valid blocks [.., rows, row bytes] of a quantized type for weights of
    `shape`, with small scales so they look like a model's weights."""
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_SCALES[ggml_type.name]:
        scale = np.abs(rng.standard_normal(n_blocks)) * 2e-3 + 1e-4
        raw[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], -1)


def quantized_and_dequantized(tensors: dict, types: dict, rng) -> tuple[dict, dict]:
    """GGUF tensors with those whose name holds a fragment of `types` replaced by
    random blocks of that type (float types: the weights rounded to it), and the same
    tensors dequantized by gguf's numpy code (the reference), both as write_moe_gguf
    takes them."""
    import gguf

    quantized, dequantized = {}, {}
    for name, value in tensors.items():
        ggml_type = next((t for frag, t in types.items() if frag in name), None)
        if ggml_type is None or value.dim() == 1:
            quantized[name] = dequantized[name] = value
        elif ggml_type == gguf.GGMLQuantizationType.F16:
            quantized[name] = (value.half().numpy().view(np.uint8), ggml_type)
            dequantized[name] = value.half().float()
        else:
            raw = random_blocks(ggml_type, tuple(value.shape), rng)
            quantized[name] = (raw, ggml_type)
            dequantized[name] = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type).copy())
    return quantized, dequantized


# transformers' names of a layer's modules -> llama.cpp's, as the converters of the MoE
# families with fused experts name them (a family's own names added or overriding)
MOE_LAYER_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# transformers' names of the tensors outside the layers -> llama.cpp's
GLOBAL_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def fused_experts_gguf_tensors(
    model, layer_names: dict[str, str], renamed: dict[str, str]
) -> dict[str, np.ndarray]:
    """GGUF name -> array of a transformers MoE whose experts are fused (mlp.experts.
    gate_up_proj, mlp.experts.down_proj), in llama.cpp's layout: rows as they are,
    experts stacked [E, rows, cols] (gate_up split into ffn_gate_exps and ffn_up_exps).
    A layer's parameter named in `renamed` (its name after model.layers.N.) becomes
    blk.N.<that name>; any other, blk.N.<layer_names[its module]>.<weight or bias>."""
    out = {}
    for key, value in model.state_dict().items():
        data = value.float().numpy()
        if key in GLOBAL_GGUF_NAMES:
            out[GLOBAL_GGUF_NAMES[key]] = data
            continue
        _, _, layer, rest = key.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if rest in renamed:
            out[f"blk.{layer}.{renamed[rest]}"] = data
        elif rest == "mlp.experts.gate_up_proj":
            width = data.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :width]
            out[f"blk.{layer}.ffn_up_exps.weight"] = data[:, width:]
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = data
        else:
            out[f"blk.{layer}.{layer_names[module]}.{suffix}"] = data
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def round_matrices_but_the_routers(hf, router: str = "mlp.gate.weight") -> None:
    """Round `hf`'s matrices in place through Q8_0 and back, but its routers (names
    ending in `router`, which the converter keeps in F32): the weights a GGUF of
    Q8_0 matrices holds (Q8_0 rounds each row's blocks, the rows of transformers'
    tensors)."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    state = {}
    for key, value in hf.state_dict().items():
        data = value.numpy()
        if data.ndim > 1 and not key.endswith(router):
            data = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(data), q8), q8)
        state[key] = torch.from_numpy(np.ascontiguousarray(data))
    hf.load_state_dict(state)

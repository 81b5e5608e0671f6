"""Tiny random gpt-oss models: transformers models, their weights under llmrun's keys, a
Hugging Face directory in the Hub's MXFP4 form (as OpenAI ships gpt-oss), and GGUF
files written as llama.cpp's converter writes them (conversion/gpt_oss.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from helpers import BASE, STORIES_GGUF, randomize

# Four layers (local, global, local, global), windows of 5 under prompts of 24, a
# clamp low enough to bite and YaRN, all from the config.
GPT_OSS = dict(
    BASE,
    model_type="gpt_oss",
    intermediate_size=32,
    num_hidden_layers=4,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=5,
    swiglu_limit=1.5,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=32,
    ),
)
# What llama.cpp assumes of a GGUF, which carries none of it: its SwiGLU constants and
# its YaRN (betas 32 and 1, the correction range rounded to whole dimensions).
LLAMA_CPP = dict(
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    rope_parameters={**GPT_OSS["rope_parameters"], "truncate": True},
)


def tiny_gpt_oss(seed: int = 0, **overrides):
    """A transformers GptOssForCausalLM of GPT_OSS (and `overrides`) with
    helpers.randomize's weights but attention outputs and biases 10x smaller, so that
    tokens differ enough for every expert to be chosen (a bias adds the same to every
    token), and N(0, 1) sinks; its config dict."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.1, "bias": 0.1, "sinks": 5.0})
    return model, config.to_dict()


def llmrun_state(model, config: dict) -> dict[str, torch.Tensor]:
    """The model's weights under llmrun's keys (the experts split by the loader's code)."""
    from llmrun.loading import gpt_oss
    from llmrun.loading.loader import Weight

    weights = {k: Weight(v) for k, v in model.state_dict().items()}
    return {k: w.tensor for k, w in gpt_oss.hf_weights(weights, config, Weight).items()}


def random_mxfp4(experts: int, rows: int, cols: int, rng) -> np.ndarray:
    """Random GGML MXFP4 blocks uint8 [experts, rows, cols / 32 * 17], scales 2^-6..2^-3
    (weights up to 12 * 2^-3 = 1.5, mostly far smaller)."""
    raw = rng.integers(0, 256, (experts, rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(128 - 6, 128 - 2, raw.shape[:-1])
    return raw.reshape(experts, rows, -1)


def with_mxfp4_experts(model, config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Give `model`'s experts random MXFP4 weights (transformers' fused tensors set to
    gguf's dequantization of them); returns the GGML blocks per layer and projection,
    {"L.gate", "L.up", "L.down"} [E, rows, row bytes]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    e, width, dim = config["num_local_experts"], config["intermediate_size"], config["hidden_size"]
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            gate, up, down = (
                random_mxfp4(e, r, c, rng) for r, c in [(width, dim)] * 2 + [(dim, width)]
            )
            deq = {
                n: torch.from_numpy(dequantize(b, GGMLQuantizationType.MXFP4).copy()).float()
                for n, b in (("gate", gate), ("up", up), ("down", down))
            }
            fused = torch.empty(e, 2 * width, dim)
            fused[:, 0::2], fused[:, 1::2] = deq["gate"], deq["up"]
            experts.gate_up_proj.copy_(fused.transpose(1, 2))  # [E, D, 2I]: x @ W
            experts.down_proj.copy_(deq["down"].transpose(1, 2))  # [E, I, D]
            blocks |= {f"{i}.gate": gate, f"{i}.up": up, f"{i}.down": down}
    return blocks


def _openai_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML MXFP4 rows [E, rows, G * 17] as the Hub stores them: blocks [E, rows, G, 16]
    (byte i: code 2i in the low nibble, 2i + 1 in the high) and scales [E, rows, G]."""
    blocks = raw.reshape(*raw.shape[:2], -1, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [.., 32] in order
    return np.ascontiguousarray(codes[..., 0::2] | codes[..., 1::2] << 4), scales.copy()


def save_hub_mxfp4_dir(path: Path, model, config: dict, blocks: dict) -> Path:
    """A directory as openai/gpt-oss-* has it: config.json (with its quantization_config)
    and safetensors holding the experts as MXFP4 blocks and scales, everything else as
    transformers names it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hub_config = {**config, "quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(hub_config))
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        state[key] = value.contiguous()
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.mlp.experts"
        gate, up = blocks[f"{i}.gate"], blocks[f"{i}.up"]
        gate_up = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.uint8)
        gate_up[:, 0::2], gate_up[:, 1::2] = gate, up
        for name, raw in (("gate_up_proj", gate_up), ("down_proj", blocks[f"{i}.down"])):
            b, s = _openai_blocks(raw)
            state[f"{prefix}.{name}_blocks"] = torch.from_numpy(b)
            state[f"{prefix}.{name}_scales"] = torch.from_numpy(s)
    save_file(state, str(path / "model.safetensors"))
    return path


# llmrun's keys -> llama.cpp's tensor names (blk.N.<name>).
GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
GGUF_EXPERTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensors(state: dict, config: dict, blocks: dict | None = None) -> dict:
    """GGUF name -> tensor as llama.cpp's converter writes gpt-oss: each layer's experts
    stacked (weights [E, rows, cols], biases [E, rows]), sinks as attn_sinks.weight. With
    `blocks` (with_mxfp4_experts), the expert weights are those MXFP4 blocks, as
    (uint8 array, type)."""
    from gguf import GGMLQuantizationType

    count = config["num_local_experts"]
    out: dict = {}
    for key, value in state.items():
        module, _, suffix = key.rpartition(".")
        if module in GGUF_GLOBAL:
            out[f"{GGUF_GLOBAL[module]}.{suffix}"] = value
            continue
        _, _, layer, rest = key.split(".", 3)
        if rest == "self_attn.sinks":
            out[f"blk.{layer}.attn_sinks.weight"] = value
        elif rest.startswith("mlp.experts."):
            _, _, e, proj, suffix = rest.split(".")
            if e != "0":
                continue
            name = f"blk.{layer}.{GGUF_EXPERTS[proj]}.{suffix}"
            if blocks is not None and suffix == "weight":
                raw = blocks[f"{layer}.{proj.removesuffix('_proj')}"]
                out[name] = (raw, GGMLQuantizationType.MXFP4)
            else:
                prefix = f"model.layers.{layer}.mlp.experts"
                out[name] = torch.stack(
                    [state[f"{prefix}.{i}.{proj}.{suffix}"] for i in range(count)]
                )
        else:
            module = rest.rpartition(".")[0]
            out[f"blk.{layer}.{GGUF_LAYER[module]}.{suffix}"] = value
    return out


def write_gpt_oss_gguf(
    path: Path,
    config: dict,
    tensors: dict,
    types: dict | None = None,
    metadata: dict | None = None,
    skip_keys: tuple = (),
) -> Path:
    """Write GGUF tensors (gguf_tensors) with the metadata llama.cpp's converter writes
    for gpt-oss (yarn keys included, which llama.cpp does not read). `types` maps a name
    fragment to the GGML type its 2-D+ float tensors are quantized to (default F32);
    `metadata` adds or replaces keys ({arch} filled in; (value, kind) or a uint32);
    `skip_keys` leaves keys out."""
    import gguf
    from gguf import Keys

    from llmrun.loading.gguf_io import read_gguf

    arch = "gpt-oss"
    writer = gguf.GGUFWriter(str(path), arch)
    rope = config["rope_parameters"]
    keys = {
        Keys.LLM.BLOCK_COUNT: (config["num_hidden_layers"], "uint32"),
        Keys.LLM.CONTEXT_LENGTH: (config["max_position_embeddings"], "uint32"),
        Keys.LLM.EMBEDDING_LENGTH: (config["hidden_size"], "uint32"),
        Keys.LLM.FEED_FORWARD_LENGTH: (config["intermediate_size"], "uint32"),
        Keys.Attention.HEAD_COUNT: (config["num_attention_heads"], "uint32"),
        Keys.Attention.HEAD_COUNT_KV: (config["num_key_value_heads"], "uint32"),
        Keys.Attention.KEY_LENGTH: (config["head_dim"], "uint32"),
        Keys.Attention.VALUE_LENGTH: (config["head_dim"], "uint32"),
        Keys.Attention.LAYERNORM_RMS_EPS: (config["rms_norm_eps"], "float32"),
        Keys.Attention.SLIDING_WINDOW: (config["sliding_window"], "uint32"),
        Keys.Rope.FREQ_BASE: (rope["rope_theta"], "float32"),
        Keys.Rope.DIMENSION_COUNT: (config["head_dim"], "uint32"),
        Keys.Rope.SCALING_TYPE: ("yarn", "string"),
        Keys.Rope.SCALING_FACTOR: (rope["factor"], "float32"),
        Keys.Rope.SCALING_ORIG_CTX_LEN: (rope["original_max_position_embeddings"], "uint32"),
        Keys.Rope.SCALING_YARN_BETA_FAST: (rope["beta_fast"], "float32"),
        Keys.Rope.SCALING_YARN_BETA_SLOW: (rope["beta_slow"], "float32"),
        Keys.LLM.EXPERT_COUNT: (config["num_local_experts"], "uint32"),
        Keys.LLM.EXPERT_USED_COUNT: (config["num_experts_per_tok"], "uint32"),
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: (config["intermediate_size"], "uint32"),
    }
    for key, value in (metadata or {}).items():
        keys[key] = value if isinstance(value, tuple) else (value, "uint32")
    for key, (value, kind) in keys.items():
        if key in skip_keys:
            continue
        getattr(writer, f"add_{kind}")(key.format(arch=arch), value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            raw, raw_type = tensor
            writer.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=raw_type)
            continue
        data = tensor.detach().float().numpy()
        qtype = next((t for frag, t in (types or {}).items() if frag in name), None)
        if (
            data.ndim == 1
            or name.endswith(".bias")
            or qtype in (None, gguf.GGMLQuantizationType.F32)
        ):
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

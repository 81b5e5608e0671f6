"""Gemma 4's assistant drafter (llmrun.models.gemma4_assistant) from either format, checked
against the target model it drafts for: its Hugging Face folder (Gemma4AssistantForCausalLM:
config.json of model_type gemma4_assistant and its safetensors; Gemma 4 Unified's
Gemma4UnifiedAssistantForCausalLM, model_type gemma4_unified_assistant, alike), or a GGUF
of arch "gemma4-assistant" as llama.cpp's converter writes either (conversion/gemma.py
Gemma4AssistantModel: Gemma 4's keys and tensor names (llmrun.loading.gemma4), the target's
width as embedding_length_out, the projections as nextn.pre_projection and
nextn.post_projection, and no ordered embeddings: the converter drops the centroids, so
llama.cpp, and llmrun with such a file, score the whole vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gemma4 as gemma4_loading
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.loader import SkipInit
from llmrun.loading.vision import encoder_tensor
from llmrun.models import gemma4
from llmrun.models.gemma4_assistant import (
    FULL,
    MODEL_TYPE,
    SLIDING,
    UNIFIED_MODEL_TYPE,
    Model,
    ModelArgs,
)

TIED = "lm_head.weight"  # the assistant's output is its embedding (tie_word_embeddings)
# llama.cpp's names, which the gguf package (0.18) does not have yet.
ARCH = "gemma4-assistant"
_PROJECTIONS = {
    "nextn.pre_projection.weight": "pre_projection.weight",
    "nextn.post_projection.weight": "post_projection.weight",
}
ROPE_FREQS = f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS]}.weight"


def is_assistant(path: Path) -> bool:
    """Whether `path` is the folder or GGUF of a Gemma 4 assistant."""
    if path.suffix == ".gguf" and path.is_file():
        return gguf_io.read_gguf(path, with_tensors=False).get(Keys.General.ARCHITECTURE) == ARCH
    config = path / "config.json"
    return (
        path.is_dir()
        and config.is_file()
        and safetensors_io.read_json(config).get("model_type") in (MODEL_TYPE, UNIFIED_MODEL_TYPE)
    )


def load(path: Path, device: torch.device, dtype: torch.dtype) -> Model:
    """The assistant of folder or GGUF `path` in `dtype` on `device`, frozen, each tensor's
    shape checked against its config."""
    if path.is_file():
        gg = gguf_io.read_gguf(path)
        config, weights = config_from_gguf(gg), {}
        for name, info in gg.tensors.items():
            if name == ROPE_FREQS:  # in the config's RoPE
                continue
            weights[_PROJECTIONS.get(name) or gemma4_loading.hf_name(name) or name] = (
                encoder_tensor(gg, info)
            )
    else:
        config = safetensors_io.read_config(path)
        weights = {}
        for file in safetensors_io.safetensors_files(path):
            weights.update(safetensors_io.load_tensors(file))
    with torch.device("meta"), SkipInit():
        model = Model(ModelArgs.from_config(config))
    expected = model.state_dict()
    weights.pop(TIED, None)
    expected.pop(TIED)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        names = missing or unexpected
        what = "missing tensors" if missing else "tensors a Gemma 4 assistant does not have"
        raise ModelFormatError(
            f"{path}: {what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        )
    state = {}
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelFormatError(
                f"{path}: tensor {name} has shape {list(tensor.shape)}, but the config implies "
                f"{list(expected[name].shape)}"
            )
        kind = tensor.dtype if name.endswith("token_ordering") else dtype
        state[name] = tensor.to(device=device, dtype=kind)
    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device)  # the RoPE tables, built on the CPU
    model.requires_grad_(False)
    return model.eval()


def config_from_gguf(gg: gguf_io.GGUFFile) -> dict[str, Any]:
    """The config.json (Gemma4AssistantConfig's fields) of a gemma4-assistant GGUF."""
    meta = gguf_io.ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    flags = meta.require(Keys.Attention.SLIDING_WINDOW_PATTERN)
    kv_heads = meta.require(Keys.Attention.HEAD_COUNT_KV)
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if not isinstance(flags, list) or len(flags) != layers or len(kv_heads) != layers:
        raise ModelFormatError(
            f"{gg.path}: the window flags and KV heads do not list {layers} layers each"
        )
    if isinstance(heads, list):
        raise UnsupportedError(f"{gg.path}: query heads per layer are not supported")
    layer_types = [SLIDING if f else FULL for f in flags]
    full_dim = meta.require(Keys.Attention.KEY_LENGTH)
    local_dim = meta.require(Keys.Attention.KEY_LENGTH_SWA)
    embed = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight")
    if embed is None:
        raise ModelFormatError(f"{gg.path}: no token_embd (the assistant's output)")
    text = {
        "model_type": gemma4_loading.MODEL_TYPE,
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads[0],
        "head_dim": local_dim,
        "per_layer_config": {
            str(i): {"head_dim": full_dim if t == FULL else local_dim, "num_key_value_heads": h}
            for i, (t, h) in enumerate(zip(layer_types, kv_heads, strict=True))
        },
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "vocab_size": int(embed.shape[0]),
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "layer_types": layer_types,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "rope_parameters": {
            SLIDING: {
                "rope_type": "default",
                "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, gemma4_loading.ROPE_BASE_SWA),
            },
            FULL: _global_rope(gg, meta.get(Keys.Rope.FREQ_BASE, 10000.0), full_dim),
        },
    }
    return {
        "model_type": MODEL_TYPE,
        "backbone_hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH_OUT),
        "use_ordered_embeddings": False,
        "text_config": text,
    }


def _global_rope(gg: gguf_io.GGUFFile, base: float, head_dim: int) -> dict[str, Any]:
    """The global layers' proportional RoPE from rope_freqs (1 for each turning frequency,
    then 1e30), as llmrun.loading.gemma4 reads a Gemma 4's."""
    if ROPE_FREQS not in gg.tensors:
        raise ModelFormatError(f"{gg.path}: tensor {ROPE_FREQS!r} is missing")
    factors = gguf_io.read_float_list(gg, ROPE_FREQS)
    turned = factors.count(1.0)
    share = 2 * turned / head_dim
    if (
        len(factors) != head_dim // 2
        or factors[:turned] != [1.0] * turned
        or int(share * head_dim // 2) != turned
    ):
        raise UnsupportedError(f"{gg.path}: {ROPE_FREQS} is not the converter's proportional RoPE")
    return {"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": share}


def check_pair(assistant: Model, target: nn.Module, name: str) -> None:
    """Refuse an assistant that cannot read `target`'s state: the target must be a Gemma 4
    of its width and vocabulary, with a layer computing keys and values of each layer type
    the assistant has, in the head shape of the assistant's layers of that type."""
    args, text = assistant.args, assistant.args.text
    theirs = getattr(target, "args", None)
    problem = None
    if not isinstance(target, gemma4.Model):
        problem = "the model is not a Gemma 4"
    elif theirs.hidden_size != args.backbone_hidden_size:
        problem = f"it drafts for a width of {args.backbone_hidden_size}, the model's is "
        problem += str(theirs.hidden_size)
    elif theirs.vocab_size != args.vocab_size:
        problem = f"{args.vocab_size} tokens, the model {theirs.vocab_size}"
    else:
        for kind, dim in zip(text.layer_types, text.layer_head_dims, strict=True):
            shapes = [shape for shape, t in zip(theirs.cache_shapes(), theirs.layer_types,
                                                strict=False) if t == kind]  # fmt: skip
            if not shapes:
                problem = f"the model has no {kind} layer whose keys it reads"
            elif shapes[-1][1] != dim or text.num_attention_heads % shapes[-1][0]:
                problem = f"its {kind} heads of {dim} read the model's {shapes[-1][0]} of "
                problem += str(shapes[-1][1])
            if problem:
                break
    if problem is not None:
        raise UsageError(
            f"--draft {name}: a Gemma 4 assistant that does not fit the model ({problem})"
        )

"""Apertus GGUFs (arch "apertus") as llama.cpp's converter writes them
(conversion/llama.py ApertusModel: LlamaModel's keys, q/k rows as they are since
llama.cpp rotates Apertus with NEOX RoPE, Llama 3 scaling as a rope_freqs tensor, and
each layer's xIELU parameters, as Hugging Face stores them, in the arrays xielu.alpha_p,
xielu.alpha_n, xielu.beta and xielu.eps: global keys, one value per layer), read as
src/models/apertus.cpp reads them: a value for all layers where the key is not an array,
softplus applied to alpha_p and alpha_n by the activation (ggml_xielu), which the model
does too. The values become the layers' act_fn tensors, the model's form of them.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "apertus"
# GGUF layer tensor -> HF module, where Apertus differs from the common names.
LAYER_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM].split(".")[-1]: "attention_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.FFN_NORM].split(".")[-1]: "feedforward_layernorm",
}
# xIELU's metadata key -> the act_fn tensor it fills, and that tensor's shape (HF's).
XIELU_KEYS = {
    Keys.xIELU.ALPHA_P: ("alpha_p", (1,)),
    Keys.xIELU.ALPHA_N: ("alpha_n", (1,)),
    Keys.xIELU.BETA: ("beta", ()),
    Keys.xIELU.EPS: ("eps", ()),
}


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Apertus's fields of the HF-style config that config_from_gguf built: the xIELU
    activation, whose per-layer values must be there (llama.cpp refuses a file without
    them). Refuses partial RoPE, which llama.cpp's graph asserts away."""
    config["hidden_act"] = "xielu"
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is not the head size "
            f"{config['head_dim']}; Apertus rotates whole heads"
        )
    xielu_values(gg, config["num_hidden_layers"])


def xielu_values(gg: GGUFFile, layers: int) -> dict[str, list[float]]:
    """Each xIELU key's value per layer, read as llama.cpp's get_key_or_arr reads it: an
    array of one value per layer, or one number for every layer."""
    values = {}
    for name in XIELU_KEYS:
        value = gg.metadata.get(name)
        if value is None:
            raise ModelFormatError(
                f"{gg.path}: metadata {name!r} is missing; an apertus file holds its xIELU "
                "activation's parameters there (llama.cpp cannot run it without them either)"
            )
        if not isinstance(value, list):
            value = [value] * layers
        if len(value) != layers or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise ModelFormatError(
                f"{gg.path}: metadata {name!r} is {value!r}; it should hold one number for "
                f"each of the {layers} layers"
            )
        values[name] = [float(v) for v in value]
    return values


def gguf_weights(
    gg: GGUFFile, config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """`weights` and each layer's xIELU parameters from the metadata, under the HF keys
    (model.layers.N.mlp.act_fn.alpha_p, ...). `weight_type` is the loader's Weight."""
    import torch  # here: `llmrun list` and `show` read this module without torch

    out = dict(weights)
    for name, values in xielu_values(gg, config["num_hidden_layers"]).items():
        field, shape = XIELU_KEYS[name]
        for layer, value in enumerate(values):
            tensor = torch.tensor(value, dtype=torch.float32).reshape(shape)
            out[f"model.layers.{layer}.mlp.act_fn.{field}"] = weight_type(tensor)
    return out

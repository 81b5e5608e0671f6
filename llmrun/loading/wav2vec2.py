"""wav2vec 2.0 CTC folders (model_type "wav2vec2", "hubert", "data2vec-audio", "wavlm":
Wav2Vec2ForCTC, HubertForCTC, Data2VecAudioForCTC, WavLMForCTC) at the loader edge: the
positional convolution's weight-norm pair (weight_g and weight_v as older files and the
Hub's have them; parametrizations.weight.original0 and original1 as transformers 5 saves
them) folded into the one weight llmrun.models.wav2vec2 takes, g * v / |v| with the norm
over all but the kernel axis (torch's weight_norm with dim=2); the pre-training's tensors
that CTC does not use (masked_spec_embed, the quantizer's) left out; and what `show` says.

Reference: transformers/models/wav2vec2/modeling_wav2vec2.py
(Wav2Vec2PositionalConvEmbedding), torch.nn.utils.parametrizations.weight_norm.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import ModelFormatError
from llmrun.models.wav2vec2 import PREFIXES

MODEL_TYPES = PREFIXES
_POSITIONAL = "{}.encoder.pos_conv_embed.conv."
_PAIRS = (
    ("weight_g", "weight_v"),
    ("parametrizations.weight.original0", "parametrizations.weight.original1"),
)
_UNUSED = ("{}.masked_spec_embed", "quantizer.", "project_q.", "project_hid.")


def unused(config: dict[str, Any]) -> tuple[str, ...]:
    """The key prefixes of the parts only training uses (the time mask's embedding,
    pretraining's quantizer and projections), which CTC never runs."""
    return tuple(u.format(PREFIXES[config["model_type"]]) for u in _UNUSED)


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The folder's tensors with the positional convolution's weight folded from its
    weight-norm pair. `weight_type` is the loader's Weight."""
    prefix = PREFIXES[config["model_type"]]
    positional = _POSITIONAL.format(prefix)
    kept = {name: w for name, w in weights.items() if not name.startswith(unused(config))}
    for g_name, v_name in _PAIRS:
        g, v = kept.pop(positional + g_name, None), kept.pop(positional + v_name, None)
        if g is None and v is None:
            continue
        if g is None or v is None or v.tensor.dim() != 3 or g.tensor.shape != (1, 1, v.shape[2]):
            raise ModelFormatError(f"{positional}{g_name} and {v_name}: not a weight-norm pair")
        v32 = v.tensor.float()
        norm = v32.pow(2).sum(dim=(0, 1), keepdim=True).sqrt()
        weight = g.tensor.float() * v32 / norm
        kept[positional + "weight"] = weight_type(weight.to(v.tensor.dtype))
    return kept


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a wav2vec2, HuBERT, data2vec-audio or WavLM folder: CTC
    speech recognition, its layers."""
    if config.get("model_type") not in MODEL_TYPES:
        return {}
    layers = config.get("num_hidden_layers", 12)
    return {
        "speech_recognition": (
            f"speech recognition: {layers} encoder layers and a CTC head over raw 16 kHz audio"
        ),
        "context_length": None,
        "embedding_model": False,
    }

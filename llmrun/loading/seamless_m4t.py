"""SeamlessM4T v2 and v1 folders (llmrun.models.seamless_m4t_v2) at the loader edge: the text
stacks' tensors under llmrun.models.bart's M2M100 names (text_encoder. and text_decoder. as
model.encoder. and model.decoder., cross_attention as encoder_attn, ffn.fc1/fc2 as fc1/fc2,
ffn_layer_norm as final_layer_norm), the shared embedding (else a stack's copy) as
model.shared and the output head where the file ties it, a zero final_logits_bias (M2M100's,
which SeamlessM4T has not), and the speech output's tensors (t2u_model., vocoder.) dropped:
llmrun translates to text only. A folder needs tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmrun.errors import UnsupportedError

MODEL_TYPES = ("seamless_m4t_v2", "seamless_m4t")
SHARED, HEAD, BIAS = "model.shared.weight", "lm_head.weight", "final_logits_bias"
COPIES = ("shared.weight", "text_decoder.embed_tokens.weight", "text_encoder.embed_tokens.weight")
SPEECH_OUTPUT = ("t2u_model.", "vocoder.")
STACKS = {"text_encoder.": "model.encoder.", "text_decoder.": "model.decoder."}
LAYER_NAMES = (
    (".cross_attention_layer_norm.", ".encoder_attn_layer_norm."),
    (".cross_attention.", ".encoder_attn."),
    (".ffn.fc1.", ".fc1."),
    (".ffn.fc2.", ".fc2."),
    (".ffn_layer_norm.", ".final_layer_norm."),
)


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight: type, path: Path
) -> dict[str, Any]:
    """The folder's tensors as llmrun's model names them; `weight`: the loader's Weight
    class, for the zero bias. A folder without tokenizer.json is refused: llmrun reads
    SeamlessM4TTokenizer's vocabulary and language codes from it, not from the SentencePiece
    model alone."""
    if not (path / "tokenizer.json").is_file():
        raise UnsupportedError(
            f"{path}: no tokenizer.json (SeamlessM4TTokenizer's); write one with "
            "transformers' AutoTokenizer.from_pretrained(FOLDER).save_pretrained(FOLDER)"
        )
    if config.get("tie_word_embeddings", True) is False:
        _check_one_embedding(weights)
    out = {}
    for key, w in weights.items():
        if key.startswith(SPEECH_OUTPUT) or key in COPIES:
            continue
        out[_text_name(key)] = w
    for name in COPIES:
        if name in weights:
            out[SHARED] = weights[name]
            break
    if HEAD not in out and SHARED in out and config.get("tie_word_embeddings", True):
        out[HEAD] = out[SHARED]
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, int) and vocab_size > 0:
        out[BIAS] = weight(torch.zeros(1, vocab_size))
    return out


def _check_one_embedding(weights: dict[str, Any]) -> None:
    """Refuse a folder whose stacks embed tokens otherwise than by the shared embedding
    (untied, each may differ), which llmrun's model holds once."""
    kept = [weights[name].tensor for name in COPIES if name in weights]
    if any(t.shape != kept[0].shape or not torch.equal(t, kept[0]) for t in kept[1:]):
        raise UnsupportedError(
            f"{', '.join(COPIES)}: the text encoder's and decoder's token embeddings differ "
            "(tie_word_embeddings false); llmrun runs SeamlessM4T with one shared embedding"
        )


def _text_name(key: str) -> str:
    for prefix, ours in STACKS.items():
        if key.startswith(prefix):
            key = ours + key[len(prefix) :]
            for theirs, mine in LAYER_NAMES:
                key = key.replace(theirs, mine)
            return key
    return key


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a SeamlessM4T folder: speech and text translation to
    text, its stacks, and its decoder's positions as the context length."""
    if config.get("model_type") not in MODEL_TYPES:
        return {}
    return {
        "speech_recognition": (
            "speech and text translation to text: "
            f"{config.get('speech_encoder_layers', 24)} speech encoder, "
            f"{config.get('encoder_layers', 24)} text encoder and "
            f"{config.get('decoder_layers', 24)} decoder layers (no speech output)"
        ),
        "context_length": config.get("max_position_embeddings", 4096),
        "embedding_model": False,
    }

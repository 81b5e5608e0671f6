"""Gemma 3n's audio encoder (E2B, E4B) from its Hugging Face folder
(Gemma3nForConditionalGeneration: model.audio_tower.*, model.embed_audio.*; the feature
extractor's settings from processor_config.json's "feature_extractor", or a
preprocessor_config.json naming Gemma3nAudioFeatureExtractor).

llama.cpp's mmproj of Gemma 3n (audio projector type gemma3na) is refused: llama.cpp
itself does not run that audio tower (tools/mtmd/clip.cpp skips it), and its converter
stops at the subsampling's norms ("Can not map tensor
'model.audio_tower.subsample_conv_projection.conv_0.norm.weight'"), so no file says how
they would be stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.gemma3n_audio_clips import FeatureSettings
from llmrun.loading import safetensors_io, whisper_audio
from llmrun.loading.gemma4_audio import feature_settings
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.gemma3n_audio import AudioArgs, AudioEncoder

MODEL_TYPE = "gemma3n"
EXTRACTOR = "Gemma3nAudioFeatureExtractor"
TOKENS_PER_CLIP = 188  # Gemma3nConfig's default audio_soft_tokens_per_image
_HF_PREFIXES = {"model.audio_tower.": "audio_tower.", "model.embed_audio.": "embed_audio."}


@dataclass
class Gemma3nAudio:
    """A loaded Gemma 3n audio encoder, its feature extractor's settings, the tokens a
    clip takes, and the ids of the padding and <end_of_audio> tokens (which the encoder's
    embedder embeds)."""

    encoder: AudioEncoder
    settings: FeatureSettings
    tokens_per_clip: int
    padding_id: int
    end_id: int


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Gemma 3n with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    return has_audio(safetensors_io.read_config(path))


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF holds Gemma 3n's audio encoder (which llmrun refuses)."""
    return whisper_audio.projector_type(path) == VisionProjectorType.GEMMA3NA


def from_mmproj(path: str | Path, text_hidden: int) -> Gemma3nAudio:
    raise UnsupportedError(
        f"{path}: Gemma 3n's audio encoder from an mmproj GGUF (llama.cpp does not run it "
        "either); give the model's Hugging Face folder for its audio"
    )


def from_hf_dir(path: Path, text_hidden: int) -> Gemma3nAudio:
    """Gemma 3n's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Gemma 3n with an audio_config")
    text = config.get("text_config")
    if not isinstance(text, dict) or not isinstance(text.get("hidden_size"), int):
        raise ModelFormatError(f"{path}: a Gemma 3n config.json without text_config.hidden_size")
    settings = feature_settings(path, FeatureSettings, EXTRACTOR, "Gemma 3n")
    try:
        args = AudioArgs.from_config(config["audio_config"], text["hidden_size"])
    except TypeError as e:
        raise ModelFormatError(f"{path}: audio_config: {e}") from None
    _check(args, settings, path)
    vocab = text.get("vocab_size")
    end = config.get("eoa_token_id", args.vocab_offset)
    tokens = config.get("audio_soft_tokens_per_image", TOKENS_PER_CLIP)
    hard = range(args.vocab_offset, args.vocab_offset + args.vocab_size)
    # Gemma3nModel pads a clip's tokens with its text vocabulary's last id, embedded by
    # the audio embedder: both it and <end_of_audio> must be the embedder's.
    if not isinstance(vocab, int) or vocab - 1 not in hard or end not in hard:
        raise ModelFormatError(
            f"{path}: the audio embedder's ids {hard.start}..{hard.stop - 1} do not hold "
            f"the vocabulary's last id ({vocab!r} - 1) and eoa_token_id {end!r}"
        )
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ModelFormatError(f"{path}: audio_soft_tokens_per_image is {tokens!r}")
    encoder = with_weights(
        AudioEncoder,
        args,
        prefixed_weights(path, _HF_PREFIXES),
        path,
        (args.text_hidden_size, text_hidden),
    )
    return Gemma3nAudio(encoder, settings, tokens, vocab - 1, end)


def _check(args: AudioArgs, settings: FeatureSettings, source: Path) -> None:
    """Refuse settings llmrun would not run as transformers does."""
    sizes = (args.hidden_size, args.conf_num_hidden_layers, args.conf_num_attention_heads,
             args.conf_conv_kernel_size, args.conf_reduction_factor, args.vocab_size,
             args.input_feat_size, *args.sscp_conv_channel_size)  # fmt: skip
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        raise ModelFormatError(f"{source}: audio sizes {sizes} are not all positive integers")
    if args.hidden_size % args.conf_num_attention_heads or args.hidden_size % 2:
        raise ModelFormatError(
            f"{source}: an audio width of {args.hidden_size} in "
            f"{args.conf_num_attention_heads} heads (an even width, whole heads)"
        )
    if args.conf_attention_context_right != 0:
        raise UnsupportedError(
            f"{source}: audio attention with {args.conf_attention_context_right} frames of "
            "right context; llmrun runs Gemma 3n's (none)"
        )
    if len(args.sscp_conv_channel_size) != 2 or len(args.sscp_conv_stride_size) != 2:
        raise ModelFormatError(f"{source}: Gemma 3n's audio subsampling has two convolutions")
    if settings.feature_size != args.input_feat_size:
        raise ModelFormatError(
            f"{source}: the feature extractor gives {settings.feature_size} mel bins, the "
            f"audio tower takes {args.input_feat_size}"
        )

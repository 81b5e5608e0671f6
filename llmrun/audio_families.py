"""The families that take audio, one table entry each: how a family's audio encoder is
recognized and loaded (its Hugging Face folder, or llama.cpp's mmproj GGUF beside a text
GGUF), how many prompt tokens a clip takes, how clips are encoded, and how a prompt's
audio places are expanded for them. The engine (llmrun.api) dispatches through it, as it
does through llmrun.vision_families for images; a clip's embeddings reach the language
model as an image's do (multimodal.PromptImages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun import (
    audio,
    audioflamingo3_clips,
    fun_asr_nano_clips,
    gemma3n_audio_clips,
    gemma4_audio_clips,
    gemma4_unified_media,
    glmasr_clips,
    granite_speech_clips,
    mixed_media,
    multimodal,
    muse_spark_clips,
    nemotron_omni_clips,
    omniasr_clips,
    phi4mm_clips,
    qwen2_5_omni_clips,
    qwen2_audio_clips,
    qwen3_asr_clips,
    qwen3_omni_clips,
    vibevoice_asr_clips,
    voxtral_clips,
)
from llmrun.loading import (
    audioflamingo3,
    fun_asr_nano,
    gemma3n_audio,
    gemma4_audio,
    gemma4_unified,
    glmasr,
    granite_speech,
    muse_spark_audio,
    nemotron_omni_audio,
    omniasr,
    phi4mm_audio,
    qwen2_5_omni,
    qwen2_audio,
    qwen2_vl_vision,
    qwen3_asr,
    qwen3_omni,
    qwen3_vl_vision,
    vibevoice_asr,
    voxtral_audio,
)
from llmrun.loading.lora import Adapter
from llmrun.tokenizer import Tokenizer

Prompt = tuple[list[int], multimodal.PromptImages]


@dataclass(frozen=True)
class AudioFamily:
    """One family's audio handling; `encoder` below is what its loaders return."""

    name: str  # as messages name it: "Voxtral", "Qwen2-Audio", "Gemma 4"
    encoder_type: type
    # Whether a Hugging Face folder / an mmproj GGUF holds this family's audio encoder.
    folder_has_audio: Callable[[Path], bool]
    is_mmproj: Callable[[Path], bool]
    # The encoder from a folder / an mmproj, for a language model `text_hidden` wide.
    from_hf_dir: Callable[[Path, int], Any]
    from_mmproj: Callable[[Path, int], Any]
    # Whether a language model's config takes this family's audio.
    text_takes_audio: Callable[[dict[str, Any]], bool]
    # The prompt tokens a decoded clip takes, before it is encoded.
    clip_tokens: Callable[[Any, audio.Clip], int]
    # Each decoded clip's encoding, in order.
    encode: Callable[[Any, Sequence[audio.Clip]], list[torch.Tensor]]
    # The ids of a text whose audio places take the encoded clips, and those clips.
    prompt: Callable[[Tokenizer, str, Sequence[torch.Tensor]], Prompt]
    # The text a message's audio part is written as, for a family whose chat template
    # reads a message's content as text (Granite Speech's); None: it takes audio parts.
    text_place: str | None = None
    # The LoRA adapter a loaded encoder brings, which runs for prompts with audio alone.
    adapter: Callable[[Any], Adapter | None] = lambda encoder: None
    # The ids of a text whose image places take its encoded images (its vision family's)
    # and whose audio places take its encoded clips, and both, for a family whose
    # processor takes both in one prompt; None: a prompt takes one or the other.
    with_images: (
        Callable[[Tokenizer, str, Sequence[Any], Sequence[torch.Tensor]], Prompt] | None
    ) = None
    # The prompt text of a transcription of one clip (its audio place marked as `prompt`
    # takes it), in a language (ISO 639-1) where one is given, with a context text (OpenAI's
    # `prompt`) where one is given and the family takes it, as the family's processor
    # documents it, from the tokenizer and the model's chat template (messages -> text,
    # without the generation prompt unless called with add_generation_prompt=True); None: it
    # documents none (serve's /v1/audio/transcriptions refuses it).
    transcription: Callable[[Tokenizer, Callable[..., str], str | None, str | None], str] | None = (
        None
    )
    # Whether its transcription prompt takes a context text.
    transcription_context: bool = False
    # The transcription in a transcription prompt's answer, as the processor reads it.
    transcript: Callable[[str], str] = lambda answer: answer


FAMILIES: tuple[AudioFamily, ...] = (
    AudioFamily(
        name="Voxtral",
        encoder_type=voxtral_audio.VoxtralAudio,
        folder_has_audio=voxtral_audio.folder_has_audio,
        is_mmproj=voxtral_audio.is_mmproj,
        from_hf_dir=voxtral_audio.from_hf_dir,
        from_mmproj=voxtral_audio.from_mmproj,
        text_takes_audio=lambda config: config.get("model_type") in ("llama", "mistral"),
        clip_tokens=voxtral_clips.clip_tokens,
        encode=voxtral_clips.encode,
        prompt=voxtral_clips.prompt,
        transcription=lambda tokenizer, render, language, context: voxtral_clips.transcription(
            tokenizer, language
        ),
    ),
    AudioFamily(
        name="Qwen2-Audio",
        encoder_type=qwen2_audio.Qwen2Audio,
        folder_has_audio=qwen2_audio.folder_has_audio,
        is_mmproj=qwen2_audio.is_mmproj,
        from_hf_dir=qwen2_audio.from_hf_dir,
        from_mmproj=qwen2_audio.from_mmproj,
        text_takes_audio=lambda config: config.get("model_type") == "qwen2",
        clip_tokens=qwen2_audio_clips.clip_tokens,
        encode=qwen2_audio_clips.encode,
        prompt=qwen2_audio_clips.prompt,
    ),
    # Its tokens' positions run on as text's, by M-RoPE (its language model's).
    AudioFamily(
        name="Qwen2.5-Omni",
        encoder_type=qwen2_5_omni.Qwen25OmniAudio,
        folder_has_audio=qwen2_5_omni.folder_has_audio,
        is_mmproj=qwen2_5_omni.is_audio_mmproj,
        from_hf_dir=qwen2_5_omni.audio_from_hf_dir,
        from_mmproj=qwen2_5_omni.audio_from_mmproj,
        text_takes_audio=qwen2_vl_vision.text_takes_images,
        clip_tokens=qwen2_5_omni_clips.clip_tokens,
        encode=qwen2_5_omni_clips.encode,
        prompt=qwen2_5_omni_clips.prompt,
        with_images=mixed_media.qwen2_5_omni,
    ),
    # Its tokens' positions run on as text's, by its language model's interleaved M-RoPE.
    AudioFamily(
        name="Qwen3-Omni",
        encoder_type=qwen3_omni.Qwen3OmniAudio,
        folder_has_audio=qwen3_omni.folder_has_audio,
        is_mmproj=qwen3_omni.is_mmproj,
        from_hf_dir=qwen3_omni.audio_from_hf_dir,
        from_mmproj=qwen3_omni.audio_from_mmproj,
        text_takes_audio=qwen3_vl_vision.text_takes_images,
        clip_tokens=qwen3_omni_clips.clip_tokens,
        encode=qwen3_omni_clips.encode,
        prompt=qwen3_omni_clips.prompt,
        with_images=mixed_media.qwen3_omni,
    ),
    # Qwen3-Omni's audio tower under a Qwen3; its chat template on llama.cpp's text GGUF
    # reads a message's content as text.
    AudioFamily(
        name="Qwen3-ASR",
        encoder_type=qwen3_asr.Qwen3ASRAudio,
        folder_has_audio=qwen3_asr.folder_has_audio,
        is_mmproj=qwen3_asr.is_mmproj,
        from_hf_dir=qwen3_asr.from_hf_dir,
        from_mmproj=qwen3_asr.from_mmproj,
        text_takes_audio=qwen3_asr.text_takes_audio,
        clip_tokens=qwen3_asr_clips.clip_tokens,
        encode=qwen3_asr_clips.encode,
        prompt=qwen3_asr_clips.prompt,
        text_place=qwen3_asr_clips.AUDIO,
        transcription=qwen3_asr_clips.transcription,
        transcription_context=True,
        transcript=qwen3_asr_clips.transcript,
    ),
    AudioFamily(
        name="Gemma 4",
        encoder_type=gemma4_audio.Gemma4Audio,
        folder_has_audio=gemma4_audio.folder_has_audio,
        is_mmproj=gemma4_audio.is_mmproj,
        from_hf_dir=gemma4_audio.from_hf_dir,
        from_mmproj=gemma4_audio.from_mmproj,
        text_takes_audio=lambda config: config.get("model_type") == "gemma4_text",
        clip_tokens=gemma4_audio_clips.clip_tokens,
        encode=gemma4_audio_clips.encode,
        prompt=gemma4_audio_clips.prompt,
        with_images=mixed_media.gemma4,
    ),
    # No encoder: a token per frame of raw samples (llmrun.gemma4_unified_media).
    AudioFamily(
        name="Gemma 4 Unified",
        encoder_type=gemma4_unified.Gemma4UnifiedAudio,
        folder_has_audio=gemma4_unified.folder_has_audio,
        is_mmproj=gemma4_unified.is_audio_mmproj,
        from_hf_dir=gemma4_unified.audio_from_hf_dir,
        from_mmproj=gemma4_unified.audio_from_mmproj,
        text_takes_audio=lambda config: config.get("model_type") in gemma4_unified.TEXT_MODEL_TYPES,
        clip_tokens=gemma4_unified_media.clip_tokens,
        encode=gemma4_unified_media.encode_clips,
        prompt=gemma4_unified_media.clip_prompt,
        with_images=gemma4_unified_media.with_images,
    ),
    # Granite Speech's with chosen conformer layers' outputs read by its projector too;
    # before Granite Speech, whose encoder class its own extends.
    AudioFamily(
        name="Granite Speech Plus",
        encoder_type=granite_speech.GraniteSpeechPlusAudio,
        folder_has_audio=granite_speech.plus_folder_has_audio,
        is_mmproj=granite_speech.plus_is_mmproj,
        from_hf_dir=granite_speech.from_hf_dir,
        from_mmproj=granite_speech.plus_from_mmproj,
        text_takes_audio=granite_speech.text_takes_audio,
        clip_tokens=granite_speech_clips.clip_tokens,
        encode=granite_speech_clips.encode,
        prompt=granite_speech_clips.prompt,
        text_place=granite_speech_clips.AUDIO,
        adapter=lambda encoder: encoder.adapter,
        transcription=granite_speech_clips.plus_transcription,
    ),
    # Its adapter on the language model runs for prompts with audio alone.
    AudioFamily(
        name="Granite Speech",
        encoder_type=granite_speech.GraniteSpeechAudio,
        folder_has_audio=granite_speech.folder_has_audio,
        is_mmproj=granite_speech.is_mmproj,
        from_hf_dir=granite_speech.from_hf_dir,
        from_mmproj=granite_speech.from_mmproj,
        text_takes_audio=granite_speech.text_takes_audio,
        clip_tokens=granite_speech_clips.clip_tokens,
        encode=granite_speech_clips.encode,
        prompt=granite_speech_clips.prompt,
        text_place=granite_speech_clips.AUDIO,
        adapter=lambda encoder: encoder.adapter,
    ),
    AudioFamily(
        name="Gemma 3n",
        encoder_type=gemma3n_audio.Gemma3nAudio,
        folder_has_audio=gemma3n_audio.folder_has_audio,
        is_mmproj=gemma3n_audio.is_mmproj,
        from_hf_dir=gemma3n_audio.from_hf_dir,
        from_mmproj=gemma3n_audio.from_mmproj,
        text_takes_audio=lambda config: config.get("model_type") == "gemma3n_text",
        clip_tokens=gemma3n_audio_clips.clip_tokens,
        encode=gemma3n_audio_clips.encode,
        prompt=gemma3n_audio_clips.prompt,
    ),
    # A Whisper-style tower with RoPE under a Llama; its transcription prompt takes no
    # language.
    AudioFamily(
        name="GLM-ASR",
        encoder_type=glmasr.GlmAsrAudio,
        folder_has_audio=glmasr.folder_has_audio,
        is_mmproj=glmasr.is_mmproj,
        from_hf_dir=glmasr.from_hf_dir,
        from_mmproj=glmasr.from_mmproj,
        text_takes_audio=glmasr.text_takes_audio,
        clip_tokens=glmasr_clips.clip_tokens,
        encode=glmasr_clips.encode,
        prompt=glmasr_clips.prompt,
        transcription=glmasr_clips.transcription,
        transcript=glmasr_clips.transcript,
    ),
    # SenseVoice's SAN-M encoder and a Transformer adaptor under a Qwen3, a token per 60 ms;
    # folders only. Its transcription prompt names the language (Chinese, English or
    # Japanese) and takes a context text.
    AudioFamily(
        name="Fun-ASR-Nano",
        encoder_type=fun_asr_nano.FunAsrNanoAudio,
        folder_has_audio=fun_asr_nano.folder_has_audio,
        is_mmproj=lambda path: False,
        from_hf_dir=fun_asr_nano.from_hf_dir,
        from_mmproj=fun_asr_nano.from_mmproj,
        text_takes_audio=fun_asr_nano.text_takes_audio,
        clip_tokens=fun_asr_nano_clips.clip_tokens,
        encode=fun_asr_nano_clips.encode,
        prompt=fun_asr_nano_clips.prompt,
        transcription=fun_asr_nano_clips.transcription,
        transcription_context=True,
    ),
    # Acoustic and semantic convolutional tokenizer encoders of the 24 kHz waveform under a
    # Qwen2, a token per 3200 samples; folders only. Its transcription prompt takes a context
    # text and no language; the answer is JSON segments with times and speakers.
    AudioFamily(
        name="VibeVoice-ASR",
        encoder_type=vibevoice_asr.VibeVoiceAsrAudio,
        folder_has_audio=vibevoice_asr.folder_has_audio,
        is_mmproj=lambda path: False,
        from_hf_dir=vibevoice_asr.from_hf_dir,
        from_mmproj=vibevoice_asr.from_mmproj,
        text_takes_audio=vibevoice_asr.text_takes_audio,
        clip_tokens=vibevoice_asr_clips.clip_tokens,
        encode=vibevoice_asr_clips.encode,
        prompt=vibevoice_asr_clips.prompt,
        transcription=vibevoice_asr_clips.transcription,
        transcription_context=True,
        transcript=vibevoice_asr_clips.transcript,
    ),
    # Audio Flamingo 3's with rotary time embeddings, from its folder; before Audio
    # Flamingo 3, whose encoder class its own extends.
    AudioFamily(
        name="Music Flamingo",
        encoder_type=audioflamingo3.MusicFlamingoAudio,
        folder_has_audio=audioflamingo3.music_folder_has_audio,
        is_mmproj=audioflamingo3.music_is_mmproj,
        from_hf_dir=audioflamingo3.from_hf_dir,
        from_mmproj=audioflamingo3.music_from_mmproj,
        text_takes_audio=audioflamingo3.text_takes_audio,
        clip_tokens=audioflamingo3_clips.clip_tokens,
        encode=audioflamingo3_clips.encode,
        prompt=audioflamingo3_clips.music_prompt,
    ),
    # Whisper's tower with Qwen2-Audio's pool under a Qwen2, 30-second windows; its
    # transcription prompt takes no language.
    AudioFamily(
        name="Audio Flamingo 3",
        encoder_type=audioflamingo3.AudioFlamingo3Audio,
        folder_has_audio=audioflamingo3.folder_has_audio,
        is_mmproj=audioflamingo3.is_mmproj,
        from_hf_dir=audioflamingo3.from_hf_dir,
        from_mmproj=audioflamingo3.from_mmproj,
        text_takes_audio=audioflamingo3.text_takes_audio,
        clip_tokens=audioflamingo3_clips.clip_tokens,
        encode=audioflamingo3_clips.encode,
        prompt=audioflamingo3_clips.prompt,
        transcription=audioflamingo3_clips.transcription,
        transcript=audioflamingo3_clips.transcript,
    ),
    # Parakeet's FastConformer under a Nemotron-H, between <so_start> and <so_end>; images
    # in the same prompt (its vision family's).
    AudioFamily(
        name="Nemotron 3 Nano Omni",
        encoder_type=nemotron_omni_audio.AudioEncoder,
        folder_has_audio=nemotron_omni_audio.folder_has_audio,
        is_mmproj=nemotron_omni_audio.is_mmproj,
        from_hf_dir=nemotron_omni_audio.from_hf_dir,
        from_mmproj=nemotron_omni_audio.from_mmproj,
        text_takes_audio=nemotron_omni_audio.text_takes_audio,
        clip_tokens=nemotron_omni_clips.clip_tokens,
        encode=nemotron_omni_clips.encode,
        prompt=nemotron_omni_clips.prompt,
        with_images=mixed_media.nemotron_omni,
    ),
    # A causal convolutional encoder of the 24 kHz waveform under Muse Spark's language
    # model; folders only. Its audio parts are written as <|audio|>, which the processor
    # expands (the chat template llama.cpp keeps for Muse Glimmer renders none).
    AudioFamily(
        name="Muse Spark",
        encoder_type=muse_spark_audio.MuseSparkAudio,
        folder_has_audio=muse_spark_audio.folder_has_audio,
        is_mmproj=lambda path: False,
        from_hf_dir=muse_spark_audio.from_hf_dir,
        from_mmproj=muse_spark_audio.from_mmproj,
        text_takes_audio=muse_spark_audio.text_takes_audio,
        clip_tokens=muse_spark_clips.clip_tokens,
        encode=muse_spark_clips.encode,
        prompt=muse_spark_clips.prompt,
        text_place=muse_spark_clips.AUDIO,
    ),
    # A Conformer with NeMo's subsampling under a Phi-3, its speech projection; folders
    # only. A prompt takes audio or images, not both (both take its other projection).
    AudioFamily(
        name="Phi-4-multimodal",
        encoder_type=phi4mm_audio.Phi4mmAudio,
        folder_has_audio=phi4mm_audio.folder_has_audio,
        is_mmproj=phi4mm_audio.is_mmproj,
        from_hf_dir=phi4mm_audio.from_hf_dir,
        from_mmproj=phi4mm_audio.from_mmproj,
        text_takes_audio=phi4mm_audio.text_takes_audio,
        clip_tokens=phi4mm_clips.clip_tokens,
        encode=phi4mm_clips.encode,
        prompt=phi4mm_clips.prompt,
        transcription=phi4mm_clips.transcription,
    ),
    # A wav2vec2-style encoder of the raw samples under a Llama, a token per 20 ms; folders
    # only. Its transcription prompt (the checkpoint's chat template) takes a language.
    AudioFamily(
        name="OmniASR",
        encoder_type=omniasr.OmniASRAudio,
        folder_has_audio=omniasr.folder_has_audio,
        is_mmproj=lambda path: False,
        from_hf_dir=omniasr.from_hf_dir,
        from_mmproj=omniasr.from_mmproj,
        text_takes_audio=omniasr.text_takes_audio,
        clip_tokens=omniasr_clips.clip_tokens,
        encode=omniasr_clips.encode,
        prompt=omniasr_clips.prompt,
        transcription=omniasr_clips.transcription,
    ),
)

NAMES = ", ".join(f.name for f in FAMILIES)
# The families that take images and audio in one prompt.
WITH_IMAGES = ", ".join(f.name for f in FAMILIES if f.with_images is not None)


def written_places(messages: list[dict[str, Any]], place: str) -> list[dict[str, Any]]:
    """`messages` with each content of parts written as text: an audio part as `place`,
    a text part as its text."""
    return [
        {**m, "content": "".join(_written(part, place) for part in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


def _written(part: dict[str, Any], place: str) -> str:
    return place if part.get("type") == "audio" else part.get("text", "")


def of_encoder(encoder: Any) -> AudioFamily:
    """The family of a loaded audio encoder."""
    return next(f for f in FAMILIES if isinstance(encoder, f.encoder_type))


def of_folder(path: Path) -> AudioFamily | None:
    """The family whose audio encoder a Hugging Face folder holds, if any."""
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    return next((f for f in FAMILIES if f.folder_has_audio(path)), None)


def of_mmproj(path: Path) -> AudioFamily | None:
    """The family of an mmproj GGUF's audio projector, if llmrun runs it."""
    return next((f for f in FAMILIES if f.is_mmproj(path)), None)

"""A tiny random Voxtral Realtime (VoxtralRealtimeForConditionalGeneration: a causal Whisper-style
encoder whose tokens are added position by position to a delay-conditioned Mistral) for the
speech recognition tests: a Hugging Face folder as save_pretrained writes it, with a
tekken.json of Voxtral's (voxtral_helpers.write_voxtral_tekken) whose audio settings are a
streaming model's ([STREAMING_PAD] and [STREAMING_WORD] among its special tokens, 2 tokens
of left padding, a 160 ms delay: 2 tokens), and transformers' VoxtralRealtimeProcessor
for it (mistral_common's offline streaming transcription request). Sliding windows of 8
encoder frames and 12 text positions, so that a second of audio spans several."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from voxtral_helpers import TEKKEN_VOCAB, write_voxtral_tekken

STREAMING_PAD, STREAMING_WORD = 32, 33
DELAY_TOKENS = 2
AUDIO = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    head_dim=16,
    num_mel_bins=128,
    sliding_window=8,
)
TEXT = dict(
    vocab_size=TEKKEN_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=12,
    max_position_embeddings=1024,
)


def tiny_voxtral_realtime(seed: int = 0):
    """A random transformers VoxtralRealtimeForConditionalGeneration of AUDIO and TEXT."""
    import transformers

    config = transformers.VoxtralRealtimeConfig(
        audio_config=AUDIO, text_config=TEXT, default_num_delay_tokens=DELAY_TOKENS
    )
    torch.manual_seed(seed)
    model = transformers.VoxtralRealtimeForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_voxtral_realtime_dir(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with the streaming tekken.json."""
    model.save_pretrained(path)
    write_voxtral_tekken(path)
    tekken = json.loads((path / "tekken.json").read_text())
    names = {STREAMING_PAD: "[STREAMING_PAD]", STREAMING_WORD: "[STREAMING_WORD]"}
    for special in tekken["special_tokens"]:
        special["token_str"] = names.get(special["rank"], special["token_str"])
    tekken["audio"] = {
        "sampling_rate": 16000,
        "frame_rate": 12.5,
        "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
        "transcription_format": "streaming",
        "transcription_delay_ms": 80.0 * DELAY_TOKENS,
        "streaming_look_ahead_ms": 0.0,
        "streaming_look_back_ms": 0.0,
        "streaming_n_left_pad_tokens": 2,
    }
    (path / "tekken.json").write_text(json.dumps(tekken), encoding="utf-8")
    return path


def processor(folder: Path):
    """transformers' VoxtralRealtimeProcessor for the folder (its tekken.json through
    mistral_common)."""
    import transformers
    from transformers.tokenization_mistral_common import MistralCommonBackend

    return transformers.VoxtralRealtimeProcessor(
        feature_extractor=transformers.VoxtralRealtimeFeatureExtractor(),
        tokenizer=MistralCommonBackend.from_pretrained(folder),
    )


def greedy(model, inputs) -> list[int]:
    """transformers' greedy generation on the processor's inputs (up to its default: every
    audio token), without the prompt."""
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()

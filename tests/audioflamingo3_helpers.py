"""A tiny random Audio Flamingo 3 (AudioFlamingo3ForConditionalGeneration: a Qwen2 under
Whisper's tower with an average pool and a two-layer projector) for the audio and
transcription tests: as a Hugging Face folder (save_pretrained's layout, stories260K's
tokenizer plus Qwen's chat tokens and <sound>, the processor's chat template), and
transformers' AudioFlamingo3Processor for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<sound>",
    "<|sound_bos|>",
    "<|sound_eos|>",
)
ENDOFTEXT, IM_START, IM_END, SOUND, SOUND_BOS, SOUND_EOS = range(512, 518)
# The processor's chat template as NVIDIA's conversion (convert_audioflamingo3_to_hf.py)
# writes it: a message's clip, then its text.
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages if m['content'] is not none %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}"
    "{{ m['content'] }}"
    "{% else %}"
    "{% set audio = namespace(found=False) %}"
    "{% set text_buf = namespace(v='') %}"
    "{% for c in m['content'] %}"
    "{% if c.get('type') == 'audio' or 'audio' in c %}"
    "{% set audio.found = True %}"
    "{% elif c.get('type') == 'text' or 'text' in c %}"
    "{% set text_buf.v = text_buf.v + c['text'] %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if audio.found %}{{ '<sound>' }}{% endif %}{{ text_buf.v }}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)


def tiny_audioflamingo3(seed: int = 0, music: bool = False):
    """A random transformers AudioFlamingo3ForConditionalGeneration (`music`:
    MusicFlamingoForConditionalGeneration, its rotary time embeddings at their defaults): a
    Qwen2 of hidden 64 in two layers, a Whisper tower of width 32 in three layers (128 mel
    bins, 1500 positions)."""
    import transformers

    text = dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(TOKENS) + 512,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    # Three layers: llama.cpp's converter maps the projector's linear_1 and linear_2 by
    # block number, so only below the block count.
    tower = dict(
        model_type="audioflamingo3_encoder",  # MusicFlamingoConfig reads it
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_mel_bins=128,
    )
    if music:
        config = transformers.MusicFlamingoConfig(
            text_config=text,
            audio_config=tower,
            audio_token_id=SOUND,
            audio_bos_token_id=SOUND_BOS,
            audio_eos_token_id=SOUND_EOS,
        )
        made = transformers.MusicFlamingoForConditionalGeneration
    else:
        config = transformers.AudioFlamingo3Config(
            text_config=text, audio_config=tower, audio_token_id=SOUND
        )
        made = transformers.AudioFlamingo3ForConditionalGeneration
    torch.manual_seed(seed)
    model = made(config).eval()
    randomize(model)
    return model


def save_audioflamingo3_dir(model, path: Path) -> Path:
    """save_pretrained's folder with stories260K's tokenizer (no BOS) plus Qwen's chat
    tokens and <sound>, the processor's template as chat_template.jinja, as transformers 5
    saves it."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # Qwen's tokenizer adds no BOS
    for i, content in enumerate(TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    features = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128}
    (path / "preprocessor_config.json").write_text(json.dumps(features))
    return path


def processor(folder: Path, music: bool = False):
    """transformers' AudioFlamingo3Processor (`music`: MusicFlamingoProcessor) for the
    folder (WhisperFeatureExtractor of 128 mel bins, the folder's tokenizer, the chat
    template)."""
    import transformers

    features = transformers.WhisperFeatureExtractor(feature_size=128, return_attention_mask=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    made = transformers.MusicFlamingoProcessor if music else transformers.AudioFlamingo3Processor
    return made(feature_extractor=features, tokenizer=tokenizer, chat_template=TEMPLATE)

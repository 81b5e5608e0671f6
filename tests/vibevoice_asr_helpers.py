"""A tiny random VibeVoice-ASR (VibeVoiceAsrForConditionalGeneration: a Qwen2 under acoustic and
semantic convolutional tokenizer encoders of the 24 kHz waveform) for the audio and
transcription tests: as a Hugging Face folder (save_pretrained's layout, stories260K's
tokenizer plus Qwen's chat and audio tokens, the chat template transformers' converter
writes, VibeVoiceAcousticTokenizerFeatureExtractor's settings in processor_config.json), and
transformers' VibeVoiceAsrProcessor for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
VIBE_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|box_start|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|endoftext|>",
)
IM_START, IM_END, AUDIO, AUDIO_START, AUDIO_END, ENDOFTEXT = range(512, 518)
VOCAB = 518
# transformers' convert_vibevoice_asr_to_hf.py chat template (the Hub checkpoint's): no
# generation prompt, the model writes its turn's opening itself.
TEMPLATE = """{%- set system_prompt = system_prompt | default("You are a helpful assistant that transcribes audio input into text output in JSON format.") -%}
<|im_start|>system
{{ system_prompt }}<|im_end|>
{%- set audio_token = audio_token | default("<|box_start|>") -%}
{%- set audio_start_token = "<|object_ref_start|>" -%}
{%- set audio_end_token = "<|object_ref_end|>" -%}
{%- for message in messages -%}
    {%- if message['role'] == 'user' -%}
{{ '\\n' }}<|im_start|>user{{ '\\n' }}{%- set text_items = message['content'] | selectattr('type', 'equalto', 'text') | list -%}
        {%- set context_text = text_items[0]['text'] if text_items else none -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'audio' -%}
{{ audio_start_token }}{{ audio_token }}{{ audio_end_token }}{{ "\\n" }}{%- if context_text -%}
This is a <|AUDIO_DURATION|> seconds audio, with extra info: {{ context_text }}

Please transcribe it with these keys: Start time, End time, Speaker ID, Content{%- else -%}
This is a <|AUDIO_DURATION|> seconds audio, please transcribe it with these keys: Start time, End time, Speaker ID, Content{%- endif -%}
            {%- endif -%}
        {%- endfor -%}
<|im_end|>{{ '\\n' }}
    {%- endif -%}
{%- endfor -%}"""
TEXT = dict(
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    eos_token_id=ENDOFTEXT,
)
# The released hop (3200 samples, which the processor counts tokens by) in three stages of
# few filters; 9600-sample chunks, so that a clip spans several.
ACOUSTIC = dict(
    model_type="vibevoice_acoustic_tokenizer_encoder",
    hidden_size=8,
    num_filters=4,
    downsampling_ratios=[8, 8, 50],
    depths=[1, 1, 1, 1],
)
SEMANTIC = {**ACOUSTIC, "hidden_size": 6}
CHUNK = 9600
PROCESSOR = {
    "feature_extractor_type": "VibeVoiceAcousticTokenizerFeatureExtractor",
    "feature_size": 1,
    "sampling_rate": 24000,
    "padding_value": 0.0,
    "normalize_audio": True,
    "target_dB_FS": -25,
    "eps": 1e-6,
    "pad_to_multiple_of": 3200,
    "return_attention_mask": True,
}


def tiny_vibevoice_asr(seed: int = 0):
    """A random transformers VibeVoiceAsrForConditionalGeneration of TEXT, ACOUSTIC and
    SEMANTIC."""
    import transformers

    config = transformers.VibeVoiceAsrConfig(
        acoustic_tokenizer_encoder_config=ACOUSTIC,
        semantic_tokenizer_encoder_config=SEMANTIC,
        text_config=TEXT,
        audio_token_id=AUDIO,
        audio_bos_token_id=AUDIO_START,
        audio_eos_token_id=AUDIO_END,
        acoustic_tokenizer_chunk_size=CHUNK,
    )
    torch.manual_seed(seed)
    model = transformers.VibeVoiceAsrForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_vibevoice_asr_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and
    PROCESSOR (as a processor's save_pretrained writes it)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # Qwen's tokenizer adds no BOS
    for i, content in enumerate(VIBE_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    # transformers 5's processor.save_pretrained layout
    processor_config = {"feature_extractor": PROCESSOR, "processor_class": "VibeVoiceAsrProcessor"}
    (path / "processor_config.json").write_text(json.dumps(processor_config))
    return path


def processor(folder: Path):
    """transformers' VibeVoiceAsrProcessor for the folder."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    features = transformers.VibeVoiceAcousticTokenizerFeatureExtractor()
    return transformers.VibeVoiceAsrProcessor(
        feature_extractor=features, tokenizer=tokenizer, chat_template=TEMPLATE
    )

"""A tiny random Gemma 3n with its audio tower (transformers' Gemma3nForConditionalGeneration)
for the audio tests, as a Hugging Face folder (stories260K's tokenizer plus Gemma 3n's turn,
image and audio tokens, a Gemma 3n chat template) and transformers' Gemma3nProcessor on it.

Its vision tower is MobileNetV5 through timm, which is not installed: the model is built
with an empty module in the tower's place (transformers' own modules for all the rest), and
no test gives it an image. The text vocabulary ends with the vision embedder's ids (516..519)
and the audio embedder's (520..523: <end_of_audio>, <audio_soft_token>, two more), as
Gemma 3n's does at 262144 and 262272; the per-layer table stops before them (512 rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import numpy as np
import torch
from helpers import STORIES_HF, randomize
from torch import nn

# Ids 512 on, after stories260K's 512 tokens.
GEMMA3N_TOKENS = (
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<start_of_audio>",
    "<end_of_image>",  # 516: the vision embedder's first id
    "<image_soft_token>",
    "<image_pad_2>",
    "<image_pad_3>",
    "<end_of_audio>",  # 520: the audio embedder's first id
    "<audio_soft_token>",
    "<audio_pad_2>",
    "<audio_pad_3>",
)
BOA, EOA, AUDIO = 515, 520, 521
VOCAB = 512 + len(GEMMA3N_TOKENS)
TOKENS_PER_CLIP = 24  # audio_soft_tokens_per_image: 6.1 seconds' worth
S, F = "sliding_attention", "full_attention"
# Gemma 3n's chat template (an audio part writes <audio_soft_token>).
TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'audio' -%}{{ '<audio_soft_token>' }}"
    "{%- elif item['type'] == 'image' -%}{{ '<image_soft_token>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
AUDIO_CONFIG = dict(
    hidden_size=32,
    conf_num_attention_heads=2,
    conf_num_hidden_layers=2,
    sscp_conv_channel_size=[8, 4],
    conf_conv_kernel_size=5,
    vocab_size=4,
    vocab_offset=520,
)


def tiny_gemma3n_audio(seed: int = 0):
    """A random Gemma3nForConditionalGeneration: text hidden 64 (a sliding layer of window
    8, a sparse one, then a global one; 4 AltUp streams, per-layer inputs of 16, LAuReL of
    8), an audio tower of width 32 (2 conformer layers of 2 heads; convolutions of 8 and 4
    channels), its norms near 1 (they scale by w, not 1 + w)."""
    import transformers
    from transformers.models.gemma3n import modeling_gemma3n

    text = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        num_kv_shared_layers=0,
        layer_types=[S, F],
        sliding_window=8,
        activation_sparsity_pattern=[0.95, 0.0],
        max_position_embeddings=512,
        final_logit_softcapping=10.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = transformers.Gemma3nConfig(
        text_config=text,
        vision_config=dict(hidden_size=16, vocab_size=4, vocab_offset=516),
        audio_config=AUDIO_CONFIG,
        boi_token_id=514,
        eoi_token_id=516,
        image_token_id=517,
        boa_token_id=BOA,
        eoa_token_id=EOA,
        audio_token_id=AUDIO,
        audio_soft_tokens_per_image=TOKENS_PER_CLIP,
    )
    build = modeling_gemma3n.AutoModel.from_config

    def without_timm(sub_config, **kwargs):
        is_vision = sub_config.model_type == "gemma3n_vision"
        return nn.Module() if is_vision else build(sub_config, **kwargs)

    torch.manual_seed(seed)
    with patch.object(modeling_gemma3n.AutoModel, "from_config", without_timm):
        model = transformers.Gemma3nForConditionalGeneration(config).eval()
    randomize(model, {"embed_tokens.weight": 0.3})
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if name.startswith(("audio_tower.", "embed_audio.")) and name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    return model


def save_gemma3n_audio_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(GEMMA3N_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def processor(folder: Path):
    """transformers' Gemma3nProcessor of the folder (Gemma3nAudioFeatureExtractor's
    defaults; a PIL image processor, unused)."""
    import transformers
    from transformers.models.gemma3n.feature_extraction_gemma3n import (
        Gemma3nAudioFeatureExtractor,
    )

    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
        "boa_token": "<start_of_audio>",
        "audio_token": "<audio_soft_token>",
        "eoa_token": "<end_of_audio>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    check = transformers.ProcessorMixin.check_argument_for_proper_class
    with patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if name == "image_processor" else check(self, name, arg)):  # fmt: skip
        return transformers.Gemma3nProcessor(
            feature_extractor=Gemma3nAudioFeatureExtractor(),
            image_processor=transformers.SiglipImageProcessorPil(),
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            chat_template=TEMPLATE,
            audio_seq_length=TOKENS_PER_CLIP,
        )


def processor_inputs(folder: Path, clips: list[np.ndarray], question: str):
    """Gemma3nProcessor's inputs (input_ids, attention_mask, input_features,
    input_features_mask) for one user message of `clips` (16 kHz float samples) then
    `question`, with the generation prompt."""
    proc = processor(folder)
    content = [{"type": "audio"}] * len(clips) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes BOS already.
    inputs = proc(text=text, audio=clips, return_tensors="pt", add_special_tokens=False)
    inputs.pop("token_type_ids", None)
    return inputs


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()

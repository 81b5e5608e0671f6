"""A tiny random Phi-4-multimodal (transformers' Phi4MultimodalForCausalLM: Phi-3 text with
LongRoPE over 3/4 of each head, a SigLIP image tower of 2 layers and a Conformer audio
tower of 1 block, chunks of 4 frames seeing the one before) saved as save_pretrained
writes it, with stories260K's tokenizer plus Phi-4's special tokens and chat template, and
transformers' Phi4MultimodalProcessor for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# ids 512 on, after stories260K's 512 tokens: the image and audio places (Phi-4's
# <|endoftext10|> and <|endoftext11|>), then the chat template's.
TOKENS = ("<|endoftext10|>", "<|endoftext11|>", "<|user|>", "<|assistant|>", "<|end|>")
IMAGE, AUDIO, END = 512, 513, 516
VOCAB = 520
# Phi-4-multimodal-instruct's template, without its tools branch, with image and audio
# parts written as their tokens.
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|endoftext10|>"
    "{% elif c['type'] == 'audio' %}<|endoftext11|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% else %}{{ eos_token }}{% endif %}"
)
HEAD_DIM, ROTARY_PAIRS = 16, 6  # partial_rotary_factor 0.75, as the Hub's model has
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    original_max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=0.75,
        short_factor=[1.0 + 0.1 * i for i in range(ROTARY_PAIRS)],
        long_factor=[1.0 + 0.5 * i for i in range(ROTARY_PAIRS)],
    ),
    bos_token_id=1,
    eos_token_id=[2, END],
    pad_token_id=0,
    vision_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=448,
        crop_size=448,
        patch_size=14,
        image_token_id=IMAGE,
    ),
    audio_config=dict(
        hidden_size=32,
        intermediate_size=48,
        num_blocks=1,
        num_attention_heads=2,
        chunk_size=4,
        left_chunk=1,
        ext_pw_out_channel=32,
        depthwise_separable_out_channel=32,
        nemo_conv_channels=32,
        audio_token_id=AUDIO,
    ),
)


def tiny_phi4mm(seed: int = 0):
    """A random Phi4MultimodalForCausalLM of CONFIG: norm scales near 1 (randomize()), the
    audio tower's input mean and inverse deviation random too."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Phi4MultimodalConfig(**CONFIG)
    model = transformers.Phi4MultimodalForCausalLM(config).eval()
    randomize(model)
    norm = model.model.embed_tokens_extend.audio_embed.encoder.encoder_embedding
    with torch.no_grad():
        norm.global_mean.normal_(0.0, 1.0)
        norm.global_invstd.uniform_(0.5, 1.5)
    return model


def save_phi4mm_dir(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with the tokenizer files."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
        "extra_special_tokens": {"image_token": TOKENS[0], "audio_token": TOKENS[1]},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def processor(folder: Path, images: bool = True):
    """transformers' Phi4MultimodalProcessor for the folder. Its image processor needs
    torchvision: without `images`, a bare ImageProcessingMixin stands in (for audio)."""
    import transformers
    from transformers.image_processing_utils import ImageProcessingMixin

    made = transformers.Phi4MultimodalImageProcessor() if images else ImageProcessingMixin()
    return transformers.Phi4MultimodalProcessor(
        image_processor=made,
        audio_processor=transformers.Phi4MultimodalFeatureExtractor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )

"""A tiny random Ovis2 (Ovis2ForConditionalGeneration: an AIMv2 ViT over 32x32 tiles of
8x8 patches, 2x2 patches a token, a visual vocabulary of 35 plus its 5 indicators, a Qwen2
language model with a tied head) for the image tests: a Hugging Face folder as
save_pretrained writes it (stories260K's tokenizer plus ChatML's turn tokens and Ovis2's
image markers, a chat template that writes each image as <image>, Ovis2ImageProcessor's
preprocessor_config.json: tiles on, up to 6 and a thumbnail, mean and std 0.5), and
transformers' Ovis2Processor inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from chat_processor import user_message_inputs
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
OVIS2_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<IMG_ATOM>",
    "<IMG_START>",
    "<IMG_GRID>",
    "<IMG_COL>",
    "<IMG_ROW>",
    "<IMG_END>",
)
ATOM = 515
INDICATORS = (516, 517, 518, 519, 520)  # <IMG_START>, <IMG_GRID>, <IMG_COL>, <IMG_ROW>, <IMG_END>
VOCAB = 521
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' -%}{{- '<image>\n' -}}"
    "{%- elif content['type'] == 'text' -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
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
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
)
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    patch_size=8,
    image_size=32,
    hidden_stride=2,
    vocab_size=40,
)
TOKENS_PER_TILE = 4
PROCESSOR = {
    "image_processor_type": "Ovis2ImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"height": 32, "width": 32},
    "crop_to_patches": True,
    "min_patches": 1,
    "max_patches": 6,
    "use_covering_area_grid": True,
}


def tiny_ovis2(seed: int = 0):
    """A random transformers Ovis2ForConditionalGeneration: Qwen2 of hidden 64 in 2
    layers, a vision tower of hidden 32 in 2 layers (VISION)."""
    import transformers

    config = transformers.Ovis2Config(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=ATOM,
        visual_indicator_token_ids=list(INDICATORS),
        hidden_size=TEXT["hidden_size"],
        vocab_size=VOCAB,
    )
    torch.manual_seed(seed)
    model = transformers.Ovis2ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("rms_norm.weight", "rms_norm1.weight", "rms_norm2.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith("head_norm.weight"):
                p.normal_(1.0, 0.1)
    return model


def save_ovis2_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(OVIS2_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def image_processor(**changes):
    """transformers' Ovis2ImageProcessorPil with PROCESSOR's settings, and `changes`."""
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return Ovis2ImageProcessorPil(**(settings | changes))


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """transformers' Ovis2Processor's inputs (input_ids, pixel_values) for one user message
    of `images` then `question`, with the generation prompt."""
    import transformers

    made = transformers.Ovis2Processor(
        image_processor=image_processor(),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=TEMPLATE,
        image_seq_length=TOKENS_PER_TILE,
    )
    return user_message_inputs(made, images, question, ("input_ids", "pixel_values"))

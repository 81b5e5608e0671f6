"""A tiny random Ovis2.5 (Ovis2_5ForConditionalGeneration: a NaViT SigLIP 2 tower of
patch 8 with windows of 4x4 merged tokens, a visual vocabulary of 36 and its 4
indicators, a Qwen3 language model) for the image tests: a Hugging Face folder as
save_pretrained writes it (stories260K's tokenizer plus ChatML's turn tokens and Ovis's
image and video tokens, a chat template that writes each image as <image>,
Ovis2_5ImageProcessor's preprocessor_config.json with CLIP's mean and std and limits of
32x32 to 128x128 pixels), and transformers' Ovis2_5Processor inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from chat_processor import images_only, user_message_inputs
from helpers import STORIES_HF, randomize
from ovis2_helpers import TEMPLATE  # Ovis2's ChatML template, as Ovis2.5's

# Ids 512 on, after stories260K's 512 tokens.
OVIS_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<video>",
    "<ovis_image_start>",
    "<ovis_image_end>",
    "<ovis_video_start>",
    "<ovis_video_end>",
)
IMAGE, VIDEO, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = range(514, 520)
VOCAB = 520
TEXT = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
)
# Heads of 8 features (a quarter turned by rows, a quarter by columns); an 8x8 table of
# positions resized to each grid; windows of 64 pixels (4x4 merged tokens) in the first
# of the two layers.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    patch_size=8,
    image_size=64,
    window_size=64,
    vocab_size=40,
    num_visual_indicator_tokens=4,
    layer_types=["window_attention", "full_attention"],
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
PROCESSOR = {
    "image_processor_type": "Ovis2_5ImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    "patch_size": 8,
    "temporal_patch_size": 1,
    "merge_size": 2,
}


def tiny_ovis2_5(seed: int = 0):
    """A random transformers Ovis2_5ForConditionalGeneration: Qwen3 of hidden 64 in 2
    layers, a vision tower of hidden 32 in 2 layers (VISION)."""
    import transformers

    config = transformers.Ovis2_5Config(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        image_start_token_id=IMAGE_START,
        image_end_token_id=IMAGE_END,
        video_start_token_id=VIDEO_START,
        video_end_token_id=VIDEO_END,
    )
    torch.manual_seed(seed)
    model = transformers.Ovis2_5ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("layer_norm1", "layer_norm2", "norm"):
                if name.endswith("weight"):
                    p.normal_(1.0, 0.1)
    return model


def save_ovis2_5_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(OVIS_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    names = ("image", "video", "image_start", "image_end", "video_start", "video_end")
    tok_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
        "extra_special_tokens": {
            f"{n}_token": t for n, t in zip(names, OVIS_TOKENS[2:], strict=True)
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """transformers' Ovis2_5Processor's inputs (input_ids, pixel_values, image_grid_thw)
    for one user message of `images` then `question`, with the generation prompt
    (Ovis2_5ImageProcessorPil)."""
    import transformers
    from transformers.models.ovis2_5.image_processing_pil_ovis2_5 import (
        Ovis2_5ImageProcessorPil,
    )

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = images_only(transformers.Ovis2_5Processor)(
        image_processor=Ovis2_5ImageProcessorPil(**settings),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    return user_message_inputs(
        made, images, question, ("input_ids", "pixel_values", "image_grid_thw")
    )

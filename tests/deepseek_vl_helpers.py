"""Tiny random DeepSeek-VL models (DeepseekVLForConditionalGeneration and, with a SAM tower,
DeepseekVLHybridForConditionalGeneration; Llama text) for the image tests, their folders as
save_pretrained writes them (stories260K's tokenizer plus <image_placeholder>, the chat
template of transformers' Janus conversion), and their processors' inputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from chat_processor import user_message_inputs
from helpers import randomize, save_vision_dir
from janus_helpers import JANUS_TEMPLATE

# Ids 512 on, after stories260K's 512 tokens.
TOKENS = ("<image_placeholder>", "<pad>")
IMAGE = 512
VOCAB = 520
SIZE, PATCH, PER_IMAGE = 32, 8, 16  # 4x4 SigLIP patches, one token each
HIGH_SIZE = 64  # the SAM tower's: 8x8 patches of 8, windows of 4
QUESTION = "What is in the picture?"
PROCESSOR = {
    "image_processor_type": "DeepseekVLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"height": SIZE, "width": SIZE},
    "min_size": 14,
    "resample": 3,
}
HYBRID_PROCESSOR = {
    **PROCESSOR,
    "image_processor_type": "DeepseekVLHybridImageProcessor",
    "high_res_size": {"height": HIGH_SIZE, "width": HIGH_SIZE},
    "high_res_resample": 3,
    "high_res_image_mean": [0.48145466, 0.4578275, 0.40821073],
    "high_res_image_std": [0.26862954, 0.26130258, 0.27577711],
}
# (height, width): 12x60 resized to 6x32, raised to 14x32 (min_size), padded to 32x32;
# 50x27 resized to 32x17.
SIZES = [(12, 60), (50, 27)]


def tiny_deepseek_vl(hybrid: bool = False, seed: int = 0):
    """A random DeepSeek-VL: Llama text of hidden 64 in 2 layers (its head tied,
    DeepseekVLConfig's default), a SigLIP of hidden 32 in 2 layers on 32-pixel images of
    8-pixel patches; `hybrid`: and a SAM of hidden 32 in 2 layers (the second global) on
    64-pixel images."""
    import transformers

    text = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=513,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=PATCH,
    )
    common = dict(text_config=text, vision_config=vision, image_token_id=IMAGE)
    if hybrid:
        high = dict(
            hidden_size=32,
            output_channels=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=HIGH_SIZE,
            patch_size=PATCH,
            mlp_dim=64,
            window_size=4,
            global_attn_indexes=[1],
        )
        config = transformers.DeepseekVLHybridConfig(**common, high_res_vision_config=high)
        model_class = transformers.DeepseekVLHybridForConditionalGeneration
    else:
        config = transformers.DeepseekVLConfig(**common)
        model_class = transformers.DeepseekVLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model)
    return model


def save_deepseek_vl_dir(model, path: Path, hybrid: bool = False) -> Path:
    """The model's folder, with DeepseekVLProcessor's num_image_tokens."""
    save_vision_dir(model, path, TOKENS, JANUS_TEMPLATE, HYBRID_PROCESSOR if hybrid else PROCESSOR)
    (path / "processor_config.json").write_text(json.dumps({"num_image_tokens": PER_IMAGE}))
    return path


def processor_inputs(folder: Path, images: list, question: str, hybrid: bool = False) -> dict:
    """DeepseekVL(Hybrid)Processor's inputs for one user message of `images`, `question`."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.image_token = TOKENS[0]
    settings = HYBRID_PROCESSOR if hybrid else PROCESSOR
    settings = {k: v for k, v in settings.items() if k != "image_processor_type"}
    keys = ("input_ids", "attention_mask", "pixel_values")
    if hybrid:
        from transformers.models.deepseek_vl_hybrid.image_processing_pil_deepseek_vl_hybrid import (  # noqa: E501
            DeepseekVLHybridImageProcessorPil as ImageProcessor,
        )

        processor_class, keys = (
            transformers.DeepseekVLHybridProcessor,
            (*keys, "high_res_pixel_values"),
        )
    else:
        from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import (
            DeepseekVLImageProcessorPil as ImageProcessor,
        )

        processor_class = transformers.DeepseekVLProcessor
    processor = processor_class(
        image_processor=ImageProcessor(**settings),
        tokenizer=tokenizer,
        chat_template=JANUS_TEMPLATE,
        num_image_tokens=PER_IMAGE,
    )
    return user_message_inputs(processor, images, question, keys)

"""A tiny random Granite Docling (GraniteDoclingForConditionalGeneration: Granite text
of hidden 64 in 2 layers, Idefics3's SigLIP tower of hidden 32 in 3 layers on 32-pixel
tiles of 4-pixel patches, pixel-shuffled by 4 into 4 tokens a tile, DeepStack mergers on
tower layers 0 and 2) for the image tests: as a Hugging Face folder (SmolVLM's tokenizer
and template from smolvlm_helpers, GraniteDoclingImageProcessor's settings with GOT-OCR2
tiles of at most 6) and its reference inputs from transformers' GraniteDoclingProcessor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from smolvlm_helpers import IMAGE, VOCAB, save_smolvlm_dir

TILE, MAX_TILES = 32, 6
PROCESSOR = {
    "image_processor_type": "GraniteDoclingImageProcessor",
    "size": {"height": TILE, "width": TILE},
    "crop_to_patches": True,
    "min_patches": 1,
    "max_patches": MAX_TILES,
    "resample": 3,
}
# (height, width) -> (rows, columns) of tiles
SHAPES = {(30, 30): (1, 1), (40, 90): (1, 2), (64, 60): (2, 2), (100, 70): (3, 2)}
# The spread rule: a page wider than 2:1 and shrunk below 0.9 of its width at 6 tiles
# takes up to 10 (a 100 x 250 page: 2 x 5 tiles instead of 1 x 3).
DENSE = {"dense_max_patches": 10, "dense_max_scale": 0.9, "dense_min_aspect": 2.0}


def tiny_granite_docling():
    import transformers

    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=4,
        out_hidden_size=64,
        scale_factor=4,
        deepstack_visual_indexes=[0, 2],
    )
    config = transformers.GraniteDoclingConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, pad_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GraniteDoclingForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_granite_docling_dir(model, path: Path, **settings) -> Path:
    """The model's folder with the tokenizer files and the image processor's `settings`
    (over PROCESSOR)."""
    save_smolvlm_dir(model, path)
    (path / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, **settings}))
    return path


def reference_inputs(folder: Path, images: list, text: str, **settings) -> dict:
    """transformers' GraniteDoclingProcessor (its Pillow image processor) on a rendered
    prompt `text`, the folder's processor settings updated by `settings`."""
    import transformers
    from transformers.models.granite_docling.image_processing_pil_granite_docling import (
        GraniteDoclingImageProcessorPil,
    )

    processor_settings = {**PROCESSOR, **settings}
    del processor_settings["image_processor_type"]
    fine = processor_settings.pop("fine_route", False)
    processor = transformers.GraniteDoclingProcessor(
        image_processor=GraniteDoclingImageProcessorPil(**processor_settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        image_seq_len=(TILE // 4 // 4) ** 2,
    )
    return dict(processor(text=text, images=images, return_tensors="pt", fine_route=fine))

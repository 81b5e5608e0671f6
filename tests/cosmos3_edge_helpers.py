"""A tiny random Cosmos3 Edge (Cosmos3EdgeForConditionalGeneration: a SigLIP 2 tower with
Qwen3.5's patch merger, a Llama-like language model with an ungated relu² MLP and
interleaved M-RoPE) for the image tests: a Hugging Face folder as save_pretrained writes
it (the Hub's layout: the language model's keys at the top level, Diffusers' attention
names; qwen2_vl_helpers' tokenizer and chat template, a Cosmos3EdgeImageProcessor
preprocessor_config.json with a smaller least pixel count so that small images stay small),
and transformers' Cosmos3EdgeProcessor inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from qwen2_vl_helpers import (
    IMAGE,
    QWEN2_VL_TEMPLATE,
    TEXT,
    VIDEO,
    VISION_END,
    VISION_START,
    save_qwen_vl_dir,
)

# 8 pairs a head in uneven sections, interleaved: pairs 1 and 4 turn by the height,
# 2 and 5 by the width, 0, 3, 6 and 7 by the time.
COSMOS_TEXT = {
    **TEXT,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 2, 3]},
}
# A 6x6 table of learned positions, which images of 8x10 and 10x4 patches resample (up,
# and down across the second's width, where the antialiasing counts).
COSMOS_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_patches=36,
    patch_size=16,
    spatial_merge_size=2,
)
# Cosmos3EdgeImageProcessor's settings, its least pixel count 64x64 (the Hub's is 256x256).
PROCESSOR = {
    "image_processor_type": "Cosmos3EdgeImageProcessor",
    "processor_class": "Cosmos3EdgeProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 4096, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 1,
    "merge_size": 2,
}


def tiny_cosmos3_edge(seed: int = 1):
    """A random transformers Cosmos3EdgeForConditionalGeneration: text hidden 64 in 2
    layers, a vision tower of hidden 32 in 2 layers, a projector of 80 hidden features."""
    import transformers

    config = transformers.Cosmos3EdgeConfig(
        text_config=COSMOS_TEXT,
        vision_config=COSMOS_VISION,
        projector_hidden_size=80,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(seed)
    model = transformers.Cosmos3EdgeForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "projector.norm.weight")):
                p.normal_(1.0, 0.1)
    return model


def save_cosmos3_edge_dir(model, path: Path) -> Path:
    """The model's folder with the tokenizer files and PROCESSOR."""
    save_qwen_vl_dir(model, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor_inputs(folder: Path, images: list, question: str):
    """transformers' Cosmos3EdgeProcessor's inputs (input_ids, pixel_values,
    image_grid_thw, mm_token_type_ids) for one user message of `images` then `question`,
    with the generation prompt (Cosmos3EdgeImageProcessorPil)."""
    import transformers

    class Processor(transformers.Cosmos3EdgeProcessor):
        # Images only: its video processor needs torchvision, which the tests go without.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    made = Processor(
        image_processor=transformers.Cosmos3EdgeImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=QWEN2_VL_TEMPLATE,
    )
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = made(
        text=text,
        images=images,
        return_tensors="pt",
        add_special_tokens=False,
        return_mm_token_type_ids=True,
    )
    return inputs

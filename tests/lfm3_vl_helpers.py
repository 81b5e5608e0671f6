"""A tiny random LFM3-VL (Lfm3VlForConditionalGeneration: a tower of two gated 2D
convolution layers and one attention layer over Qwen2-VL's patches, an LFM3 language model
with a convolution and an attention layer) for the image tests: a Hugging Face folder as
save_pretrained writes it (stories260K's tokenizer plus ChatML's and the vision tokens, a
chat template that writes each image as <|vision_start|><|image_pad|><|vision_end|>,
Qwen2VLImageProcessor's settings), and transformers' Lfm3VlProcessor inputs for it
(Qwen2VLImageProcessorPil, the Pillow image processor transformers' auto classes give
lfm3_vl: no torchvision needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
LFM3_VL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IM_START, IM_END, VISION_START, VISION_END, IMAGE, VIDEO = range(512, 518)
VOCAB = 518
TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{{- '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
TEXT = dict(
    model_type="lfm3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    layer_types=["conv", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
    pad_token_id=0,
)
# Heads of 8 features (a quarter turned by rows, a quarter by columns), 2 key/value heads
# for 4 query heads; Lfm3VlVisionConfig's layer pattern: conv, conv, attention.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
# 2 to 12 merged tokens (32 pixels a side each) an image.
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 2 * 32 * 32, "longest_edge": 12 * 32 * 32},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def tiny_lfm3_vl(seed: int = 0):
    """A random transformers Lfm3VlForConditionalGeneration: LFM3 of hidden 64 in 2
    layers, a vision tower of hidden 32 in 3 layers (VISION), a projector through 40."""
    import transformers

    config = transformers.Lfm3VlConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        projector_hidden_size=40,
    )
    torch.manual_seed(seed)
    model = transformers.Lfm3VlForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_lfm3_vl_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # no BOS: the template begins with <|im_start|>
    for i, content in enumerate(LFM3_VL_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' Lfm3VlProcessor for the folder, with Qwen2VLImageProcessorPil."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(transformers.Lfm3VlProcessor):
        # Images only: its video processor needs torchvision, which the tests go without.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return Processor(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs (input_ids, pixel_values, image_grid_thw) for one user
    message of `images` then `question`, with the generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    messages = [{"role": "user", "content": content}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {k: inputs[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()

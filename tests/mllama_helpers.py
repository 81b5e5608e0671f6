"""A tiny random Llama 3.2 Vision (MllamaForConditionalGeneration) for the image tests: a
Hugging Face folder as save_pretrained writes it (stories260K's tokenizer plus Llama 3's header
tokens and <|image|>, a Llama 3.2 Vision style chat template, a preprocessor_config.json), and
transformers' MllamaProcessor inputs for it (MllamaImageProcessorPil: no torchvision)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens; <|image|> is the vocabulary's size, the first
# of the embedding's extra rows (MllamaConfig.image_token_index).
MLLAMA_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|image|>")
IMAGE = 515
VOCAB = 515
# 56-pixel tiles of 14-pixel patches: 16 patches and the class token, padded to 24; up to 4.
TILE, PATCH, MAX_TILES = 56, 14, 4
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    cross_attention_layers=[2],
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens, not an early <|eot_id|>
    pad_token_id=0,
)
# Llama 3.2 Vision's tower (32 plain layers, 8 gated global ones, hidden states 3, 7, 15, 23
# and 30 joining the final state), shrunk.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_global_layers=1,
    attention_heads=2,
    image_size=TILE,
    patch_size=PATCH,
    max_num_tiles=MAX_TILES,
    intermediate_layers_indices=[0, 1],
    vision_output_dim=96,
)
PROCESSOR = {
    "image_processor_type": "MllamaImageProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_image_tiles": MAX_TILES,
    "resample": 2,
    "rescale_factor": 1 / 255,
    "size": {"height": TILE, "width": TILE},
}
# Llama 3.2 Vision Instruct's chat template, as far as a plain conversation with an image
# goes (its tools and dates left out).
TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def tiny_mllama(seed: int = 0):
    """A random transformers MllamaForConditionalGeneration: text hidden 64 in 4 layers, the
    third a cross-attention one; vision hidden 32 in 2 plain layers and 1 gated global one
    on 56-pixel tiles. Gates scaled up so that each of them matters."""
    import transformers

    config = transformers.MllamaConfig(
        text_config=TEXT, vision_config=VISION, image_token_index=IMAGE
    )
    torch.manual_seed(seed)
    model = transformers.MllamaForConditionalGeneration(config).eval()
    randomize(
        model,
        {"_gate": 5.0, ".gate": 5.0, "gate_attn": 5.0, "gate_ffn": 5.0},
    )
    return model


def save_mllama_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(MLLAMA_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor_inputs(folder: Path, images: list, messages: list[dict]):
    """transformers' MllamaProcessor inputs (input_ids, pixel_values, aspect_ratio_ids,
    aspect_ratio_mask, cross_attention_mask) for a conversation with the generation prompt."""
    import transformers
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    processor = transformers.MllamaProcessor(
        image_processor=MllamaImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {"images": images} if images else {}
    return processor(text=text, return_tensors="pt", add_special_tokens=False, **kwargs)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()

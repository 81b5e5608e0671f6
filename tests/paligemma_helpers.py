"""A tiny random PaliGemma 1 or 2 (PaliGemmaForConditionalGeneration: SigLIP tower, linear
projector, Gemma or Gemma 2 text) for the image tests, as a Hugging Face folder (stories260K's
tokenizer plus <image>, a preprocessor_config.json), and PaliGemmaProcessor's inputs for
it (SiglipImageProcessor's Pillow backend)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

IMAGE = 512  # <image>, after stories260K's 512 tokens
VOCAB = 513
IMAGE_SIZE, TOKENS = 64, 16  # 4x4 patches of 16 pixels
SLIDING_WINDOW = 6  # shorter than a prompt: the window and the prefix meet


def tiny_paligemma(seed: int = 0, text_type: str = "gemma2"):
    """Text hidden 64 of two layers (PaliGemma 2's gemma2: a sliding layer of window 6, then
    a global one; PaliGemma 1's gemma: two global ones), SigLIP of hidden 32 on 64-pixel
    images."""
    import transformers

    text = dict(
        model_type=text_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if text_type == "gemma2":
        text.update(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32)
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=16,
        vision_use_head=False,
    )
    config = transformers.PaliGemmaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=IMAGE,
        projection_dim=64,
        hidden_size=64,
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_paligemma_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (no chat template: PaliGemma has none)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    added = dict(id=IMAGE, content="<image>", single_word=False, lstrip=False, rstrip=False)
    tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {
        "image_processor_type": "SiglipImageProcessor",
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "resample": 3,
        "image_seq_length": TOKENS,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def processor_inputs(folder: Path, image, text: str):
    """PaliGemmaProcessor's inputs (input_ids, token_type_ids, pixel_values) for one image
    and `text`."""
    import transformers
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    images = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images.image_seq_length = TOKENS
    processor = transformers.PaliGemmaProcessor(
        image_processor=images, tokenizer=transformers.AutoTokenizer.from_pretrained(folder)
    )
    return processor(images=image, text=text, return_tensors="pt")


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()

"""A tiny random HyperCLOVA X SEED Vision (HyperCLOVAXVisionV2ForConditionalGeneration:
Qwen2.5-VL's vision tower and a Linear projector, a HyperCLOVA X SEED language model with
every muP scalar away from 1) for the image tests: a Hugging Face folder as save_pretrained
writes it, with EXAONE 4.5's test tokenizer, chat template and Qwen2VLImageProcessor
settings (exaone4_5_helpers: the processor is EXAONE 4.5's), and transformers'
HyperCLOVAXVisionV2Processor inputs for it."""

from __future__ import annotations

from pathlib import Path

import torch
from chat_processor import images_only, user_message_inputs
from exaone4_5_helpers import IMAGE, PROCESSOR, TEMPLATE, VIDEO, VOCAB, save_exaone4_5_dir
from helpers import randomize

TEXT = dict(
    model_type="hyperclovax",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    logits_scaling=3.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
)
# Heads of 8 features, windows of 112 pixels (4x4 merged tokens), the second of the three
# blocks attending to the whole image; the merger's output (48) is not the text's width.
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    out_hidden_size=48,
    fullatt_block_indexes=[1],
    window_size=112,
)


def tiny_hyperclovax_vision(seed: int = 1):
    """A random transformers HyperCLOVAXVisionV2ForConditionalGeneration: HyperCLOVA X SEED
    of hidden 64 in 2 layers, a vision tower of hidden 32 in 3 blocks (VISION); seed 1
    gives a greedy reply of more than one token repeated."""
    import transformers

    config = transformers.HyperCLOVAXVisionV2Config(
        text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO
    )
    torch.manual_seed(seed)
    model = transformers.HyperCLOVAXVisionV2ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm1", "norm2", "ln_q", "post_norm1", "post_norm2"):
                p.normal_(1.0, 0.1)
    return model


def save_hyperclovax_vision_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    return save_exaone4_5_dir(model, path)


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """transformers' HyperCLOVAXVisionV2Processor's inputs (input_ids, pixel_values,
    image_grid_thw) for one user message of `images` then `question`, with the generation
    prompt (Qwen2VLImageProcessorPil: the image processor transformers' auto classes give
    it)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = images_only(transformers.HyperCLOVAXVisionV2Processor)(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        # The folder's tokenizer.json as it is: AutoTokenizer would rebuild it as the
        # GPT2Tokenizer of HyperCLOVA X's own vocabulary, not the test's SentencePiece one.
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    return user_message_inputs(
        made, images, question, ("input_ids", "pixel_values", "image_grid_thw")
    )

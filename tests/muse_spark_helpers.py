"""A tiny random Muse Spark (MuseSparkForConditionalGeneration: Muse Glimmer's vision tower,
adapter and projection, a language model with experts, and a convolutional audio tower)
as a Hugging Face folder save_pretrained writes, with Muse Glimmer's tokenizer files
(tests/muse_glimmer_helpers.py: stories260K's tokenizer plus the turn and image tokens,
the chat template llama.cpp keeps as models/templates/muse-glimmer.jinja) and Muse
Spark's audio tokens after them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from muse_glimmer_helpers import MERGE, PATCH, PATCH_SIZE, SIDE, VIDEO, save_muse_glimmer_dir

# Ids 520 on, after Muse Glimmer's tokens.
AUDIO_TOKENS = ("<|audio|>", "<|soft_audio_start|>", "<|soft_audio_end|>")
AUDIO, VOCAB = 520, 523
SAMPLES_PER_TOKEN = 16  # the audio tower's patch sizes 4 x 2 x 2


def tiny_muse_spark(seed: int = 0):
    """A random transformers MuseSparkForConditionalGeneration. Its language model: hidden
    64 in three layers (two sliding ones of window 4 that rotate, then a global one
    without RoPE; a dense feed-forward first, then two of 8 experts, 2 a token, pooled to
    32), logits and router logits scaled by 0.6 and capped at 20, experts weighted 1.5x.
    Its vision tower is tests/muse_glimmer_helpers.py's; its audio tower folds 4, 2 and 2
    steps in three stages of widths 8, 16 and 32 (kernels of 3) and projects to 64.
    Its centered and input-scaled norms get N(0, 0.1) weights (x * (1 + w)), the residual
    gates and the router's selection bias N(0, 0.3), the others randomize()'s."""
    import transformers

    text = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        sliding_window=4,
        output_multiplier=0.6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_local_experts=8,
        num_experts_per_tok=2,
        moe_hidden_size=32,
        moe_intermediate_size=24,
        routed_scaling_factor=1.5,
        bos_token_id=1,
        eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=PATCH_SIZE,
        pos_emb_height=SIDE,
        pos_emb_width=SIDE,
        merge_size=MERGE,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    audio = dict(
        patch_sizes=[4, 2, 2],  # SAMPLES_PER_TOKEN
        hidden_sizes=[8, 16, 32],
        depths=[1, 1, 1],
        num_hidden_layers=3,
        conv_kernel_size=3,
        out_hidden_size=64,
    )
    config = transformers.MuseSparkConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_id=PATCH,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
        out_hidden_size=32 * MERGE * MERGE,
        projector_hidden_size=48,
    )
    torch.manual_seed(seed)
    model = transformers.MuseSparkForConditionalGeneration(config).eval()
    randomize(model)
    text_model = model.model.language_model
    with torch.no_grad():
        for name, p in text_model.named_parameters():
            if name.startswith("layers.") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
            elif name.endswith("residual_gate.gate"):
                p.normal_(0.0, 0.3)
        for name, b in text_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


def folder_of(tmp_path_factory) -> Path:
    """tiny_muse_spark()'s folder, written once a test session."""
    folder = tmp_path_factory.getbasetemp() / "muse_spark" / "folder"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        save_muse_glimmer_dir(tiny_muse_spark(), folder)
        tok = json.loads((folder / "tokenizer.json").read_text())
        for i, content in enumerate(AUDIO_TOKENS, start=AUDIO):
            added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
            tok["added_tokens"].append({**added, "normalized": False, "special": True})
        (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder

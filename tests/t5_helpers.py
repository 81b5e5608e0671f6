"""Tiny random T5-family folders (T5ForConditionalGeneration, UMT5ForConditionalGeneration,
LongT5ForConditionalGeneration, SwitchTransformersForConditionalGeneration: d_model 32, 2 + 2
layers) saved by transformers, with a small real SentencePiece Unigram tokenizer trained
here (T5's ids: pad 0, eos 1, unk 2) and saved by T5Tokenizer as a tokenizer.json. Relative
positions use 8 buckets up to a distance of 20, so a prompt of 40 tokens reaches the
logarithmic and the clamped buckets; the bias tables are drawn large enough that a bucket
bug moves the logits by units. Also T5Gemma and T5Gemma 2 folders (Gemma stacks 32 to 48
wide, 2 + 2 layers) with stories260K's tokenizer and Gemma's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from unigram_helpers import T5_OPTIONS, train

PROMPT = (
    "translate English to German: The quick brown fox jumps over the lazy dog, "
    "and the shells she sells are surely sea shells."
)
# variant -> (transformers class, config fields, whether the file holds its own lm_head)
VARIANTS = {
    # google/flan-t5-*, t5-v1_1: gated GELU, an untied head, no output scaling
    "flan": ("T5", {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}, True),
    # google-t5/t5-*: ReLU, the head tied to the embedding, outputs scaled by d_model**-0.5
    "v1.0": ("T5", {"feed_forward_proj": "relu"}, False),
    # google/umt5-*: flan's parts, a relative-bias table in every layer
    "umt5": ("UMT5", {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}, True),
    # google/long-t5-tglobal-*: flan's parts, the encoder's attention within 5 tokens (blocks
    # of 6) plus a global key per 8 tokens (the prompt's last partial block joining the one
    # before); a head of its own in the file
    "longt5-tglobal": (
        "LongT5",
        {
            "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": False,
            "encoder_attention_type": "transient-global",
            "local_radius": 5,
            "global_block_size": 8,
        },
        True,
    ),
    # google/long-t5-local-*: the encoder's attention within 5 tokens alone
    "longt5-local": (
        "LongT5",
        {
            "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": False,
            "encoder_attention_type": "local",
            "local_radius": 5,
        },
        False,
    ),
    # google/switch-base-*: v1.0's parts, each stack's second layer 4 experts (top-1 routed,
    # 16 tokens each at most: the prompt's overflow passes by)
    "switch": (
        "SwitchTransformers",
        {
            "num_experts": 4,
            "expert_capacity": 16,
            "num_sparse_encoder_layers": 1,
            "num_sparse_decoder_layers": 1,
        },
        False,
    ),
}


def tokenizer_folder(path: Path) -> Path:
    """A T5 tokenizer (spiece.model, which llama.cpp's converter reads, tokenizer.json,
    tokenizer_config.json) of a 200-piece Unigram."""
    from transformers import T5Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "spiece.model").write_bytes(train(vocab_size=200, **T5_OPTIONS))
    T5Tokenizer.from_pretrained(path, extra_ids=0).save_pretrained(path)
    return path


def t5_folder(path: Path, variant: str, tokenizer: Path, max_distance: int = 20) -> Path:
    """A tiny random `variant` (VARIANTS) folder at `path`, its tokenizer `tokenizer`'s;
    `max_distance`: its relative_attention_max_distance (llama.cpp reads none: 128)."""
    import transformers
    from safetensors.torch import load_file, save_file

    kind, fields, untied = VARIANTS[variant]
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=200,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=max_distance,
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        **fields,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    randomize(model, {"relative_attention_bias.weight": 10.0})
    model.save_pretrained(path)
    for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer / name).read_bytes())
    # The Hub's config.json files: no scale_decoder_outputs (transformers 5's), and
    # tie_word_embeddings false where the head is the file's own.
    saved = json.loads((path / "config.json").read_text())
    saved = {
        k: v for k, v in saved.items() if k not in ("scale_decoder_outputs", "tie_word_embeddings")
    }
    if untied:
        # transformers 5 saves every T5 tied; the Hub's flan-t5 and umt5 files hold their
        # own lm_head.weight, as written here (transformers then loads it untied).
        weights = load_file(path / "model.safetensors")
        weights["lm_head.weight"] = torch.randn(config.vocab_size, config.d_model) * 0.2
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        saved["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(saved))
    return path


def reference(path: Path):
    """transformers' model of the folder."""
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


# A T5Gemma of the 9b-2b kind: the encoder wider than the decoder (cross-attention from 48
# to 32 wide), grouped keys and values, sliding windows of 4 (each stack's first layer),
# scores scaled by query_pre_attn_scalar 12 (not the head width), soft-capping that bites.
T5GEMMA_STACK = dict(
    vocab_size=514,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=4,
    query_pre_attn_scalar=12,
    attn_logit_softcapping=3.0,
    final_logit_softcapping=5.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def t5gemma_folder(path: Path) -> Path:
    """A tiny random T5Gemma -it folder: stories260K's tokenizer (<s> 1 before a text, </s>
    2) plus Gemma's <start_of_turn> and <end_of_turn> (512, 513) and Gemma's chat template,
    as the Hub's -it folders ship theirs."""
    from helpers import GEMMA_TEMPLATE, GEMMA_TURN_TOKENS, STORIES_HF, TEMPLATES_DIR
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration

    config = T5GemmaConfig(
        encoder={**T5GEMMA_STACK, "hidden_size": 48},
        decoder={**T5GEMMA_STACK, "hidden_size": 32},
        vocab_size=514,
    )
    torch.manual_seed(0)
    model = T5GemmaForConditionalGeneration(config).eval()
    # Gemma's norms store the w of x * (1 + w): near 0, as trained ones. Embeddings small
    # beside the layers' output: the tied head otherwise repeats the last token forever.
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.1 if name.endswith("norm.weight") else 0.05 if "embed" in name else 0.3
            p.normal_(0, std)
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(GEMMA_TURN_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": (TEMPLATES_DIR / GEMMA_TEMPLATE).read_text(),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def t5gemma2_folder(path: Path) -> Path:
    """A tiny random T5Gemma 2 folder with its image encoder: Gemma 3 stacks 32 wide (grouped
    keys and values, sliding windows of 4 in each stack's first layer, RoPE bases of 10k and
    1M), SigLIP on 64-pixel images pooled to 4 tokens, and tests/vision_helpers.py's Gemma 3
    tokenizer, chat template and image processor (<start_of_image> 514, <end_of_image> 515,
    embedded as the file's own eoi_embedding, <image_soft_token> 516)."""
    from transformers import T5Gemma2Config, T5Gemma2ForConditionalGeneration
    from vision_helpers import (
        BOI,
        EOI,
        IMAGE,
        IMAGE_SIZE,
        TOKENS_PER_IMAGE,
        VOCAB,
        save_gemma3_vl_dir,
    )

    stack = {
        **T5GEMMA_STACK,
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "sliding_window": 4,  # even: the encoder's window looks 1 back and 2 ahead
        "attn_logit_softcapping": None,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=16,
    )
    tokens = dict(mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    config = T5Gemma2Config(
        encoder=dict(text_config=stack, vision_config=vision, image_token_index=IMAGE, **tokens),
        decoder=stack,
        image_token_index=IMAGE,
    )
    torch.manual_seed(0)
    model = T5Gemma2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # as t5gemma_folder's, the one embedding smaller still
        for name, p in model.named_parameters():
            std = 0.1 if name.endswith("norm.weight") else 0.02 if "embed" in name else 0.3
            p.normal_(0, std)
    return save_gemma3_vl_dir(model, path)

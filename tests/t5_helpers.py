"""Tiny random T5-family folders (T5ForConditionalGeneration, UMT5ForConditionalGeneration:
d_model 32, 2 + 2 layers) saved by transformers, with a small real SentencePiece Unigram
tokenizer trained here (T5's ids: pad 0, eos 1, unk 2) and saved by T5Tokenizer as a
tokenizer.json. Relative positions use 8 buckets up to a distance of 20, so a prompt of 40
tokens reaches the logarithmic and the clamped buckets; the bias tables are drawn large
enough that a bucket bug moves the logits by units."""

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

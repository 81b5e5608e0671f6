"""Tiny random BART, mBART and M2M100 folders (BartForConditionalGeneration,
MBartForConditionalGeneration, M2M100ForConditionalGeneration: d_model 32, 2 + 2 layers)
saved by transformers, with a byte-level BPE tokenizer.json trained here: BART's frames a
text as <s> ... </s> (RobertaProcessing), mBART's and M2M100's as en_XX ... </s> (the
mbart-large-50 and NLLB templates), a de_DE code added. Their generation_config.json are the
Hub's kinds: bart-large-cnn's (forced <s> first and </s> last, min_length,
no_repeat_ngram_size 3; its beams left out) and a translator's (de_DE forced first, as
transformers' forced_bos_token_id for the target language, </s> last)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from unigram_helpers import CORPUS

PROMPT = "The quick brown fox jumps over the lazy dog, and she sells sea shells by the shore."
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
LANGUAGES = ["en_XX", "de_DE"]
# variant -> (transformers class prefix, generation_config.json beyond the shared ids)
VARIANTS = {
    "bart": ("Bart", {"forced_bos_token_id": 0, "min_length": 12, "no_repeat_ngram_size": 3}),
    "mbart": ("MBart", {}),  # de_DE forced first: its id, set below
    "m2m_100": ("M2M100", {}),  # NLLB's and M2M100's: the same
}


def _tokenizer(path: Path, variant: str) -> int:
    """The variant's tokenizer.json and tokenizer_config.json; its vocabulary size."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing, TemplateProcessing

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        CORPUS * 4, vocab_size=300, min_frequency=1, special_tokens=SPECIALS
    )
    if variant == "bart":  # RoBERTa's
        tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    else:
        tokenizer.add_special_tokens([AddedToken(code, special=True) for code in LANGUAGES])
        en = tokenizer.token_to_id("en_XX")
        tokenizer.post_processor = TemplateProcessing(
            single="en_XX $A </s>",
            pair="en_XX $A $B </s>",
            special_tokens=[("en_XX", en), ("</s>", 2)],
        )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def bart_folder(path: Path, variant: str) -> Path:
    """The tiny `variant` (VARIANTS) folder at `path`."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = _tokenizer(path, variant)
    kind, generation = VARIANTS[variant]
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        scale_embedding=variant != "bart",
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
    )
    torch.manual_seed({"bart": 0, "mbart": 3, "m2m_100": 4}[variant])  # greedy tokens vary
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    randomize(model, {"q_proj.weight": 2.5, "k_proj.weight": 2.5})
    if variant != "m2m_100":  # M2M100 has no final_logits_bias
        with torch.no_grad():
            model.final_logits_bias.normal_(0, 0.3)
    model.save_pretrained(path)
    if variant != "bart":
        tokens = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
        generation = {
            "forced_bos_token_id": next(t["id"] for t in tokens if t["content"] == "de_DE")
        }
    transformers.GenerationConfig(
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        max_length=64,
        **generation,
    ).save_pretrained(path)
    return path


def reference(folder: Path, variant: str):
    import transformers

    kind = VARIANTS[variant][0]
    return getattr(transformers, f"{kind}ForConditionalGeneration").from_pretrained(folder).eval()

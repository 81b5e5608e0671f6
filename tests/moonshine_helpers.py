"""A tiny random Moonshine (MoonshineForConditionalGeneration: width 32, 2 + 2 layers of 2
heads, RoPE on 14 of each head's 16 features) saved as a Hugging Face folder: safetensors,
config.json, generation_config.json, preprocessor_config.json (Wav2Vec2FeatureExtractor's,
as the Hub's) and a small SentencePiece-style (Metaspace) BPE tokenizer.json with <unk>,
<s> and </s> first, as the Hub's (the real tokenizer is not offline)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize

CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "speech to text, and text to speech! ",
    "moonshine listens to raw audio? ",
] * 20


def write_tokenizer(path: Path, vocab: int = 160) -> int:
    """A Metaspace BPE tokenizer.json (<unk> 0, <s> 1, </s> 2) and tokenizer_config.json;
    the vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def tiny_moonshine_dir(path: Path, seed: int = 0, normalize: bool = False, max_length=24):
    """A random tiny Moonshine saved in `path` with its tokenizer and configs
    (generation_config.json's max_length `max_length`, None: none); the transformers model
    read back from it, and its feature extractor."""
    import transformers

    config = transformers.MoonshineConfig(
        vocab_size=write_tokenizer(path),
        hidden_size=32,
        intermediate_size=64,
        encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=2,
        encoder_num_attention_heads=2,
        decoder_num_attention_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.MoonshineForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(path)
    generation = {
        "bos_token_id": 1,
        "decoder_start_token_id": 1,
        "eos_token_id": 2,
        **({"max_length": max_length} if max_length else {}),
    }
    (path / "generation_config.json").write_text(json.dumps(generation))
    transformers.Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, do_normalize=normalize, return_attention_mask=True
    ).save_pretrained(path)
    hf = transformers.MoonshineForConditionalGeneration.from_pretrained(path).eval()
    return hf, transformers.Wav2Vec2FeatureExtractor.from_pretrained(path)

"""A tiny random Moonshine Streaming (MoonshineStreamingForConditionalGeneration: an encoder
of width 24, 2 layers of 2 query heads of 16 features over 1 key/value head in sliding
windows of (3, 1) and (2, 0) positions; a decoder of width 32, 2 layers of 2 heads with RoPE
on 12 of each head's 16 features, so the encoder's output is projected) saved as a Hugging
Face folder: safetensors, config.json, generation_config.json, processor_config.json
(Wav2Vec2FeatureExtractor's, as the Hub's: an attention mask, no normalization) and
Moonshine's small Metaspace BPE tokenizer (tests/moonshine_helpers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from moonshine_helpers import write_tokenizer


def tiny_moonshine_streaming_dir(path: Path, seed: int = 0):
    """A random tiny Moonshine Streaming saved in `path` with its tokenizer and configs; the
    transformers model read back from it, and its processor."""
    import transformers

    encoder = dict(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_windows=[[3, 1], [2, 0]],
    )
    config = transformers.MoonshineStreamingConfig(
        encoder_config=encoder,
        vocab_size=write_tokenizer(path),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # not a MoonshineStreamingConfig field, which its model reads
        max_position_embeddings=256,
        pad_head_dim_to_multiple_of=24,  # zeros in the attention: no change
    )
    torch.manual_seed(seed)
    model = transformers.MoonshineStreamingForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():  # the norms' scales near 1 (1 + gamma), the compression's k too
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "log_k")):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    generation = {"bos_token_id": 1, "decoder_start_token_id": 1, "eos_token_id": 2}
    (path / "generation_config.json").write_text(json.dumps({**generation, "max_length": 24}))
    extractor = transformers.Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, do_normalize=False, return_attention_mask=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    transformers.MoonshineStreamingProcessor(extractor, tokenizer).save_pretrained(path)
    hf = transformers.MoonshineStreamingForConditionalGeneration.from_pretrained(path).eval()
    return hf, transformers.MoonshineStreamingProcessor.from_pretrained(path)


def transcript(hf, processor, samples) -> tuple[list[int], str]:
    """transformers' greedy ids (after the decoder start, up to the end token) and text."""
    inputs = processor(samples, sampling_rate=16000)
    out = hf.generate(**inputs)
    row = out[0].tolist()[1:]
    ids = row[: row.index(2)] if 2 in row else row
    return ids, processor.batch_decode(out, skip_special_tokens=True)[0]

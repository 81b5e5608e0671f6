"""A tiny random Speech2Text (Speech2TextForConditionalGeneration: two convolutions over 16
mel bins, a 2-layer encoder and decoder of width 32 with 4 heads, the output head its own)
saved as a Hugging Face folder: safetensors, config.json,
generation_config.json, preprocessor_config.json (Speech2TextFeatureExtractor's) and
Speech2TextTokenizer's files: a small SentencePiece Unigram model (sentencepiece.bpe.model,
fairseq's special ids: <s> 0, <pad> 1, </s> 2, <unk> 3) and vocab.json, with do_upper_case
as facebook/s2t-small-librispeech-asr's (the real files are not offline)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from helpers import randomize

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speech to text and text to speech",
    "a transformer listens to the filterbank frames",
    "mister quilter is the apostle of the middle classes",
] * 10


def write_tokenizer(path: Path, vocab: int = 120) -> int:
    """sentencepiece.bpe.model (Unigram), vocab.json (its pieces at its ids) and
    tokenizer_config.json; the vocabulary's size."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab,
        hard_vocab_limit=False,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    (path / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    (path / "vocab.json").write_text(json.dumps(pieces))
    config = {"tokenizer_class": "Speech2TextTokenizer", "do_upper_case": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return len(pieces)


def tiny_speech_to_text_dir(path: Path, seed: int = 0):
    """A random tiny Speech2Text saved in `path` with its tokenizer and configs; the
    transformers model read back from it, and its processor."""
    import transformers

    config = transformers.Speech2TextConfig(
        vocab_size=write_tokenizer(path),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        conv_channels=16,
        input_feat_per_channel=16,
        max_source_positions=200,
        max_target_positions=64,
        # Untied: a random head tied to the embedding repeats the token it reads, ever.
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Speech2TextForConditionalGeneration(config).eval()
    # The token embedding small beside the positions (both scaled by sqrt(d_model)): the
    # random decoder's picks then vary with the position.
    randomize(model, {"embed_tokens.weight": 0.3})
    model.save_pretrained(path)
    generation = {"bos_token_id": 0, "decoder_start_token_id": 2, "eos_token_id": 2}
    (path / "generation_config.json").write_text(json.dumps({**generation, "max_length": 30}))
    extractor = transformers.Speech2TextFeatureExtractor(feature_size=16, num_mel_bins=16)
    tokenizer = transformers.Speech2TextTokenizer(
        path / "vocab.json", path / "sentencepiece.bpe.model", do_upper_case=True
    )
    transformers.Speech2TextProcessor(extractor, tokenizer).save_pretrained(path)
    hf = transformers.Speech2TextForConditionalGeneration.from_pretrained(path).eval()
    return hf, transformers.Speech2TextProcessor.from_pretrained(path)


def transcript(hf, processor, samples) -> tuple[list[int], str]:
    """transformers' greedy ids (after the decoder start, up to the end token) and text."""
    inputs = processor(samples, sampling_rate=16000, return_tensors="pt")
    out = hf.generate(**inputs)
    row = out[0].tolist()[1:]
    ids = row[: row.index(2)] if 2 in row else row
    return ids, processor.batch_decode(out, skip_special_tokens=True)[0]

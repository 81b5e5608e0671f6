"""A tiny random Cohere Transcribe (CohereAsrForConditionalGeneration: a 2-layer
FastConformer of width 32 over 16 mel bins, a 2-layer decoder of width 32 with grouped
keys and values) saved as a Hugging Face folder: safetensors (NeMo's names, as
save_pretrained writes them), config.json, generation_config.json, processor_config.json
(the feature extractor's settings, as transformers 5 saves a processor) and a small
SentencePiece-style (Metaspace) BPE tokenizer.json with the special tokens
CohereAsrProcessor's decoder prompt takes (the real tokenizer is not offline)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize

LANGUAGES = ("en", "de", "fr", "ja")
SPECIALS = (
    "<unk>",
    "<|nospeech|>",
    "<pad>",
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|pnc|>",
    "<|nopnc|>",
    "<|startofcontext|>",
    "<|itn|>",
    "<|noitn|>",
    "<|timestamp|>",
    "<|notimestamp|>",
    "<|diarize|>",
    "<|nodiarize|>",
    "<|emo:undefined|>",
    *(f"<|{code}|>" for code in LANGUAGES),
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "speech to text, and text to speech! ",
    "cohere transcribe listens to the audio? ",
    "der schnelle braune fuchs, le renard brun rapide. ",
] * 20


def write_tokenizer(path: Path, vocab: int = 200) -> dict[str, int]:
    """A Metaspace BPE tokenizer.json whose first ids are SPECIALS (pad 2, end 3, as
    CohereAsrConfig's defaults), and tokenizer_config.json; the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<|startoftranscript|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return {s: tokenizer.token_to_id(s) for s in SPECIALS}


def tiny_cohere_asr_dir(path: Path, seed: int = 0):
    """A random tiny Cohere Transcribe saved in `path` with its tokenizer and configs; the
    transformers model read back from it, and its processor."""
    import transformers

    ids = write_tokenizer(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    encoder = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_mel_bins=16,
        subsampling_conv_channels=8,
    )
    config = transformers.CohereAsrConfig(
        encoder_config=encoder,
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.CohereAsrForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():  # trained batch norms' statistics, not 0 and 1
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_(0, 0.2)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
        # The end token raised: the random model ends some transcripts before max_length.
        model.proj_out.bias[ids["<|endoftext|>"]] += 1.1
    model.save_pretrained(path)
    generation = {
        "bos_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<pad>"],
        "max_length": 40,
        # Some greedy picks of the random model suppressed, at the first step and all.
        "begin_suppress_tokens": [vocab["▁"]],
        "suppress_tokens": list(range(30, 200, 4)),
    }
    (path / "generation_config.json").write_text(json.dumps(generation))
    extractor = transformers.CohereAsrFeatureExtractor(feature_size=16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    transformers.CohereAsrProcessor(extractor, tokenizer).save_pretrained(path)
    hf = transformers.CohereAsrForConditionalGeneration.from_pretrained(path).eval()
    return hf, transformers.CohereAsrProcessor.from_pretrained(path)


def transcript(hf, processor, samples, language: str) -> tuple[list[int], str]:
    """transformers' greedy ids after the processor's decoder prompt (each chunk's, up to
    its end token), and the text, the chunks' joined as the processor's decode joins them."""
    inputs = processor(samples, language=language, sampling_rate=16000)
    chunks = inputs.pop("audio_chunk_index")
    out = hf.generate(**inputs)
    prompt = inputs["decoder_input_ids"].shape[1] + 1  # generate's decoder start first
    eos, ids = hf.generation_config.eos_token_id, []
    for row in out.tolist():
        row = row[prompt:]
        ids += row[: row.index(eos)] if eos in row else row
    text = processor.decode(
        out, skip_special_tokens=True, audio_chunk_index=chunks, language=language
    )
    return ids, text[0]

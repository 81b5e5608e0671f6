"""Tiny random Parakeet recognizers (ParakeetForTDT, ParakeetForRNNT, ParakeetForCTC: a
2-layer FastConformer of width 32 over 16 mel bins; the transducers' prediction network of
two LSTMs of width 24) saved as Hugging Face folders: safetensors, config.json,
generation_config.json (the blank as decoder start; TDT's duration columns suppressed, as
transformers' generate needs of a model that does not learn to leave them), processor_config.json
(ParakeetFeatureExtractor's settings and the decoder type) and a small Metaspace BPE
tokenizer.json whose last id is the blank (<blank> for a transducer, <pad> for CTC, as the
Hub's folders have them; the real tokenizers are not offline); transformers' transcripts and
token times of a clip."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize

CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "speech to text, and text to speech! ",
    "parakeet listens to the audio? ",
] * 20
BLANK_BIAS = {"tdt": 1.0, "rnnt": 2.0}  # blanks as common as tokens, as trained models emit
KINDS = {"tdt": "ParakeetForTDT", "rnnt": "ParakeetForRNNT", "ctc": "ParakeetForCTC"}


def write_tokenizer(path: Path, blank: str) -> int:
    """tokenizer.json (<unk>, then <pad> unless it is the blank, the pieces, the blank last)
    and tokenizer_config.json; the vocabulary's size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    specials = ["<unk>"] + (["<pad>"] if blank != "<pad>" else [])
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens([AddedToken(blank, special=True)])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "ParakeetTokenizer", "unk_token": "<unk>", "pad_token": "<pad>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def tiny_parakeet_dir(path: Path, kind: str, seed: int = 0):
    """A random tiny Parakeet of `kind` ("tdt", "rnnt" or "ctc") saved in `path` with its
    tokenizer and configs; the transformers model read back from it, and its processor."""
    import transformers

    vocab = write_tokenizer(path, "<pad>" if kind == "ctc" else "<blank>")
    encoder = transformers.ParakeetEncoderConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_mel_bins=16,
        subsampling_conv_channels=8,
    )
    if kind == "ctc":
        config = transformers.ParakeetCTCConfig(
            encoder_config=encoder, vocab_size=vocab, pad_token_id=vocab - 1
        )
    else:
        make = transformers.ParakeetTDTConfig if kind == "tdt" else transformers.ParakeetRNNTConfig
        config = make(
            encoder_config=encoder,
            vocab_size=vocab,
            decoder_hidden_size=24,
            num_decoder_layers=2,
            blank_token_id=vocab - 1,
            pad_token_id=1,
            max_symbols_per_step=4,
        )
    torch.manual_seed(seed)
    model = getattr(transformers, KINDS[kind])(config).eval()
    randomize(model)
    with torch.no_grad():
        # Position-dependent encodings: random biases and LayerNorm scales of N(0, 0.2) (the
        # blocks' are named norm_*) leave every position nearly the same vector.
        for name, p in model.named_parameters():
            if name.startswith("encoder.subsampling."):
                p.mul_(2.0)
            elif ".norm_" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.mul_(0.2)
            if ".self_attn.o_proj." in name:  # near-uniform attention: the same everywhere
                p.mul_(0.1)
        # trained batch norms' statistics, not 0 and 1
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_(0, 0.2)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
        if kind != "ctc":
            model.joint.head.bias[vocab - 1] += BLANK_BIAS[kind]
    model.save_pretrained(path)
    if kind != "ctc":
        generation = {"decoder_start_token_id": vocab - 1}
        if kind == "tdt":
            generation["suppress_tokens"] = list(range(vocab, vocab + len(config.durations)))
        (path / "generation_config.json").write_text(json.dumps(generation))
    extractor = transformers.ParakeetFeatureExtractor(feature_size=16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.ParakeetProcessor(extractor, tokenizer, decoder_type=kind)
    processor.save_pretrained(path)
    hf = getattr(transformers, KINDS[kind]).from_pretrained(path).eval()
    return hf, transformers.ParakeetProcessor.from_pretrained(path)


def transcript(hf, processor, samples) -> tuple[list[int], str]:
    """transformers' generate's tokens but the blank and the pad (for CTC, each position's
    argmax, repeats collapsed first) and the text, the processor's batch_decode."""
    inputs = processor(samples, sampling_rate=16000)
    with torch.no_grad():
        out = hf.generate(**inputs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    row = sequences[0].tolist()
    if isinstance(out, torch.Tensor):  # CTC
        row = [token for i, token in enumerate(row) if i == 0 or token != row[i - 1]]
    else:
        row = row[1:]  # the decoder start token
    blank = getattr(hf.config, "blank_token_id", hf.config.pad_token_id)
    ids = [t for t in row if t not in (blank, processor.tokenizer.pad_token_id)]
    return ids, processor.batch_decode(sequences, skip_special_tokens=True)[0]


def token_times(hf, processor, samples) -> list[tuple[float, float]]:
    """The (start, end) seconds of generate's tokens but the blank and the pad, as the
    processor's decode times them from generate's durations."""
    inputs = processor(samples, sampling_rate=16000)
    with torch.no_grad():
        out = hf.generate(**inputs)
    _, (times,) = processor.decode(out.sequences, durations=out.durations, skip_special_tokens=True)
    return [(t["start"], t["end"]) for t in times]

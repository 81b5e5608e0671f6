"""Tiny random wav2vec 2.0 CTC models (Wav2Vec2ForCTC: three strided convolutions of 16
channels, 2 layers of width 32) saved as Hugging Face folders: safetensors, config.json,
processor_config.json (Wav2Vec2FeatureExtractor's settings) and a Wav2Vec2CTCTokenizer's
vocab.json of characters and tokenizer_config.json (the real files are not offline). "base"
is facebook/wav2vec2-base-960h's kind (a group-normalized first convolution, post-LayerNorm
layers), "large" the large and XLSR models' (layer-normalized convolutions, pre-LayerNorm
layers and a final LayerNorm), "hubert" a HubertForCTC (base's, without the projection's
LayerNorm) whose tokenizer_config.json names no tokenizer_class, as the Hub's
facebook/wav2vec2-base-960h names none, "data2vec" a Data2VecAudioForCTC (a stack of two
positional convolutions), "wavlm" a WavLMForCTC (gated relative positions, few buckets so
that a clip's positions reach the log-spaced ones)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize

SPECIALS = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4}
VOCAB = {**SPECIALS, **{c: 5 + i for i, c in enumerate("ETAOINSHRDLUCMWFGYPBVK'XJQZ")}}
KINDS = {
    "base": dict(feat_extract_norm="group", do_stable_layer_norm=False),
    "large": dict(feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True),
    "hubert": dict(feat_extract_norm="group", feat_proj_layer_norm=False),
    "data2vec": dict(conv_pos_kernel_size=5, num_conv_pos_embeddings=2),
    "wavlm": dict(
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        num_buckets=16,
        max_bucket_distance=40,
        conv_stride=(5, 4, 4),  # fewer positions: its position bias is a slow [T, T] mask
    ),
}
CLASSES = {"hubert": "Hubert", "data2vec": "Data2VecAudio", "wavlm": "WavLM"}


def tiny_wav2vec2_dir(path: Path, kind: str, seed: int = 0):
    """A random tiny Wav2Vec2ForCTC (HubertForCTC) of `kind` saved in `path` with its
    tokenizer and feature extractor; the transformers model read back from it, and its
    processor."""
    import transformers

    (path / "vocab.json").write_text(json.dumps(VOCAB))
    tokenizer = transformers.Wav2Vec2CTCTokenizer(str(path / "vocab.json"))
    name = CLASSES.get(kind, "Wav2Vec2")
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embedding_groups=4,
        **{"num_conv_pos_embeddings": 16, "conv_stride": (5, 2, 2), **KINDS[kind]},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCTC")(config).eval()
    randomize(model)
    with torch.no_grad():  # blanks and word delimiters as common as a trained model's
        model.lm_head.bias[VOCAB["<pad>"]] += 1.0
        model.lm_head.bias[VOCAB["|"]] += 0.5
    model.save_pretrained(path)
    extractor = transformers.Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, do_normalize=True, return_attention_mask=False
    )
    processor = transformers.Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    hf = getattr(transformers, f"{name}ForCTC").from_pretrained(path).eval()
    processor = transformers.Wav2Vec2Processor.from_pretrained(path)
    if kind == "hubert":
        config = json.loads((path / "tokenizer_config.json").read_text())
        del config["tokenizer_class"]
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return hf, processor


def transcript(hf, processor, samples) -> tuple[list[int], str]:
    """transformers' argmax of each frame, repeats collapsed and the blank dropped, and the
    text, the processor's batch_decode."""
    inputs = processor(samples, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        best = hf(**inputs).logits.argmax(-1)
    row = best[0].tolist()
    grouped = [t for i, t in enumerate(row) if i == 0 or t != row[i - 1]]
    ids = [t for t in grouped if t != hf.config.pad_token_id]
    return ids, processor.batch_decode(best)[0]

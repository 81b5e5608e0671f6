"""Tiny random TrOCR folders (VisionEncoderDecoderModel: a ViT or DeiT of width 32, one layer,
32-pixel images in patches of 8, and a TrOCR decoder of d_model 32, 2 layers) saved by
transformers, with florence2_helpers' byte-level BPE tokenizer (no tokens added) and
TrOCRProcessor's files:
the ViT's ViTImageProcessor (a bilinear resize to 32 x 32, mean and std 0.5), the DeiT's
DeiTImageProcessor (bicubic to 40 x 40, a centre crop to 32 x 32, ImageNet's mean and std;
its decoder's positions sinusoids, its embeddings scaled)."""

from __future__ import annotations

from pathlib import Path

import torch
from florence2_helpers import tokenizer_files
from helpers import randomize


def trocr_folder(path: Path, encoder: str = "vit") -> Path:
    """The tiny folder at `path` with a `encoder` ("vit" or "deit") image encoder."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = tokenizer_files(path, ())
    kind = transformers.ViTConfig if encoder == "vit" else transformers.DeiTConfig
    vision = kind(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        image_size=32,
        patch_size=8,
    )
    decoder = transformers.TrOCRConfig(
        vocab_size=vocab_size,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=48,
        # the DeiT's fewer than its 18 image tokens: positions bound the reply, not the image
        max_position_embeddings=64 if encoder == "vit" else 16,
        cross_attention_hidden_size=32,
        use_learned_position_embeddings=encoder == "vit",
        scale_embedding=encoder == "deit",
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(vision, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 2, 1, 2
    torch.manual_seed(8 if encoder == "vit" else 3)  # seeds whose greedy replies vary
    model = transformers.VisionEncoderDecoderModel(config).eval()
    randomize(model, {"q_proj.weight": 2.5, "k_proj.weight": 2.5})
    model.save_pretrained(path)
    transformers.GenerationConfig(
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, max_length=40
    ).save_pretrained(path)
    if encoder == "vit":
        images = transformers.ViTImageProcessorPil(
            size={"height": 32, "width": 32}, resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
        )
    else:
        images = transformers.DeiTImageProcessorPil(
            size={"height": 40, "width": 40}, crop_size={"height": 32, "width": 32}
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    transformers.TrOCRProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    return path


def reference(path: Path):
    """transformers' model and processor of the folder."""
    import transformers

    model = transformers.VisionEncoderDecoderModel.from_pretrained(path).eval()
    positions = model.decoder.model.decoder.embed_positions
    if not model.config.decoder.use_learned_position_embeddings:
        # from_pretrained leaves the sinusoid table on the meta device (transformers 5.25)
        positions.weights = positions.get_embedding(
            positions.weights.shape[0], positions.embedding_dim, positions.padding_idx
        )
    return model, transformers.AutoProcessor.from_pretrained(path)

"""A tiny random Marian folder (MarianMTModel: d_model 32, 2 + 2 layers) saved by
transformers, with a small real SentencePiece Unigram (trained here, the same model as
source.spm and target.spm) and a vocab.json laid out as opus-mt's are (</s> 0, <unk> 1, the
pieces, a ">>deu<<" language code, <pad> last), saved by MarianTokenizer, and opus-mt's
generation_config.json (<pad> the decoder start and a bad word, </s> forced at max_length).
final_logits_bias is drawn too, <pad>'s high enough that greedy decoding would choose it
every step if it were not banned."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from unigram_helpers import processor, train

PROMPT = "The quick brown fox jumps over the lazy dog, and she sells sea shells."
LANGUAGE_CODE = ">>deu<<"


def marian_folder(path: Path) -> Path:
    """The tiny Marian folder at `path`."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel, MarianTokenizer

    path.mkdir(parents=True, exist_ok=True)
    spm = train(vocab_size=250)  # SentencePiece's ids unk 0, <s> 1, </s> 2

    (path / "source.spm").write_bytes(spm)
    (path / "target.spm").write_bytes(spm)
    sp = processor(spm)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    tokens = ["</s>", "<unk>", *pieces[3:], LANGUAGE_CODE, "<pad>"]
    (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    MarianTokenizer(
        str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json")
    ).save_pretrained(path)
    pad = len(tokens) - 1
    config = MarianConfig(
        vocab_size=len(tokens),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        scale_embedding=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
    )
    torch.manual_seed(12)
    model = MarianMTModel(config)
    # Sharper attention than randomize's draw: greedy decoding then varies its tokens.
    randomize(model, {"q_proj.weight": 2.5, "k_proj.weight": 2.5})
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.3)
        model.final_logits_bias[0, pad] = 10.0  # only bad_words_ids keeps <pad> out
    model.save_pretrained(path)
    GenerationConfig(
        bad_words_ids=[[pad]],
        bos_token_id=0,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        max_length=64,
        pad_token_id=pad,
    ).save_pretrained(path)
    return path


def reference(folder: Path):
    from transformers import MarianMTModel

    return MarianMTModel.from_pretrained(folder).eval()

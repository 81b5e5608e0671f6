"""A tiny random Florence-2 folder (Florence2ForConditionalGeneration: a two-stage DaViT of
widths 16 and 32, a BART of d_model 32, 1 + 1 layers) saved by transformers, with a byte-level
BPE tokenizer trained here (BART's <s> ... </s> frame, <image> and LOCATIONS added) and the
processor's files: a 64 x 64 bicubic resize, ImageNet's mean and std, 65 image tokens (an
8 x 8 grid and its mean), which windows of 3 pad."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from tokenizers import Tokenizer
from unigram_helpers import CORPUS

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
IMAGE = "<image>"
# Florence-2's tokenizer marks its task and location tokens special, as these.
LOCATIONS = ("<od>", "</od>", "<loc_0>", "<loc_999>")
SIZE = 64
# Florence2Processor's post_processor_config, as the converted folders on the Hub hold it.
POST_PROCESSOR = {
    "ocr": {"PATTERN": r"(.+?)" + r"<loc_(\d+)>" * 8, "AREA_THRESHOLD": 0.0},
    "phrase_grounding": {"banned_grounding_tokens": ["the image"]},
    "pure_text": {},
    "description_with_bboxes": {},
    "description_with_polygons": {},
    "polygons": {},
    "bboxes": {},
    "description_with_bboxes_or_polygons": {},
}
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def tokenizer_files(path: Path, added: tuple[str, ...] = (IMAGE, *LOCATIONS)) -> int:
    """tokenizer.json and tokenizer_config.json, the `added` special tokens after the
    trained ones; the vocabulary size."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        CORPUS * 4, vocab_size=300, min_frequency=1, special_tokens=SPECIALS
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in added])
    tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    if IMAGE in added:  # Florence2Processor reads the tokenizer's image_token
        config["extra_special_tokens"] = {"image_token": IMAGE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def florence2_folder(path: Path) -> Path:
    """The tiny Florence-2 folder at `path`, its processor saved by Florence2Processor."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = tokenizer_files(path)
    image = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(IMAGE)
    config = transformers.Florence2Config(
        vision_config=dict(
            depths=[1, 1],
            patch_size=[7, 3],
            patch_stride=[4, 2],
            patch_padding=[3, 1],
            patch_prenorm=[False, True],
            embed_dim=[16, 32],
            num_heads=[2, 4],
            num_groups=[2, 4],
            window_size=3,
            projection_dim=32,
            max_position_embeddings=20,
            max_temporal_embeddings=10,
        ),
        text_config=dict(
            model_type="bart",
            vocab_size=vocab_size,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            max_position_embeddings=128,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
        image_token_id=image,
    )
    torch.manual_seed(3)  # a seed whose greedy reply varies
    model = transformers.Florence2ForConditionalGeneration(config).eval()
    randomize(model, {"q_proj.weight": 2.5, "k_proj.weight": 2.5})
    model.save_pretrained(path)
    transformers.GenerationConfig(
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, max_length=40
    ).save_pretrained(path)
    processor = transformers.Florence2Processor(
        image_processor=transformers.CLIPImageProcessorPil(
            size={"height": SIZE, "width": SIZE},
            crop_size={"height": SIZE, "width": SIZE},
            do_center_crop=False,
            image_mean=MEAN,
            image_std=STD,
            image_seq_length=65,
        ),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
    )
    processor.save_pretrained(path)
    return path


def reference(path: Path):
    """transformers' model and processor of the folder."""
    import transformers

    model = transformers.Florence2ForConditionalGeneration.from_pretrained(path).eval()
    return model, transformers.AutoProcessor.from_pretrained(path)

"""A tiny random Unlimited-OCR (SAM ViT, CLIP over SAM's features, a linear projector, a
DeepSeek MoE text model) for the image tests: a Hugging Face folder as save_pretrained
writes it (DeepSeek-OCR's own checkpoint keys; deepseek_ocr2_helpers' tokenizer and chat
template; the image processor's settings: a 1024-pixel whole view and 640-pixel crops on
16-pixel patches, which llama.cpp takes as fixed), transformers' UnlimitedOcrProcessor
inputs for it, and its files as llama.cpp's converter writes them from the checkpoint (a
deepseek2-ocr text GGUF, an mmproj GGUF of projector type deepseekocr)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from deepseek_ocr2_helpers import (
    IMAGE,
    TEMPLATE,
    TINY_SAM,
    TINY_TEXT,
    sam_mmproj_name,
    save_deepseek_ocr2_dir,
    write_vision_tensors,
)
from helpers import randomize

PATCH, SIZE, TILE = 16, 1024, 640
SLIDING_WINDOW = 128  # UnlimitedOcrTextConfig's; 8 greedy tokens never reach it
PROCESSOR = {
    "image_processor_type": "UnlimitedOcrImageProcessor",
    "size": {"height": SIZE, "width": SIZE},
    "tile_size": TILE,
    "crop_to_patches": True,
    "min_patches": 2,
    "max_patches": 32,
    "background_color": [127, 127, 127],
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 1 / 255,
}


def tiny_unlimited_ocr(seed: int = 0, sliding_window: int = SLIDING_WINDOW):
    """A random transformers UnlimitedOcrForConditionalGeneration: SAM of hidden 32 in
    three layers (two windowed, then the global one at index 2, where llama.cpp has its
    first) on patches of 16, CLIP of 32 in four layers over SAM's 32 features (llama.cpp's
    converter names SAM's layers and its neck's 4 modules only up to CLIP's count), its
    position table a 16x16 grid (the whole view's: the crops' 10x10 grids take it resized), a
    DeepSeek MoE text of hidden 64 (a dense layer, then 4 experts of which 2 are taken,
    and a shared one), its reference sliding window `sliding_window` tokens."""
    import transformers

    clip = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=224,
        patch_size=14,
    )
    config = transformers.UnlimitedOcrConfig(
        vision_config=dict(sam_config=dict(TINY_SAM), encoder_config=clip),
        text_config={**TINY_TEXT, "sliding_window": sliding_window},
        image_token_id=IMAGE,
    )
    torch.manual_seed(seed)
    model = transformers.UnlimitedOcrForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_unlimited_ocr_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    save_deepseek_ocr2_dir(model, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' UnlimitedOcrProcessor for the folder. Its image processor needs
    torchvision; DeepSeek-OCR 2's Pillow backend under Unlimited-OCR's settings prepares
    the same pixels where crop_to_patches (UnlimitedOcrImageProcessor._preprocess differs
    only without it), and the crops' grid that the processor counts tokens by is the one
    UnlimitedOcrImageProcessor takes, from transformers' get_optimal_tiled_canvas."""
    import transformers
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import (
        DeepseekOcr2ImageProcessorPil,
        get_optimal_tiled_canvas,
    )

    class WithGrid(DeepseekOcr2ImageProcessorPil):
        def preprocess(self, images, *args, **kwargs):
            out = super().preprocess(images, *args, **kwargs)
            sizes = [(image.height, image.width) for image in images]
            out["patches_grid"] = [
                get_optimal_tiled_canvas((h, w), (TILE, TILE), 2, 32)
                if max(h, w) > TILE
                else (1, 1)
                for h, w in sizes
            ]
            return out

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.UnlimitedOcrProcessor(
        image_processor=WithGrid(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH,
        chat_template=TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs for one user message of `images` then `question`
    (num_local_patches as the model takes it: a list)."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    inputs = dict(made(text=text, images=images, return_tensors="pt", add_special_tokens=False))
    inputs["num_local_patches"] = [int(n) for n in inputs["num_local_patches"]]
    if "pixel_values_local" not in inputs:
        inputs.pop("patches_grid")
    return inputs


_VISION_NAMES = {
    "model.sam_model.pos_embed": "v.sam.pos_embd.weight",
    "model.sam_model.patch_embed.proj": "v.sam.patch_embd",
    "model.sam_model.net_2": "v.sam.net_2",
    "model.sam_model.net_3": "v.sam.net_3",
    "model.vision_model.embeddings.class_embedding": "v.class_embd",
    "model.vision_model.embeddings.position_embedding": "v.position_embd",
    "model.vision_model.pre_layrnorm": "v.pre_ln",
    "model.projector.layers": "mm.model.fc",
    "model.image_newline": "v.image_newline",
    "model.view_seperator": "v.view_seperator",
}
_CLIP_NAMES = {
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.out_proj": "attn_out",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
# What the converter keeps in F32 whatever --outtype says (tensor_force_quant).
_KEPT_F32 = (".embeddings.", "pos_embed", "rel_pos_h", "rel_pos_w", ".neck.", ".net_")


def _mmproj_name(name: str) -> str:
    named = sam_mmproj_name(name, _VISION_NAMES)
    if named is not None:
        return named
    parts = name.split(".")
    # model.vision_model.transformer.layers.N.<module>.<suffix>
    layer, rest = parts[4], ".".join(parts[5:-1])
    return f"v.blk.{layer}.{_CLIP_NAMES[rest]}.{parts[-1]}"


def write_mmproj(model, folder: Path, path: Path, f16: bool = True) -> Path:
    """The vision parts as llama.cpp's converter writes an mmproj GGUF from DeepSeek-OCR's
    checkpoint (conversion/deepseek.py UnlimitedOCRVisionModel; checked once against the
    converter run on the folder with DeepSeek's own config.json: equal tensors and
    metadata, F32 and F16): clip.* metadata with
    projector type deepseekocr and up to 32 crops, F32 tensors but the matrices' F16
    (without `f16`, all F32: --outtype f32), the embeddings, position tables and
    convolutions after the patches' F32."""
    import gguf

    vision = model.config.vision_config
    sam, clip = vision.sam_config, vision.encoder_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, clip.image_size),
        (key.PATCH_SIZE, clip.patch_size),
        (key.EMBEDDING_LENGTH, clip.hidden_size),
        (key.FEED_FORWARD_LENGTH, 4 * clip.num_attention_heads),  # the converter's, unread
        (key.BLOCK_COUNT, clip.num_hidden_layers),
        (key.Attention.HEAD_COUNT, clip.num_attention_heads),
        (key.Projector.SCALE_FACTOR, 1),  # CLIP's 224 / 14 patches over a 16-token side
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, [0.5, 0.5, 0.5])
    writer.add_array(key.IMAGE_STD, [0.5, 0.5, 0.5])
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, "deepseekocr")
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)  # the converter's; clip.cpp's 1e-5
    writer.add_bool(key.USE_GELU, True)
    for name, value in (
        (key.WINDOW_SIZE, sam.window_size),
        (key.PREPROC_MIN_TILES, 2),
        (key.PREPROC_MAX_TILES, 32),
        (key.SAM.BLOCK_COUNT, sam.num_hidden_layers),
        (key.SAM.EMBEDDING_LENGTH, sam.hidden_size),
        (key.SAM.HEAD_COUNT, sam.num_attention_heads),
    ):
        writer.add_uint32(name, value)
    return write_vision_tensors(writer, folder, path, f16, _KEPT_F32, _mmproj_name)

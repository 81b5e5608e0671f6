"""A tiny random Llama 4 with its vision tower (Llama4ForConditionalGeneration) for the
image tests: a Hugging Face folder as save_pretrained writes it (stories260K's tokenizer
plus Llama 4's header and image tokens, Llama4Processor's chat template, a
preprocessor_config.json), transformers' Llama4Processor inputs for it, and the model as
llama.cpp's converter writes it: a text GGUF (arch llama4, llama4_helpers) and an mmproj
GGUF (conversion/llama4.py Llama4VisionModel)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_HF, randomize
from llama4_helpers import write_llama4_gguf

# Ids 512 on, after stories260K's 512 tokens.
LLAMA4_TOKENS = (
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
)
IMAGE_START, IMAGE_END, IMAGE, PATCH, TILE_X, TILE_Y = range(515, 521)
VOCAB = 528
# 84-pixel tiles of 6x6 patches of 14 pixels, pixel-shuffled 2x2: 9 tokens a tile; up to
# MAX_TILES tiles.
TILE, PATCH_SIZE, TOKENS_PER_TILE, MAX_TILES = 84, 14, 9, 6
TEXT = dict(
    model_type="llama4_text",
    hidden_size=64,
    intermediate_size=32,  # each expert's
    intermediate_size_mlp=96,  # the dense layer's
    # Dense and MoE (2 experts) layers in turn; three chunked ones with RoPE, then a NoPE one
    # attending to everything (llama-server fails on a model without one).
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    num_local_experts=2,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens, not an early <|eot|>
    pad_token_id=0,
    tie_word_embeddings=False,
)
# Llama 4's vision shape (Scout's: hidden 1408 in 34 layers, 336-pixel tiles), shrunk.
VISION = dict(
    hidden_size=32,
    intermediate_size=128,  # 4 x hidden: the width of a pixel-shuffled token
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=PATCH_SIZE,
    pixel_shuffle_ratio=0.5,
    projector_input_dim=48,
    projector_output_dim=48,
    vision_output_dim=48,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
PROCESSOR = {
    "image_processor_type": "Llama4ImageProcessorFast",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_patches": MAX_TILES,
    "resample": 2,
    "rescale_factor": 1 / 255,
    "resize_to_max_canvas": False,
    "size": {"height": TILE, "width": TILE},
}


def chat_template() -> str:
    """Llama 4's chat template, as Llama4Processor has it."""
    from transformers.models.llama4.processing_llama4 import chat_template

    return chat_template


def tiny_llama4(seed: int = 0, vision_layers: int = 2):
    """A random transformers Llama4ForConditionalGeneration: text hidden 64 in 4 layers
    (dense and 2 experts in turn, the last without RoPE), a vision tower of hidden 32 in `vision_layers` layers on
    84-pixel tiles; its LayerNorms' scales near 1. (llama.cpp's converter maps the
    adapter's fc2 only where the tower has 3 layers or more.)"""
    import transformers

    config = transformers.Llama4Config(
        text_config=TEXT,
        vision_config={**VISION, "num_hidden_layers": vision_layers},
        image_token_index=PATCH,
    )
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("vision_model.layernorm_") and name.endswith(".weight"):
                p.normal_(1.0, 0.1)
    return model


def save_llama4_dir(model, path: Path, **processor_settings) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (Scout's, but tiles of TILE pixels and at most MAX_TILES)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(LLAMA4_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template(),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {**PROCESSOR, **processor_settings}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def processor(folder: Path, **settings):
    """transformers' Llama4Processor for the folder (its image processor needs
    torchvision); `settings`: the image processor's, over the folder's."""
    import transformers
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

    stored = json.loads((folder / "preprocessor_config.json").read_text())
    keys = ("image_mean", "image_std", "max_patches", "resize_to_max_canvas", "size")
    fields = {**{k: stored[k] for k in keys}, **settings}
    return transformers.Llama4Processor(
        image_processor=Llama4ImageProcessor(**fields),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH_SIZE,
        pixel_shuffle_ratio=0.5,
        chat_template=chat_template(),
    )


def prompt_text(folder: Path, images: int, question: str) -> str:
    """transformers' rendering of the chat template around one user message of `images`
    then `question`, with the generation prompt."""
    import transformers

    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def processor_inputs(folder: Path, images: list, question: str, **settings) -> dict:
    """The processor's inputs (input_ids, pixel_values, as float32) for one user message
    of `images` then `question`, with the generation prompt."""
    made = processor(folder, **settings)
    text = prompt_text(folder, len(images), question)
    inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {
        "input_ids": inputs["input_ids"],
        "attention_mask": inputs["attention_mask"],
        "pixel_values": inputs["pixel_values"].float(),
    }


def model_inputs(vision, ids: list[int], images: list) -> dict:
    """transformers' inputs for prompt ids and images prepared by llmrun
    (llama4_images.pixel_values, whose equality with the processor's GOLDEN checks)."""
    from llmrun import llama4_images

    frames = torch.cat([llama4_images.pixel_values(vision, image)[0] for image in images])
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": frames,
    }


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of the inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# The processor's inputs for these images (height, width, picture seed) and image
# processor settings over PROCESSOR's, stored in GOLDEN: transformers' Llama4ImageProcessor
# needs torchvision, which the suite goes without (test_the_stored_inputs_are_the_processors
# checks them where it is installed; processor_record rewrites them).
GOLDEN = Path(__file__).parent / "data" / "llama4_vision_processor.json"
GOLDEN_QUESTION = "What is it?"
GOLDEN_CASES = (
    ((60, 50, 1), {}),  # smaller than a tile: one tile, padded, not enlarged
    ((84, 84, 2), {}),  # one tile exactly
    ((100, 260, 3), {}),  # 2 x 3 tiles and the whole image, padded at the bottom
    ((200, 90, 4), {}),  # 3 x 2 tiles, padded at the right
    ((400, 500, 5), {}),  # shrunk onto 2 x 3 tiles
    ((40, 130, 6), {"resize_to_max_canvas": True}),  # enlarged onto 1 x 4
    ((500, 333, 7), {"max_patches": 16}),  # 5 x 3
)


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Two checksums of pixel values: their sum, and their sum weighted by position
    (which moves where values change places)."""
    flat = pixels.double().flatten()
    weights = (torch.arange(flat.numel(), dtype=torch.float64) % 251) + 1
    return [flat.sum().item(), (flat * weights).sum().item()]


def processor_record(folder: Path) -> list[dict]:
    """The processor's input ids, tile grid and pixel checksums for GOLDEN_CASES
    (json.dumps of it is GOLDEN)."""
    from vision_helpers import picture

    from llmrun.images import open_image

    records = []
    for (height, width, seed), settings in GOLDEN_CASES:
        made = processor(folder, **settings)
        image = open_image(picture(height, width, seed))
        text = prompt_text(folder, 1, GOLDEN_QUESTION)
        out = made(text=text, images=[image], return_tensors="pt", add_special_tokens=False)
        grid = made.image_processor(image, **settings)["aspect_ratios"][0].tolist()
        records.append(
            {
                "image": [height, width, seed],
                "settings": settings,
                "input_ids": out["input_ids"][0].tolist(),
                "grid": grid,
                "frames": out["pixel_values"].shape[0],
                "pixel_sums": pixel_sums(out["pixel_values"]),
            }
        )
    return records


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (arch llama4, F32) with
    stories260K's vocabulary plus LLAMA4_TOKENS as control tokens and the chat template."""
    extra = [*LLAMA4_TOKENS, *(f"<pad{i}>" for i in range(VOCAB - 512 - len(LLAMA4_TOKENS)))]

    def keys(writer) -> None:
        writer.add_add_bos_token(False)  # the chat template writes it
        writer.add_add_space_prefix(False)  # as the text of the folder's tokenizer.json
        writer.add_chat_template(chat_template())

    return write_llama4_gguf(path, model.language_model, extra_tokens=extra, extra=keys)


# HF names of the tower and projector -> the mmproj's, as the converter maps them
# (gguf-py's tensor_mapping for MODEL_ARCH.MMPROJ; checked against the converter's output
# for this model with 3 layers, which it needs to map the adapter's fc2), each layer's
# second LayerNorm as ln2, as clip.cpp reads it.
_GGUF_NAMES = {
    "vision_model.patch_embedding.linear.weight": "v.patch_embd.weight",
    "vision_model.class_embedding": "v.class_embd",
    "vision_model.positional_embedding_vlm": "v.position_embd.weight",
    "vision_model.layernorm_pre.weight": "v.pre_ln.weight",
    "vision_model.layernorm_pre.bias": "v.pre_ln.bias",
    "vision_model.layernorm_post.weight": "v.post_ln.weight",
    "vision_model.layernorm_post.bias": "v.post_ln.bias",
    "vision_model.vision_adapter.mlp.fc1.weight": "mm.model.mlp.1.weight",
    "vision_model.vision_adapter.mlp.fc2.weight": "mm.model.mlp.2.weight",
    "multi_modal_projector.linear_1.weight": "mm.model.fc.weight",
}
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_out",
    "input_layernorm": "ln1",
    "post_attention_layernorm": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The vision tower and projector under the mmproj's names."""
    out = {}
    layers = "vision_model.model.layers."
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name in _GGUF_NAMES:
            out[_GGUF_NAMES[name]] = data
        elif name.startswith(layers):
            index, rest = name[len(layers) :].split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            out[f"v.blk.{index}.{_GGUF_LAYER[module]}.{suffix}"] = data
    return out


def write_mmproj(model, path: Path, qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """The vision tower and projector as llama.cpp's converter writes an mmproj GGUF:
    clip.* metadata with projector type llama4, F32 tensors; with `qtype`, the encoder
    layers' matrices in that type."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.LLAMA4)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.Projector.SCALE_FACTOR, int(1 / vision.pixel_shuffle_ratio)),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, PROCESSOR["image_mean"])
    writer.add_array(key.IMAGE_STD, PROCESSOR["image_std"])
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.norm_eps)
    writer.add_bool(key.USE_GELU, True)
    for name, data in gguf_tensors(model).items():
        if qtype is not None and data.ndim == 2 and name.startswith("v.blk."):
            raw = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

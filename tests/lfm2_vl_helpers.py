"""A tiny random LFM2-VL (Lfm2VlForConditionalGeneration: SigLIP2 NaFlex tower,
pixel-unshuffle projector, LFM2 text with a convolution and an attention layer) for the
image tests: as a Hugging Face folder (stories260K's tokenizer plus LFM2-VL's image and
chat tokens, a chat template as LFM2-VL's, a preprocessor_config.json), its reference
inputs from transformers' Lfm2VlProcessor, and as llama.cpp's converter writes it, a text
GGUF plus an mmproj GGUF (conversion/lfm2.py; benchmarks/llama_cpp_lfm2_vl.py checks that
layout against the converter)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
LFM2_VL_TOKENS = (
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
    "<|im_start|>",
    "<|im_end|>",
    *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)),
)
IMAGE, IMAGE_START, IMAGE_END, THUMBNAIL, IM_START, IM_END = range(512, 518)
VOCAB = 512 + len(LFM2_VL_TOKENS)
# Patches of 16 pixels (the converter's), unshuffled by 2: frames are multiples of 32
# pixels a side, of 4 to 16 tokens; an image over 2 x 16 tokens' pixels is cut into 2 to
# 4 tiles of 64 pixels (4 tokens each) plus a thumbnail.
PATCH, FACTOR, TILE = 16, 2, 64
PROCESSOR = {
    "downsample_factor": FACTOR,
    "encoder_patch_size": PATCH,
    "tile_size": TILE,
    "min_image_tokens": 4,
    "max_image_tokens": 16,
    "min_tiles": 2,
    "max_tiles": 4,
    "max_pixels_tolerance": 2.0,
    "do_image_splitting": True,
    "use_thumbnail": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# LFM2-VL's chat template, without the tools and the system prompt it may add.
LFM2_VL_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{{- '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def tiny_lfm2_vl(seed: int = 0, vision_layers: int = 2, **overrides):
    """A random transformers Lfm2VlForConditionalGeneration: LFM2 text of hidden 64 (a
    convolution layer, an attention layer), a SigLIP2 tower of hidden 32 (`vision_layers`
    layers; llama.cpp's converter maps mm.2 only where there are 3 or more) with a 4 x 4
    grid of positions; `overrides`: fields of its config."""
    import transformers

    text = dict(
        model_type="lfm2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=2048,  # room for an image of 512-pixel tiles
        bos_token_id=1,
        eos_token_id=IM_END,
        pad_token_id=0,
    )
    vision = dict(
        model_type="siglip2_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        num_patches=16,
        patch_size=PATCH,
        vision_use_head=False,
    )
    config = transformers.Lfm2VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        projector_hidden_size=40,
        downsample_factor=FACTOR,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.Lfm2VlForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_lfm2_vl_dir(model, path: Path, **processor) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (PROCESSOR, updated by `processor`)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # no BOS: the template begins with <|im_start|>
    for i, content in enumerate(LFM2_VL_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": LFM2_VL_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    settings = {"image_processor_type": "Lfm2VlImageProcessor", **PROCESSOR, **processor}
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path


def processor(folder: Path, **settings):
    """transformers' Lfm2VlProcessor for the folder (its image processor needs
    torchvision)."""
    import transformers

    image_processor = transformers.Lfm2VlImageProcessor(**{**PROCESSOR, **settings})
    return transformers.Lfm2VlProcessor(
        image_processor=image_processor,
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=LFM2_VL_TEMPLATE,
    )


def reference_inputs(folder: Path, images: list, text: str, **settings) -> dict:
    """Lfm2VlProcessor's inputs for a rendered prompt `text` (its image places <image>)."""
    return dict(processor(folder, **settings)(text=text, images=images, return_tensors="pt"))


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of reference_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes an LFM2-VL's (arch lfm2, F32, the
    kernels squeezed, no lm_head: it is tied) with stories260K's vocabulary plus LFM2_VL_TOKENS
    as control tokens."""
    from llmrun.loading.gguf_io import read_gguf

    config = model.config.text_config
    writer = gguf.GGUFWriter(str(path), "lfm2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    # The width after LFM2's auto-adjustment, as the converter computes it.
    ffn = model.model.language_model.layers[0].feed_forward.w1.weight.shape[0]
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(
        [config.num_key_value_heads if k == "full_attention" else 0 for k in config.layer_types]
    )
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    tokens = LFM2_VL_TOKENS
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *tokens])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(tokens)])
    control = [gguf.TokenType.CONTROL] * len(tokens)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(IM_END)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(LFM2_VL_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, config.num_hidden_layers)
    prefix = "model.language_model."
    for name, tensor in model.state_dict().items():
        if not name.startswith(prefix):
            continue  # the vision parts, and the lm_head tied to the embedding
        name = "model." + name[len(prefix) :]
        if "conv.conv" in name:  # the converter squeezes the kernels to 2-D
            tensor = tensor.squeeze(1)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# HF names after model.vision_tower. -> the mmproj's (gguf-py's tensor_mapping).
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
_NAMES = {
    "vision_tower.embeddings.patch_embedding": "v.patch_embd",
    "vision_tower.embeddings.position_embedding": "v.position_embd",
    "vision_tower.post_layernorm": "v.post_ln",
    "multi_modal_projector.layer_norm": "mm.input_norm",
    "multi_modal_projector.linear_1": "mm.1",
    "multi_modal_projector.linear_2": "mm.2",
}


def write_mmproj(
    model, path: Path, qtype: gguf.GGMLQuantizationType | None = None, f16: bool = True
) -> Path:
    """The vision tower and projector as llama.cpp's converter writes an mmproj GGUF from
    the folder: clip.* metadata with projector type lfm2 (image_size 256 whatever the
    grid), the patch embedding as a convolution [hidden, 3, 16, 16] in F16, the position
    embedding in F32, the other 2-D matrices in F16 (all F32 without `f16`, the
    converter's --outtype f32); with `qtype`, the encoder layers' matrices in that type."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.LFM2)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, 256),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.Projector.SCALE_FACTOR, model.config.downsample_factor),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, PROCESSOR["image_mean"])
    writer.add_array(key.IMAGE_STD, PROCESSOR["image_std"])
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    writer.add_bool(key.USE_GELU, True)
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        data = tensor.detach().float()
        module, _, suffix = name[len("model.") :].rpartition(".")
        if module.startswith("vision_tower.encoder.layers."):
            layer, rest = module.split(".", 4)[3:]
            gguf_name = f"v.blk.{layer}.{_LAYER_NAMES[rest]}"
            if qtype is not None and data.ndim == 2:
                raw = gguf.quants.quantize(np.ascontiguousarray(data.numpy()), qtype)
                writer.add_tensor(
                    f"{gguf_name}.{suffix}", raw, raw_shape=raw.shape, raw_dtype=qtype
                )
                continue
        else:
            gguf_name = _NAMES[module]
        if module.endswith("patch_embedding") and suffix == "weight":
            data = data.view(data.shape[0], PATCH, PATCH, 3).permute(0, 3, 1, 2)
        array = np.ascontiguousarray(data.numpy())
        if f16 and array.ndim >= 2 and "position_embedding" not in name:
            array = array.astype(np.float16)
        writer.add_tensor(f"{gguf_name}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The processor's inputs for these images (height, width, picture seed) and settings
# (PROCESSOR's, updated; "defaults": Lfm2VlImageProcessor's own, as an mmproj takes
# them), stored in GOLDEN: transformers' Lfm2VlImageProcessor needs torchvision, which the
# suite goes without (test_the_stored_inputs_are_the_processors_own checks them where it
# is installed; processor_record rewrites them).
GOLDEN = Path(__file__).parent / "data" / "lfm2_vl_processor.json"
GOLDEN_TEXT = "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n"
GOLDEN_CASES = (
    ((40, 64, 1), {}),
    ((100, 17, 2), {}),
    ((30, 90, 3), {}),
    ((200, 300, 4), {}),  # 2 x 2 tiles and a thumbnail
    ((300, 120, 5), {}),  # 3 x 1 tiles
    ((500, 333, 6), {}),
    ((200, 300, 4), {"do_image_splitting": False}),
    ((200, 300, 4), {"use_thumbnail": False}),
    ((40, 64, 1), "defaults"),
    ((700, 1100, 7), "defaults"),  # tiles of 512
)


def case_settings(settings) -> dict:
    """The image processor fields of a GOLDEN_CASES entry."""
    if settings == "defaults":
        return {"downsample_factor": FACTOR, "encoder_patch_size": PATCH}
    return {**PROCESSOR, **settings}


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Two checksums of pixel values [patches, values]: their sum, and their sum weighted
    by position (which moves where values change places)."""
    flat = pixels.double().flatten()
    weights = (torch.arange(flat.numel(), dtype=torch.float64) % 251) + 1
    return [flat.sum().item(), (flat * weights).sum().item()]


def processor_record(folder: Path) -> list[dict]:
    """The processor's input ids, spatial shapes and pixel checksums for GOLDEN_CASES
    (json.dumps of it is GOLDEN)."""
    import transformers
    from vision_helpers import picture

    from llmrun.images import open_image

    records = []
    for (height, width, seed), settings in GOLDEN_CASES:
        fields = case_settings(settings)
        made = transformers.Lfm2VlProcessor(
            image_processor=transformers.Lfm2VlImageProcessor(**fields),
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        )
        image = open_image(picture(height, width, seed))
        out = made(text=GOLDEN_TEXT, images=[image], return_tensors="pt")
        lengths = out["pixel_attention_mask"].sum(1).tolist()
        pixels = torch.cat([out["pixel_values"][i, :n] for i, n in enumerate(lengths)])
        records.append(
            {
                "image": [height, width, seed],
                "settings": settings,
                "input_ids": out["input_ids"][0].tolist(),
                "spatial_shapes": out["spatial_shapes"].tolist(),
                "pixel_sums": pixel_sums(pixels),
            }
        )
    return records


def model_inputs(vision, ids: list[int], images: list) -> dict:
    """transformers' inputs for prompt ids and images prepared by llmrun
    (lfm2_vl_images.frames, whose equality with the processor's GOLDEN checks): each
    frame's patches padded to the longest, their mask and patch grids."""
    from llmrun import lfm2_vl_images

    frames = [f for image in images for f in lfm2_vl_images.frames(vision, image)[0]]
    patches = [lfm2_vl_images.patches(f, PATCH) for f in frames]
    longest = max(len(p) for p in patches)
    values = torch.zeros(len(patches), longest, patches[0].shape[1])
    mask = torch.zeros(len(patches), longest, dtype=torch.int32)
    for i, p in enumerate(patches):
        values[i, : len(p)] = p
        mask[i, : len(p)] = 1
    shapes = torch.tensor([[f.shape[1] // PATCH, f.shape[2] // PATCH] for f in frames])
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": values,
        "pixel_attention_mask": mask,
        "spatial_shapes": shapes,
    }

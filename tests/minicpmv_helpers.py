"""A tiny random MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration: SigLIP tower with its
window merger, the merger, Qwen3.5 text) or 4.7 (the same with canvas M-RoPE) for the
image tests: as a Hugging Face folder (stories260K's tokenizer plus MiniCPM-V's chat and
image tokens named as its tokenizer names them, a ChatML template that writes
<|image_pad|> for an image, a preprocessor_config.json), and its reference inputs from
transformers' MiniCPMV4_6Processor or MiniCPMV4_7Processor (the Pillow image processor)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
MINICPMV_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
)
IM_END, IMAGE_PAD, VIDEO_PAD = 513, 514, 515
# MiniCPMV4_7Config's marker ids: <image>, </image>, <slice>, </slice>, and stories260K's
# newline (<0x0A>).
MARKER_IDS = dict(
    image_start_id=516, image_end_id=517, slice_start_id=518, slice_end_id=519, newline_id=13
)
VOCAB = 512 + len(MINICPMV_TOKENS)
# The tokenizer's names of them (MiniCPMV4_6Processor reads its image tokens from them).
EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
MINICPMV_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image_pad|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Patches of 4 pixels, so a soft token is a square of 16; slices of about 32x32 pixels,
# so an image over 32x32 is sliced. The position table is the Hub model's 70x70.
PATCH, SCALE_RESOLUTION, POSITIONS_SIDE = 4, 32, 70
MEAN_STD = [0.5, 0.5, 0.5]
TEXT = dict(
    model_type="qwen3_5_text",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # Qwen3.5's interleaved M-RoPE sections, which MiniCPM-V's text turns as plain RoPE.
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)


# transformers' class names of each version ("ocr": MiniCPM-OCR, 4.6's model) and model_type.
CLASS_PREFIXES = {"4.6": "MiniCPMV4_6", "4.7": "MiniCPMV4_7", "ocr": "MiniCPMOcr"}
MODEL_TYPES = {"minicpmv4_6": "4.6", "minicpmv4_7": "4.7", "minicpm_ocr": "ocr"}


def tiny_minicpmv(seed: int = 0, downsample_mode: str = "16x", version: str = "4.6"):
    """A random transformers MiniCPMV4_6ForConditionalGeneration (`version` 4.7:
    MiniCPMV4_7ForConditionalGeneration, with MARKER_IDS; "ocr":
    MiniCPMOcrForConditionalGeneration): TEXT (a Gated DeltaNet layer,
    then a full-attention one), a tower of hidden 32 in two layers, the window merger after
    the first; slow decays and an output matrix scaled down (logits within about ±6)."""
    import transformers

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=POSITIONS_SIDE * PATCH,
        patch_size=PATCH,
    )
    name = CLASS_PREFIXES[version]
    config = getattr(transformers, f"{name}Config")(
        text_config=TEXT,
        vision_config=vision,
        insert_layer_id=0,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        downsample_mode=downsample_mode,
        **(MARKER_IDS if version == "4.7" else {}),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    randomize(model, {"lm_head.weight": 0.4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.0)
    return model


def processor_settings(downsample_mode: str = "16x", image_ids: bool = True) -> dict:
    return {
        "image_processor_type": "MiniCPMV4_6ImageProcessorPil",
        "scale_resolution": SCALE_RESOLUTION,
        "patch_size": PATCH,
        "max_slice_nums": 9,
        "slice_mode": True,
        "use_image_id": image_ids,
        "downsample_mode": downsample_mode,
        "image_mean": MEAN_STD,
        "image_std": MEAN_STD,
    }


def save_minicpmv_dir(model, path: Path, image_ids: bool = True) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (`image_ids`: its use_image_id)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # no BOS: the template begins with <|im_start|>
    for i, content in enumerate(MINICPMV_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "chat_template": MINICPMV_TEMPLATE,
        "extra_special_tokens": EXTRA_SPECIAL_TOKENS,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    settings = processor_settings(model.config.downsample_mode, image_ids)
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path


def processor(folder: Path):
    """transformers' MiniCPMV4_6Processor (or MiniCPMV4_7Processor, MiniCPMOcrProcessor, by
    the folder's model_type) for the folder (MiniCPMV4_6ImageProcessorPil: MiniCPM-OCR's
    own image processor needs torchvision)."""
    import transformers
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessorPil,
    )
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (
        MiniCPMV4_6VideoProcessor,
    )

    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    base = getattr(transformers, f"{CLASS_PREFIXES[MODEL_TYPES[model_type]]}Processor")

    class Processor(base):
        # Its check of the video processor's class needs torchvision; images never use it.
        # (MiniCPM-OCR's expects its own image processor class: 4.6's with its settings.)
        def check_argument_for_proper_class(self, name, argument):
            if name not in ("video_processor", "image_processor"):
                return super().check_argument_for_proper_class(name, argument)

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    del settings["image_processor_type"]
    return Processor(
        image_processor=MiniCPMV4_6ImageProcessorPil(**settings),
        video_processor=MiniCPMV4_6VideoProcessor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=MINICPMV_TEMPLATE,
    )


def reference_inputs(folder: Path, images: list, text: str) -> dict:
    """The processor's inputs for a rendered prompt `text` (its image places
    <|image_pad|>)."""
    return dict(processor(folder)(text=text, images=images, return_tensors="pt"))


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of reference_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/minicpm.py
    MiniCPMV4_6TextModel: Qwen3.5's arch qwen35, as tests/models/test_qwen3_5.py's
    write_qwen35_gguf writes it), F32, with stories260K's vocabulary plus MINICPMV_TOKENS
    as control tokens and the chat template."""
    from types import SimpleNamespace

    import gguf
    from test_qwen3_5 import write_qwen35_gguf  # tests/models, where the GGUF tests are

    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith(prefix) or k == "lm_head.weight"
    }
    text = SimpleNamespace(config=model.config.text_config)
    stories = write_qwen35_gguf(path.with_name(f"{path.stem}-stories.gguf"), text, state=state)
    reader = gguf.GGUFReader(stories)
    writer = gguf.GGUFWriter(str(path), "qwen35")
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = [*value, *MINICPMV_TOKENS]
        elif key == "tokenizer.ggml.scores":
            value = [*value, *[0.0] * len(MINICPMV_TOKENS)]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *[gguf.TokenType.CONTROL] * len(MINICPMV_TOKENS)]
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(MINICPMV_TEMPLATE)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# HF names after "model." -> the mmproj's (as the converter names them: clip-impl.h).
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
    "vision_tower.vit_merger.layer_norm1": "v.vit_merger.ln1",
    "vision_tower.vit_merger.self_attn.q_proj": "v.vit_merger.attn_q",
    "vision_tower.vit_merger.self_attn.k_proj": "v.vit_merger.attn_k",
    "vision_tower.vit_merger.self_attn.v_proj": "v.vit_merger.attn_v",
    "vision_tower.vit_merger.self_attn.out_proj": "v.vit_merger.attn_out",
    "vision_tower.vit_merger.pre_norm": "v.vit_merger.ds_ln",
    "vision_tower.vit_merger.linear_1": "v.vit_merger.ds_ffn_up",
    "vision_tower.vit_merger.linear_2": "v.vit_merger.ds_ffn_down",
    "merger.mlp.0.pre_norm": "mm.input_norm",
    "merger.mlp.0.linear_1": "mm.up",
    "merger.mlp.0.linear_2": "mm.down",
}


def write_mmproj(model, path: Path) -> Path:
    """The vision tower and merger as llama.cpp's converter writes an mmproj GGUF from the
    folder with --outtype f32 (conversion/minicpm.py MiniCPMV4_6VisionModel: projector
    type minicpmv4_6, scale_resolution as the image size, the window merger's layer as
    wa_layer_indexes; benchmarks/llama_cpp_minicpmv.py checks it against the converter)."""
    import gguf
    import numpy as np

    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, "minicpmv4_6")
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, SCALE_RESOLUTION),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.Projector.SCALE_FACTOR, 4 if model.config.downsample_mode == "16x" else 2),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, MEAN_STD)
    writer.add_array(key.IMAGE_STD, MEAN_STD)
    writer.add_array(key.WA_LAYER_INDEXES, [model.config.insert_layer_id])
    writer.add_bool(gguf.Keys.ClipVision.USE_GELU, True)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.merger.")):
            continue
        if ".vit_merger." in name and model.config.downsample_mode == "4x":
            continue  # the converter leaves out the window merger that 4x skips
        module, _, suffix = name[len("model.") :].rpartition(".")
        if module.startswith("vision_tower.encoder.layers."):
            layer, rest = module.split(".", 4)[3:]
            gguf_name = f"v.blk.{layer}.{_LAYER_NAMES[rest]}"
        else:
            gguf_name = _NAMES[module]
        data = np.ascontiguousarray(tensor.detach().float().numpy())
        writer.add_tensor(f"{gguf_name}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

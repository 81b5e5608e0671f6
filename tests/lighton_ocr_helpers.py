"""A tiny random LightOnOCR (Pixtral tower, patch-merger projector, Qwen3 text) for the
image tests: a Hugging Face folder as save_pretrained writes it (stories260K's tokenizer
plus the ChatML and image tokens, LightOnOCR-1B-1025's chat template and image processor
settings, whose patch_size 14 is half a merged token's side), transformers'
LightOnOcrProcessor inputs for it, and its files as llama.cpp's converter writes them (a
qwen3 text GGUF, an mmproj GGUF of projector type lightonocr)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf
from pixtral_helpers import CLIP_MEAN, CLIP_STD, permute_heads

# Ids 512 on, after stories260K's 512 tokens.
LIGHTON_TOKENS = ("<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_pad|>", "<|vision_end|>")
IM_END, IMAGE, IMAGE_BREAK, IMAGE_END = 513, 514, 515, 516
VOCAB = 520
PATCH, MERGE, LONGEST_EDGE = 14, 2, 84
# lightonai/LightOnOCR-1B-1025's chat_template.jinja.
LIGHTON_TEMPLATE = """{% set image_count = namespace(value=0) %}
{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}
{{ message['content'] }}<|im_end|>
{% else %}
{% for content in message['content'] %}
{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}
{% set image_count.value = image_count.value + 1 %}
{% if add_vision_id %}
Picture {{ image_count.value }}:
{% endif -%}
<|image_pad|>
{%- elif 'text' in content %}
{{ content['text'] }}
{% endif %}
{% endfor %}
<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
# LightOnOCR-1B-1025's preprocessor_config.json, its longest edge 84 (the Hub's is 1540).
PROCESSOR = {
    "image_processor_type": "PixtralImageProcessor",
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "patch_size": PATCH,
    "size": {"longest_edge": LONGEST_EDGE},
    "resample": 3,
    "rescale_factor": 1 / 255,
}


def tiny_lighton_ocr(seed: int = 0, vision_layers: int = 2):
    """A random transformers LightOnOcrForConditionalGeneration: a Qwen3 of hidden 64 in
    two layers (its head tied, LightOnOcrConfig's default), Pixtral of hidden 32 in
    `vision_layers` layers (heads of 16, SiLU) on patches of 14, merged 2x2. (llama.cpp's
    converter maps mm.2 only where the tower has 3 layers or more.)"""
    import transformers

    text = dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
    )
    vision = dict(
        model_type="pixtral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        head_dim=16,
        image_size=LONGEST_EDGE,
        patch_size=PATCH,
        hidden_act="silu",
    )
    config = transformers.LightOnOcrConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, spatial_merge_size=MERGE
    )
    torch.manual_seed(seed)
    model = transformers.LightOnOcrForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_lighton_ocr_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files (the
    image tokens named as LightOnOCR's tokenizer_config.json names them) and the image
    processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(LIGHTON_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": LIGHTON_TEMPLATE,
        "extra_special_tokens": {
            "image_token": "<|image_pad|>",
            "image_break_token": "<|vision_pad|>",
            "image_end_token": "<|vision_end|>",
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' LightOnOcrProcessor for the folder, with PixtralImageProcessor's
    Pillow backend (its default one needs torchvision)."""
    import transformers
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.LightOnOcrProcessor(
        image_processor=PixtralImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        chat_template=LIGHTON_TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str):
    """The processor's inputs (input_ids, pixel_values, image_sizes) for one user message
    of `images` then `question`, with the generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    messages = [{"role": "user", "content": content}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {k: inputs[k] for k in ("input_ids", "pixel_values", "image_sizes")}


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (text_config's
    Qwen3ForCausalLM: arch qwen3), F32, its head tied (no output.weight), with
    stories260K's vocabulary plus LIGHTON_TOKENS as control tokens and the chat template."""
    config = {**model.config.text_config.to_dict(), "tie_word_embeddings": True}
    prefix = "model.language_model."
    state = {
        "model." + k[len(prefix) :]: v
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    padding = VOCAB - 512 - len(LIGHTON_TOKENS)

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        tokens = [*LIGHTON_TOKENS, *(f"<pad{i}>" for i in range(padding))]
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *tokens])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(tokens)])
        control = [gguf.TokenType.CONTROL] * len(tokens)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(LIGHTON_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


# HF names after model.vision_encoder. / model.vision_projection. -> the mmproj's
# (gguf-py's tensor_mapping for MODEL_ARCH.MMPROJ, after conversion/lighton_ocr.py's
# renaming to vision_tower. / multi_modal_projector.).
_LAYER_NAMES = {
    "attention_norm": "ln1",
    "attention.q_proj": "attn_q",
    "attention.k_proj": "attn_k",
    "attention.v_proj": "attn_v",
    "attention.o_proj": "attn_out",
    "ffn_norm": "ln2",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
}
_NAMES = {
    "vision_encoder.patch_conv": "v.patch_embd",
    "vision_encoder.ln_pre": "v.pre_ln",
    "vision_projection.norm": "mm.input_norm",
    "vision_projection.patch_merger.merging_layer": "mm.patch_merger",
    "vision_projection.linear_1": "mm.1",
    "vision_projection.linear_2": "mm.2",
}


def write_mmproj(model, path: Path, f16: bool = True) -> Path:
    """The vision tower and projector as llama.cpp's converter writes an mmproj GGUF from
    the folder (conversion/lighton_ocr.py on LlavaVisionModel): clip.* metadata with
    projector type lightonocr, q/k rows permuted per head, no [IMG_BREAK] row, F32
    tensors but the 2-D matrices' F16 (without `f16`, all F32: --outtype f32)."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.LIGHTONOCR)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.SPATIAL_MERGE_SIZE, model.config.spatial_merge_size),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, CLIP_MEAN)
    writer.add_array(key.IMAGE_STD, CLIP_STD)
    # LlavaVisionModel's layer_norm_eps for a pixtral tower, which clip.cpp's projector
    # RMSNorm takes too (transformers' takes the text's 1e-6).
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-5)
    writer.add_bool(key.USE_SILU, True)
    heads = vision.num_attention_heads
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_encoder.", "model.vision_projection.")):
            continue
        data = tensor.detach().float().numpy()
        module, _, suffix = name[len("model.") :].rpartition(".")
        if module.startswith("vision_encoder.transformer.layers."):
            layer, rest = module.split(".", 4)[3:]
            gguf_name = f"v.blk.{layer}.{_LAYER_NAMES[rest]}"
            if rest in ("attention.q_proj", "attention.k_proj"):
                data = permute_heads(data, heads)
        else:
            gguf_name = _NAMES[module]
        if f16 and data.ndim >= 2:
            data = data.astype(np.float16)
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

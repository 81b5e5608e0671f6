"""A tiny random PaddleOCR-VL (PaddleOCRVLForConditionalGeneration) for the image tests: a
Hugging Face folder as save_pretrained writes it (stories260K's tokenizer plus
PaddleOCR-VL's image and sentence tokens, its chat template, a preprocessor_config.json
with the Hub's settings), transformers' PaddleOCRVLProcessor inputs for it, and the model
as llama.cpp's converter writes it: a paddleocr text GGUF and an mmproj GGUF
(conversion/ernie.py PaddleOCRModel and PaddleOCRVisionModel)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens.
PADDLE_TOKENS = (
    "<|IMAGE_START|>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|IMAGE_END|>",
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    "<|video_pad|>",
)
IMAGE_START, IMAGE, IMAGE_END, VIDEO = 512, 513, 514, 517
VOCAB = 520
# PaddlePaddle/PaddleOCR-VL's chat_template.jinja, which takes a message's content as a
# string too (the tests' replies).
PADDLE_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}"
    "{%- endif -%}{{- '<|begin_of_sentence|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}{%- set parts = message['content'] -%}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{- 'User: ' -}}"
    "{%- for content in parts -%}{%- if content['type'] == 'image' -%}"
    "{{ '<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>' }}{%- endif -%}{%- endfor -%}"
    "{%- for content in parts -%}{%- if content['type'] == 'text' -%}"
    "{{ content['text'] }}{%- endif -%}{%- endfor -%}{{ '\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' -}}"
    "{%- for content in parts -%}{%- if content['type'] == 'text' -%}"
    "{{ content['text'] }}{%- endif -%}{%- endfor -%}{{ '<|end_of_sentence|>' -}}"
    "{%- elif message['role'] == 'system' -%}"
    "{%- for content in parts -%}{%- if content['type'] == 'text' -%}"
    "{{ content['text'] + '\n' }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # 8 pairs a head in uneven sections, so that each of time, height and width matters.
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>
)
# A learned position table of 4x4 patches, resized to every image's grid.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,  # llama.cpp's converter maps mlp_AR.linear_2 only where there are 3
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
)
# The Hub's preprocessor_config.json, its pixel limits lowered for tiny images.
PROCESSOR = {
    "image_processor_type": "PaddleOCRVLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 28 * 28 * 4,
    "max_pixels": 28 * 28 * 60,
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
}


def tiny_paddleocr_vl(seed: int = 1):
    """A random transformers PaddleOCRVLForConditionalGeneration: text hidden 64 in 2
    layers (tied head, as PaddleOCRVLConfig always has it), a vision tower of hidden 32 in
    3 layers."""
    import transformers

    config = transformers.PaddleOCRVLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
    )
    torch.manual_seed(seed)
    model = transformers.PaddleOCRVLForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "pre_norm.weight")):
                p.normal_(1.0, 0.1)
            if name.endswith("post_layernorm.weight"):
                p.normal_(1.0, 0.1)
    return model


def save_paddleocr_vl_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    # Every id of the model's vocabulary a token, as its random head may choose any.
    for i, content in enumerate((*PADDLE_TOKENS, "<pad0>", "<pad1>"), start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": PADDLE_TEMPLATE,
        "extra_special_tokens": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' PaddleOCRVLProcessor for the folder (PaddleOCRVLImageProcessorPil with
    the folder's settings)."""
    import transformers
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
        PaddleOCRVLImageProcessorPil,
    )

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.PaddleOCRVLProcessor(
        image_processor=PaddleOCRVLImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=PADDLE_TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str | list[dict]):
    """The processor's inputs (input_ids, pixel_values, image_grid_thw, mm_token_type_ids)
    for one user message of `images` then `question`, or for a conversation, with the
    generation prompt."""
    if isinstance(question, str):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
    else:
        messages = question
    made = processor(folder)
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return made(text=text, images=images, return_tensors="pt", add_special_tokens=False)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (arch paddleocr: ERNIE 4.5's
    tensors, rope.dimension_sections), F32, with stories260K's vocabulary plus
    PADDLE_TOKENS as control tokens and the chat template."""
    from llmrun.loading.gguf_io import read_gguf

    config = {**model.config.text_config.to_dict(), "model_type": "ernie4_5"}
    prefix = "model.language_model."
    state = {
        "model." + k[len(prefix) :]: v
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    sections = list(config["rope_parameters"]["mrope_section"])

    def extra(writer) -> None:
        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_rope_dimension_sections([*sections, 0])
        writer.add_tokenizer_model("llama")
        pads = ["<pad0>", "<pad1>"]
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *PADDLE_TOKENS, *pads])
        scores = [*meta["tokenizer.ggml.scores"], *[0.0] * (len(PADDLE_TOKENS) + 2)]
        writer.add_token_scores(scores)
        control = [gguf.TokenType.CONTROL] * (len(PADDLE_TOKENS) + 2)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(PADDLE_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, arch="paddleocr", extra=extra)


def write_mmproj(model, path: Path, qtype=None) -> Path:
    """The vision tower and projector as llama.cpp's converter writes its mmproj
    (conversion/ernie.py PaddleOCRVisionModel, gguf's tensor map): clip.* metadata (image
    size sqrt(max_pixels), GELU, the pixel limits), SigLIP's tensor names, mlp_AR as
    mm.input_norm, mm.1 and mm.2; F32, or with `qtype` the blocks' matrices whose rows are
    whole blocks of it in that type."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.PADDLEOCR)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, int(PROCESSOR["max_pixels"] ** 0.5)),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.IMAGE_MIN_PIXELS, PROCESSOR["min_pixels"]),
        (key.IMAGE_MAX_PIXELS, PROCESSOR["max_pixels"]),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, PROCESSOR["image_mean"])
    writer.add_array(key.IMAGE_STD, PROCESSOR["image_std"])
    writer.add_bool(key.USE_GELU, True)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
    names = {
        "embeddings.patch_embedding": "v.patch_embd",
        "embeddings.position_embedding": "v.position_embd",
        "post_layernorm": "v.post_ln",
    }
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out",
        "layer_norm1": "ln1",
        "layer_norm2": "ln2",
        "mlp.fc1": "ffn_up",
        "mlp.fc2": "ffn_down",
    }
    projector = {"pre_norm": "mm.input_norm", "linear_1": "mm.1", "linear_2": "mm.2"}

    def add(name: str, data) -> None:
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
        if block and data.ndim == 2 and name.startswith("v.blk.") and data.shape[1] % block == 0:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    tower, mlp = "model.visual.vision_model.", "model.projector."
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name.startswith(mlp):
            module, _, suffix = name[len(mlp) :].rpartition(".")
            add(f"{projector[module]}.{suffix}", data)
            continue
        if not name.startswith(tower):
            continue
        module, _, suffix = name[len(tower) :].rpartition(".")
        if module in names:
            add(f"{names[module]}.{suffix}", data)
        else:
            _, _, block, rest = module.split(".", 3)  # encoder.layers.N.<rest>
            add(f"v.blk.{block}.{layer[rest]}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""A tiny random Qwen2.5-VL (and Qwen2-VL) with its vision tower for the image tests: a
Hugging Face folder as save_pretrained writes it (stories260K's tokenizer plus Qwen's chat
and vision tokens, Qwen2.5-VL's chat template, a preprocessor_config.json), and
transformers' Qwen2_5_VLProcessor inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
QWEN_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IM_END, VISION_START, VISION_END, IMAGE, VIDEO = 513, 514, 515, 516, 517
VOCAB = 520
# Qwen/Qwen2.5-VL-3B-Instruct's chat template (chat_template.json).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # 8 pairs a head in uneven sections, so that each of time, height and width matters.
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens, not an early <|im_end|>
)
VISION = {
    "qwen2_5_vl": dict(
        depth=3,  # llama.cpp's converter maps merger.mlp.2 only where there are 3 blocks
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        fullatt_block_indexes=[1],
    ),
    "qwen2_vl": dict(depth=3, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
}
CLASSES = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
}


def tiny_qwen_vl(family: str = "qwen2_5_vl", seed: int = 1):
    """A random transformers Qwen2_5_VLForConditionalGeneration (or Qwen2-VL's): text
    hidden 64 in 2 layers, a vision tower of hidden 32 in 3 blocks (Qwen2.5-VL's second
    full, the others windowed)."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    config = config_class(
        text_config=TEXT,
        vision_config=VISION[family],
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm1", "norm2", "ln_q"):
                p.normal_(1.0, 0.1)
    return model


def save_qwen_vl_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (Qwen2VLImageProcessor's defaults)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(QWEN_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        # stories260K's tokenizer.json as it is (Qwen2Tokenizer would read it otherwise).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": QWEN2_VL_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def processor(folder: Path, **image_kwargs):
    """transformers' Qwen2_5_VLProcessor for the folder (Qwen2VLImageProcessorPil)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(transformers.Qwen2_5_VLProcessor):
        # Images only: its video processor needs torchvision, which the tests go without.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    return Processor(
        image_processor=Qwen2VLImageProcessorPil(**image_kwargs),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=QWEN2_VL_TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str | list[dict]):
    """The processor's inputs (input_ids, pixel_values, image_grid_thw, mm_token_type_ids)
    for one user message of `images` then `question`, or for a conversation (`question` a
    list of messages, whose image parts take `images` in order), with the generation
    prompt."""
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


def write_text_gguf(
    model, path: Path, arch: str = "qwen2vl", model_type: str = "qwen2", keys=None
) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/qwenvl.py
    Qwen2VLModel: arch qwen2vl, Qwen2's tensors, rope.dimension_sections), F32, with
    stories260K's vocabulary plus QWEN_TOKENS as control tokens and the chat template.
    `arch` and `model_type`: another family's (Qwen3-VL's qwen3vl, qwen3), `keys(writer)`
    adding its own metadata."""
    import gguf
    from helpers import STORIES_GGUF, write_gguf

    config = {**model.config.text_config.to_dict(), "model_type": model_type}
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith(prefix) or k == "lm_head.weight"
    }
    sections = list(config["rope_parameters"]["mrope_section"])

    def extra(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_rope_dimension_sections([*sections, 0])
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *QWEN_TOKENS, "<pad0>", "<pad1>"])
        scores = [*meta["tokenizer.ggml.scores"], *[0.0] * (len(QWEN_TOKENS) + 2)]
        writer.add_token_scores(scores)
        control = [gguf.TokenType.CONTROL] * (len(QWEN_TOKENS) + 2)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)  # as the text of the Hub's tokenizer.json
        writer.add_chat_template(QWEN2_VL_TEMPLATE)
        if keys is not None:
            keys(writer)

    return write_gguf(path, config, state, tokenizer=False, arch=arch, extra=extra)


def write_mmproj(model, path: Path, qtype=None, legacy: bool = False) -> Path:
    """The vision tower as llama.cpp's converter writes its mmproj (conversion/qwenvl.py
    Qwen2VLVisionModel): clip.* metadata, each qkv split into attn_q/k/v, the Conv3d patch
    weight split into its two frames, the merger as v.post_ln, mm.0 and mm.2; F32, or
    with `qtype` the blocks' matrices whose rows are whole blocks of it in that type.
    `legacy`: as the older conversion script wrote it, each MLP's input matrix named
    ffn_down and its output ffn_up, feed_forward_length 0 (clip.cpp swaps them back)."""
    import gguf
    import numpy as np

    family = model.config.model_type
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    key = gguf.Keys.ClipVision
    if family == "qwen2_5_vl":
        writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN25VL)
        writer.add_bool(key.USE_SILU, True)
        writer.add_uint32(key.N_WA_PATTERN, vision.fullatt_block_indexes[0] + 1)
        width, inner = vision.hidden_size, vision.intermediate_size
    else:
        writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN2VL)
        width, inner = vision.embed_dim, vision.embed_dim * vision.mlp_ratio
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, 560),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, width),
        (key.FEED_FORWARD_LENGTH, 0 if legacy else inner),
        (key.BLOCK_COUNT, vision.depth),
        (key.Attention.HEAD_COUNT, vision.num_heads),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, [0.48145466, 0.4578275, 0.40821073])
    writer.add_array(key.IMAGE_STD, [0.26862954, 0.26130258, 0.27577711])
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
    layer = {
        "attn.proj": "attn_out",
        "norm1": "ln1",
        "norm2": "ln2",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.fc1": "ffn_up",
        "mlp.fc2": "ffn_down",
    }
    if legacy:
        for module in ("mlp.up_proj", "mlp.fc1"):
            layer[module] = "ffn_down"
        for module in ("mlp.down_proj", "mlp.fc2"):
            layer[module] = "ffn_up"
    merger = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2"}

    def add(name: str, data) -> None:
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
        if block and data.ndim == 2 and name.startswith("v.blk.") and data.shape[1] % block == 0:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    for name, tensor in model.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        data = tensor.detach().float().numpy()
        module, _, suffix = name[len("model.visual.") :].rpartition(".")
        if module == "patch_embed.proj":
            add("v.patch_embd.weight", data[:, :, 0])
            add("v.patch_embd.weight.1", data[:, :, 1])
        elif module in merger:
            add(f"{merger[module]}.{suffix}", data)
        else:
            _, block, rest = module.split(".", 2)
            if rest == "attn.qkv":
                for part, piece in zip("qkv", np.split(data, 3), strict=True):
                    add(f"v.blk.{block}.attn_{part}.{suffix}", piece)
            else:
                add(f"v.blk.{block}.{layer[rest]}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

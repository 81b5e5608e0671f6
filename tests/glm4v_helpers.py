"""A tiny random GLM-4.1V with its vision tower for the image tests: a Hugging Face folder
as save_pretrained writes it (stories260K's tokenizer plus GLM's chat and vision tokens,
a chat template after GLM-4.1V-9B-Thinking's, a preprocessor_config.json), transformers'
Glm4vProcessor inputs for it, and its files as llama.cpp's converter writes them (a glm4
text GGUF, an mmproj GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
GLM_TOKENS = (
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END, IMAGE, VIDEO = range(517, 523)
VOCAB = 528
# GLM-4.1V-9B-Thinking's chat template, its images and text (no tools, no thinking).
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{% for msg in messages %}{% if msg.role == 'system' %}<|system|>\n"
    "{{ msg.content }}{% elif msg.role == 'user' %}<|user|>{{ '\\n' }}"
    "{% if msg.content is string %}{{ msg.content }}{% else %}{% for item in msg.content %}"
    "{% if item.type == 'video' or 'video' in item %}<|begin_of_video|><|video|>"
    "<|end_of_video|>{% elif item.type == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% elif item.type == 'text' %}{{ item.text }}"
    "{% endif %}{% endfor %}{% endif %}{% elif msg.role == 'assistant' %}<|assistant|>\n"
    "{{ msg.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% endif %}"
)
# 2 heads of 32 features, half of each turned (as the released models): 8 pairs in
# uneven sections, so that each of time, height and width matters.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "partial_rotary_factor": 0.5,
    },
)
# GLM-4.5V's text: GLM-4.5's experts, the first layer dense.
MOE = dict(
    head_dim=32,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
)
# 2 blocks; an 8x8 grid of learned positions (image_size 112 of 14-pixel patches) that
# every image resamples.
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    image_size=112,
    patch_size=14,
)
# Glm4vImageProcessor's settings (its defaults' mean, std and pixel limits).
PROCESSOR = {
    "image_processor_type": "Glm4vImageProcessor",
    "processor_class": "Glm4vProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "size": {"shortest_edge": 12544, "longest_edge": 11760000},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


# The tower's norms, randomized about 1 (GLM-OCR's q/k norms among them).
NORMS = ("norm1", "norm2", "post_projection_norm", "q_norm", "k_norm")


def tiny_glm4v(seed: int = 0, moe: bool = False, kind: str = "Glm4v"):
    """A random transformers Glm4vForConditionalGeneration (with `moe`, GLM-4.5V's
    Glm4vMoeForConditionalGeneration; with kind "GlmOcr", GLM-OCR's
    GlmOcrForConditionalGeneration; with kind "Glm46V", GLM-4.6V's
    Glm46VForConditionalGeneration, its text GLM-4.5V's with `moe`): text hidden 64 in 2
    layers, a vision tower of hidden 32 in 2 blocks."""
    import transformers

    text = {**TEXT, **MOE} if moe else TEXT
    if kind == "Glm46V" and moe:  # Glm46VConfig builds the text model its text_config names
        text = {**text, "model_type": "glm4v_moe_text"}
    elif moe:
        kind = "Glm4vMoe"
    config = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        image_start_token_id=IMAGE_START,
        image_end_token_id=IMAGE_END,
        video_start_token_id=VIDEO_START,
        video_end_token_id=VIDEO_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in NORMS:
                p.normal_(1.0, 0.1)
    return model


def save_glm4v_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(GLM_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": GLM4V_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path, kind: str = "Glm4v"):
    """transformers' Glm4vProcessor for the folder (Glm4vImageProcessorPil); with kind
    "Glm46V", Glm46VProcessor and Glm46VImageProcessorPil (subclasses that differ in
    videos alone)."""
    import transformers

    class Processor(getattr(transformers, f"{kind}Processor")):
        # Images only: its video processor needs torchvision, which the tests go without.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    settings = {k: PROCESSOR[k] for k in ("image_mean", "image_std", "size", "patch_size")}
    return Processor(
        image_processor=getattr(transformers, f"{kind}ImageProcessorPil")(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=GLM4V_TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str | list[dict], kind: str = "Glm4v"):
    """The processor's inputs (input_ids, pixel_values, image_grid_thw, mm_token_type_ids)
    for one user message of `images` then `question`, or for a conversation (`question` a
    list of messages, whose image parts take `images` in order), with the generation
    prompt; `kind` as processor's."""
    if isinstance(question, str):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
    else:
        messages = question
    made = processor(folder, kind)
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return made(text=text, images=images, return_tensors="pt", add_special_tokens=False)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()


def write_text_gguf(model, path: Path, mtp: bool = False) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/glm.py Glm4Model:
    arch glm4, the rotated q/k rows reordered into halves, the rotated width and the rope
    sections; test_vl_text.write_glm4v_gguf's), F32, with stories260K's vocabulary plus
    GLM_TOKENS as control tokens and the chat template; with `mtp`, a NextN/MTP layer
    after the last (GLM-OCR's, as conversion/glm.py GlmOCRModel keeps it)."""
    import gguf
    import numpy as np
    from helpers import STORIES_GGUF
    from test_glm4_moe import with_mtp_layer
    from test_vl_text import GLM4_NAMES, TextModel, gguf_tensors, normal_to_neox, text_keys

    from llmrun.loading.gguf_io import read_gguf

    text = TextModel(model)
    c = text.config
    head_dim = c.hidden_size // c.num_attention_heads
    rotated = int(head_dim * c.rope_parameters["partial_rotary_factor"])
    tensors = gguf_tensors(text.weights, GLM4_NAMES)
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for name, data in tensors.items():
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind in heads:
            tensors[name] = normal_to_neox(data, heads[kind], head_dim, rotated)
    keys = text_keys(c, head_dim, rotated)
    if mtp:
        tensors = with_mtp_layer(tensors, c.num_hidden_layers)
        keys[gguf.Keys.LLM.BLOCK_COUNT] += 1
        keys[gguf.Keys.LLM.NEXTN_PREDICT_LAYERS] = 1
    writer = gguf.GGUFWriter(str(path), "glm4")
    for key, value in keys.items():
        name = key.format(arch="glm4")
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    extra = VOCAB - 512  # GLM_TOKENS, then padding to the vocabulary
    pads = [f"<pad{i}>" for i in range(extra - len(GLM_TOKENS))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *GLM_TOKENS, *pads])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * extra])
    control = [gguf.TokenType.CONTROL] * extra
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)  # as the text of the Hub's tokenizer.json
    writer.add_chat_template(GLM4V_TEMPLATE)
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# HF module (under model.visual.) -> the converter's tensor name.
MMPROJ_NAMES = {
    "patch_embed.proj": "v.patch_embd",
    "post_conv_layernorm": "v.norm_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
    "downsample": "mm.patch_merger",
    "merger.proj": "mm.model.fc",
    "merger.post_projection_norm": "mm.post_norm",
    "merger.gate_proj": "mm.gate",
    "merger.up_proj": "mm.up",
    "merger.down_proj": "mm.down",
}
MMPROJ_LAYER = {
    "attn.qkv": "attn_qkv",
    "attn.proj": "attn_out",
    "attn.q_norm": "attn_q_norm",  # GLM-OCR's
    "attn.k_norm": "attn_k_norm",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_mmproj(model, path: Path, qtype=None) -> Path:
    """The vision tower as llama.cpp's converter writes its mmproj (conversion/qwen3vl.py
    Glm4VVisionModel, as `convert_hf_to_gguf.py --mmproj` wrote it for this model):
    clip.* metadata, the Conv3d patch weight split into its two frames, the rest under
    clip.cpp's names; F32, or with `qtype` the blocks' matrices whose rows are whole
    blocks of it in that type."""
    import gguf
    import numpy as np

    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.depth),
        (key.Attention.HEAD_COUNT, vision.num_heads),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, PROCESSOR["image_mean"])
    writer.add_array(key.IMAGE_STD, PROCESSOR["image_std"])
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.GLM4V)
    writer.add_bool(key.USE_SILU, True)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.rms_norm_eps)

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
        if module == "patch_embed.proj" and suffix == "weight":
            add("v.patch_embd.weight", data[:, :, 0])
            add("v.patch_embd.weight.1", data[:, :, 1])
        elif module in MMPROJ_NAMES:
            add(f"{MMPROJ_NAMES[module]}.{suffix}", data)
        else:
            _, block, rest = module.split(".", 2)
            add(f"v.blk.{block}.{MMPROJ_LAYER[rest]}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""A tiny random Gemma 3 with its vision tower (Gemma3ForConditionalGeneration) for the
image tests: as a Hugging Face folder (stories260K's tokenizer plus Gemma's turn and
image tokens, Gemma 3's chat template, a preprocessor_config.json), and as llama.cpp's
converter writes it, a text GGUF plus an mmproj GGUF (conversion/gemma.py
Gemma3VisionModel, clip-impl.h's names)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens.
GEMMA3_TOKENS = (
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
BOI, EOI, IMAGE = 514, 515, 516
VOCAB = 517
IMAGE_SIZE, TOKENS_PER_IMAGE = 64, 4  # 4x4 patches of 16 pooled 2x2
# google/gemma-3-4b-it's chat template (chat_template.json).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def picture(height: int, width: int, seed: int, mode: str = "RGB"):
    """A random image of smooth blobs (noise would average out under pooling), encoded
    as PNG and decoded, as a file would be."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    small = rng.random((max(height // 16, 2), max(width // 16, 2), channels)) * 255
    image = Image.fromarray(small.astype(np.uint8).squeeze(), mode).resize((width, height))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def tiny_gemma3_vl(seed: int = 0):
    """A random transformers Gemma3ForConditionalGeneration: text hidden 64 (five sliding
    layers of window 6, then a global one), SigLIP of hidden 32 on 64-pixel images."""
    import transformers

    text = dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # five sliding layers, then a global one, as GGUFs have them
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        sliding_window=6,
        query_pre_attn_scalar=32,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=16,
        vision_use_head=False,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        image_token_id=IMAGE,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_gemma3_vl_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and
    the image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(GEMMA3_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": GEMMA3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "image_seq_length": TOKENS_PER_IMAGE,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def processor_inputs(folder: Path, images: list, question: str | list[dict]):
    """transformers' Gemma3Processor inputs (input_ids, pixel_values, token_type_ids) for
    one user message of `images` then `question`, or for a conversation (`question` a list
    of messages, whose image parts take `images` in order), with the generation prompt:
    Gemma 3's chat template, the image tokens expanded, the images through
    Gemma3ImageProcessor."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    processor = transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    if isinstance(question, str):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
    else:
        messages = question
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes BOS already.
    return processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as a gemma3 GGUF (helpers.write_gguf, F32) with stories260K's
    vocabulary plus GEMMA3_TOKENS as control tokens."""
    config = model.config.text_config.to_dict()
    prefix = "model.language_model."
    state = {
        "model." + k[len(prefix) :]: v
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *GEMMA3_TOKENS])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(GEMMA3_TOKENS)])
        control = [gguf.TokenType.CONTROL] * len(GEMMA3_TOKENS)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_space_prefix(False)  # as conversion/gemma.py writes Gemma's
        writer.add_chat_template(GEMMA3_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


def write_mmproj(model, path: Path, qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """The vision tower and projector as llama.cpp's converter writes an mmproj GGUF:
    clip.* metadata, F32 tensors but the input projection's F16, the soft-embedding
    norm stored as 1 + w; with `qtype`, the encoder layers' matrices in that type."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.GEMMA3)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.Projector.SCALE_FACTOR, 2),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    writer.add_array(key.IMAGE_MEAN, [0.5, 0.5, 0.5])
    writer.add_array(key.IMAGE_STD, [0.5, 0.5, 0.5])
    writer.add_bool(key.USE_GELU, True)
    layer_names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out",
        "layer_norm1": "ln1",
        "layer_norm2": "ln2",
        "mlp.fc1": "ffn_up",
        "mlp.fc2": "ffn_down",
    }
    names = {
        "embeddings.patch_embedding": "v.patch_embd",
        "embeddings.position_embedding": "v.position_embd",
        "post_layernorm": "v.post_ln",
    }
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "model.multi_modal_projector.mm_input_projection_weight":
            writer.add_tensor("mm.input_projection.weight", data.astype(np.float16))
            continue
        if name == "model.multi_modal_projector.mm_soft_emb_norm.weight":
            writer.add_tensor("mm.soft_emb_norm.weight", data + 1)
            continue
        if not name.startswith("model.vision_tower."):
            continue
        module, _, suffix = name[len("model.vision_tower.") :].rpartition(".")
        if module.startswith("encoder.layers."):
            _, _, layer, rest = module.split(".", 3)
            gguf_name = f"v.blk.{layer}.{layer_names[rest]}"
            if qtype is not None and data.ndim == 2:
                raw = gguf.quants.quantize(data, qtype)
                writer.add_tensor(
                    f"{gguf_name}.{suffix}", raw, raw_shape=raw.shape, raw_dtype=qtype
                )
                continue
        else:
            gguf_name = names[module]
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""A tiny random Janus-Pro (JanusForConditionalGeneration: SigLIP tower, MLP aligner, Llama
text, and the image-generation half as small as its config allows) for the image tests: a
Hugging Face folder as save_pretrained writes it (stories260K's tokenizer plus Janus's image
tokens, the chat template of transformers' Janus conversion, JanusProcessor's files with
Janus-Pro's image mean 0.5 and its default system prompt), transformers' JanusProcessor
inputs for it (JanusImageProcessor's Pillow backend), and its files as llama.cpp's converter
writes them (a llama text GGUF, an mmproj GGUF of projector type janus_pro)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens.
JANUS_TOKENS = ("<image_placeholder>", "<begin_of_image>", "<end_of_image>", "<pad>")
IMAGE, BOI, EOI = 512, 513, 514
VOCAB = 520
IMAGE_SIZE, PATCH, TOKENS = 32, 8, 16  # 4x4 patches, one token each
MEAN = STD = [0.5, 0.5, 0.5]  # Janus-Pro's preprocessor_config.json
# transformers' models/janus/convert_janus_weights_to_hf.py CHAT_TEMPLATE, which the Hub's
# deepseek-community/Janus-Pro-* folders carry.
JANUS_TEMPLATE = (
    "{%set seps=['\n\n','<\uff5cend\u2581of\u2581sentence\uff5c>']%}"
    "{%set i=0%}"
    "{%for message in messages%}"
    "{%if message['role']|lower=='user'%}"
    "<|User|>: "
    "{%elif message['role']|lower=='assistant'%}"
    "<|Assistant|>:{%if not (loop.last and not add_generation_prompt and "
    "message['content'][0]['type']=='text' and message['content'][0]['text']=='')%} {%endif%}"
    "{%else%}"
    "{{message['role'].capitalize()}}: "
    "{%endif%}"
    "{%for content in message['content']%}"
    "{%if content['type']=='image'%}"
    "{%if not loop.first%}{{'\n'}}{%endif%}"
    "<image_placeholder>"
    "{%if not loop.last%}{{'\n'}}{%endif%}"
    "{%elif content['type']=='text'%}"
    "{%set text=content['text']%}"
    "{%if loop.first%}{%set text=text.lstrip()%}{%endif%}"
    "{%if loop.last%}{%set text=text.rstrip()%}{%endif%}"
    "{%if not loop.first and message['content'][loop.index0-1]['type']=='text'%}"
    "{{' '+text}}"
    "{%else%}"
    "{{text}}"
    "{%endif%}"
    "{%endif%}"
    "{%endfor%}"
    "{%if not loop.last or add_generation_prompt%}"
    "{%if message['role']|lower=='user'%}"
    "{{seps[0]}}"
    "{%else%}"
    "{{seps[1]}}"
    "{%endif%}"
    "{%endif%}"
    "{%endfor%}"
    "{%if add_generation_prompt%}<|Assistant|>:{%endif%}"
)
PROCESSOR = {
    "image_mean": MEAN,
    "image_std": STD,
    "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    "min_size": 14,
    "resample": 3,
}


def tiny_janus(seed: int = 0):
    """A random JanusForConditionalGeneration: Llama text of hidden 64 in 2 layers (its
    head tied, JanusConfig's default), a SigLIP of hidden 32 in 2 layers on 32-pixel images
    of 8-pixel patches, a 2-layer GELU aligner; the VQ model in one level of 32 channels."""
    import transformers

    text = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=515,
    )
    vision = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        mlp_ratio=2.0,
        projection_dim=64,
        depth=2,
        num_image_tokens=TOKENS,
    )
    vq = dict(
        embed_dim=8,
        num_embeddings=16,
        latent_channels=32,
        base_channels=32,
        channel_multiplier=[1],
        num_res_blocks=1,
        projection_dim=64,
        image_token_embed_dim=64,
    )
    config = transformers.JanusConfig(
        text_config=text, vision_config=vision, vq_config=vq, image_token_id=IMAGE
    )
    torch.manual_seed(seed)
    model = transformers.JanusForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
                p.normal_(1.0, 0.1)
    return model


def processor(folder: Path):
    """transformers' JanusProcessor for the folder, with JanusImageProcessor's Pillow
    backend (its default one needs torchvision) and Janus-Pro's default system prompt."""
    import transformers
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

    return transformers.JanusProcessor(
        image_processor=JanusImageProcessorPil(**PROCESSOR),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=JANUS_TEMPLATE,
        use_default_system_prompt=True,
        num_image_tokens=TOKENS,
    )


def save_janus_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files (the image
    tokens named as transformers' conversion names them) and the processor's files as
    JanusProcessor.save_pretrained writes them."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(JANUS_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "extra_special_tokens": {
            "image_token": "<image_placeholder>",
            "boi_token": "<begin_of_image>",
            "eoi_token": "<end_of_image>",
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor(path).save_pretrained(path)
    return path


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs (input_ids, pixel_values) for one user message of `images`
    then `question`, with the generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    messages = [{"role": "user", "content": content}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = made(text=text, images=images, return_tensors="pt")
    return {k: inputs[k] for k in ("input_ids", "pixel_values")}


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/januspro.py
    JanusProModel: arch llama, q/k permuted), F32, its head tied (no output.weight), with
    stories260K's vocabulary plus JANUS_TOKENS as control tokens and the chat template."""
    config = {**model.config.text_config.to_dict(), "tie_word_embeddings": True}
    prefix = "model.language_model."
    state = {
        "model." + k[len(prefix) :]: v
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    padding = VOCAB - 512 - len(JANUS_TOKENS)

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        tokens = [*JANUS_TOKENS, *(f"<pad{i}>" for i in range(padding))]
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *tokens])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(tokens)])
        control = [gguf.TokenType.CONTROL] * len(tokens)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_chat_template(JANUS_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


# HF names after model.vision_model.encoder.layers.N. -> the mmproj's (gguf-py's
# tensor_mapping for MODEL_ARCH.MMPROJ).
_LAYER_NAMES = {
    "layer_norm1": "ln1",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.projection_layer": "attn_out",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
_NAMES = {
    "vision_model.embeddings.patch_embedding": "v.patch_embd",
    "vision_model.embeddings.position_embedding": "v.position_embd",
    "vision_model.post_layernorm": "v.post_ln",
    "aligner.fc1": "mm.0",
    "aligner.hidden_layers.0": "mm.1",
}


def write_mmproj(model, path: Path, f16: bool = True) -> Path:
    """The vision tower and aligner as llama.cpp's converter writes an mmproj GGUF from the
    folder (conversion/januspro.py JanusProVisionModel): clip.* metadata with projector type
    janus_pro and GELU, F32 tensors but the 2-D matrices' and the patch convolution's F16
    (without `f16`, all F32: --outtype f32)."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.JANUS_PRO)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, int(vision.hidden_size * vision.mlp_ratio)),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, MEAN)
    writer.add_array(key.IMAGE_STD, STD)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    writer.add_bool(key.USE_GELU, True)
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_model.", "model.aligner.")):
            continue
        data = tensor.detach().float().numpy()
        module, _, suffix = name[len("model.") :].rpartition(".")
        if module.startswith("vision_model.encoder.layers."):
            layer, rest = module.split(".", 4)[3:]
            gguf_name = f"v.blk.{layer}.{_LAYER_NAMES[rest]}"
        else:
            gguf_name = _NAMES[module]
        if f16 and data.ndim >= 2 and "position_embd" not in gguf_name:
            data = data.astype(np.float16)
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""Tiny random LLaVA 1.5 and LLaVA-NeXT models (LlavaForConditionalGeneration,
LlavaNextForConditionalGeneration: CLIP tower, two-layer MLP, Llama text) for the image
tests: a Hugging Face folder as save_pretrained writes it (stories260K's tokenizer plus
<image>, a llava-hf style chat template, a preprocessor_config.json), transformers'
LlavaProcessor / LlavaNextProcessor inputs for it, and the model as llama.cpp lays it out:
a text GGUF (arch llama) and an mmproj GGUF as tools/mtmd/legacy-models/
convert_image_encoder_to_gguf.py writes it with --llava-projector (projector mlp, CLIP's
tensors renamed, fc1 named ffn_down, the layers past the feature layer dropped, the patch
convolution in F16; LLaVA-NeXT's pinpoints flattened and model.image_newline)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

LLAVA_TOKENS = ("<image>", "<pad>")  # ids 512 on, after stories260K's 512 tokens
IMAGE = 512
VOCAB = 520
# A CLIP tower on 32-pixel tiles of 8-pixel patches: 16 tokens a tile; 3 layers, the
# features after the second (vision_feature_layer -2).
TILE, PATCH, TILE_TOKENS = 32, 8, 16
PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96]]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# llava-hf's template, also taking a message whose content is a string.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
TEXT = dict(
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
    pad_token_id=513,
    tie_word_embeddings=False,
)
VISION = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=PATCH,
    projection_dim=24,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)


def tiny_llava(next_: bool = False, seed: int = 0):
    """A random LlavaForConditionalGeneration (or, with `next_`, a
    LlavaNextForConditionalGeneration of PINPOINTS): Llama text of hidden 64 in 2 layers,
    CLIP of hidden 32 in 3 layers. LayerNorm scales near 1; the patch convolution's weights
    are F16 values, as the mmproj stores them, so both formats give the same weights."""
    import transformers

    outer = dict(
        text_config=TEXT,
        vision_config=VISION,
        image_token_index=IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    if next_:
        config = transformers.LlavaNextConfig(**outer, image_grid_pinpoints=PINPOINTS)
        model_class = transformers.LlavaNextForConditionalGeneration
    else:
        config = transformers.LlavaConfig(**outer)
        model_class = transformers.LlavaForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "layrnorm.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith(("patch_embedding.weight", "linear_1.weight", "linear_2.weight")):
                p.copy_(p.half().float())
    return model


def processor_settings(next_: bool = False) -> dict:
    settings = {
        "image_processor_type": "LlavaNextImageProcessor" if next_ else "LlavaImageProcessor",
        "crop_size": {"height": TILE, "width": TILE},
        "do_center_crop": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": TILE},
    }
    if next_:
        settings["image_grid_pinpoints"] = PINPOINTS
    return settings


def save_llava_dir(model, path: Path, **processor_overrides) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (the -hf repos' kind, tiles of TILE pixels)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(LLAVA_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": LLAVA_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    next_ = model.config.model_type == "llava_next"
    settings = {**processor_settings(next_), **processor_overrides}
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path


def processor(folder: Path):
    """transformers' LlavaProcessor / LlavaNextProcessor for the folder, with the Pillow
    image processors (the default ones need torchvision)."""
    import transformers

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    kind = settings.pop("image_processor_type")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    common = dict(
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    if kind == "LlavaNextImageProcessor":
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil,
        )

        images = LlavaNextImageProcessorPil(**settings)
        return transformers.LlavaNextProcessor(image_processor=images, **common)
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    return transformers.LlavaProcessor(image_processor=LlavaImageProcessorPil(**settings), **common)


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs for one user message of `images` then `question`, with the
    generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(made(text=text, images=images, return_tensors="pt"))


def image_features(model, inputs: dict) -> torch.Tensor:
    """transformers' soft tokens of the inputs' images, all images' in order."""
    extra = {"image_sizes": inputs["image_sizes"]} if "image_sizes" in inputs else {}
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], **extra).pooler_output
    return torch.cat(list(out)) if isinstance(out, list | tuple) else out.flatten(0, 1)


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path, arch: str | None = None, extra=None) -> Path:
    """The language model as llama.cpp's converter writes a LLaVA's (arch llama, q/k
    permuted; helpers.write_gguf, F32) with stories260K's vocabulary plus LLAVA_TOKENS as
    control tokens and the chat template; `arch` and `extra(writer)` as write_gguf's."""
    config = model.config.text_config.to_dict()
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith(prefix) or k == "lm_head.weight"
    }
    extra_tokens = [*LLAVA_TOKENS, *(f"<extra{i}>" for i in range(VOCAB - 514))]

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *extra_tokens])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(extra_tokens)])
        control = [gguf.TokenType.CONTROL] * len(extra_tokens)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_chat_template(LLAVA_TEMPLATE)
        if extra is not None:
            extra(writer)

    return write_gguf(path, config, state, tokenizer=False, arch=arch, extra=vocabulary)


# CLIP's names after vision_model. -> the mmproj's, as the script renames them.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_down",  # sic: the script's names, which clip.cpp swaps back by shape
    "mlp.fc2": "ffn_up",
}
_NAMES = {
    "embeddings.class_embedding": "v.class_embd",
    "embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "embeddings.position_embedding.weight": "v.position_embd.weight",
    "pre_layrnorm.weight": "v.pre_ln.weight",
    "pre_layrnorm.bias": "v.pre_ln.bias",
}


def mmproj_tensors(model, feature_layer: bool = False) -> tuple[dict[str, np.ndarray], int]:
    """The mmproj's tensors (F32 but the patch convolution's and the projector's matrices,
    F16) and its block count: the
    tower's layers but the last, or up to the feature layer where the file names it."""
    layers = model.config.vision_config.num_hidden_layers
    kept = layers + 1 + model.config.vision_feature_layer if feature_layer else layers - 1
    out = {}
    tower = "model.vision_tower."  # transformers 5 keeps no vision_model. level
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "model.image_newline":
            out["model.image_newline"] = data
        elif name.startswith("model.multi_modal_projector."):
            rest = name[len("model.multi_modal_projector.") :]
            kind = np.float16 if data.ndim == 2 else np.float32  # the script's, even with --use-f32
            out[rest.replace("linear_1", "mm.0").replace("linear_2", "mm.2")] = data.astype(kind)
        elif name.startswith(tower):
            rest = name[len(tower) :]
            if rest in _NAMES:
                kind = np.float16 if data.ndim == 4 else np.float32
                out[_NAMES[rest]] = data.astype(kind)
            elif rest.startswith("encoder.layers."):
                index, module = rest[len("encoder.layers.") :].split(".", 1)
                if int(index) >= kept:
                    continue
                stem, suffix = module.rsplit(".", 1)
                out[f"v.blk.{index}.{_LAYER_NAMES[stem]}.{suffix}"] = data
    return out, kept


def write_mmproj(model, path: Path, feature_layer: bool = False, qtype=None) -> Path:
    """The image encoder as llama.cpp's LLaVA script writes it (--use-f32 and
    --clip-model-is-vision, as for LLaVA 1.6; `feature_layer`: the vision config names
    vision_feature_layer, so the file holds clip.vision.feature_layer); with `qtype`, the
    layers' matrices in that type."""
    config = model.config
    vision = config.vision_config
    tensors, blocks = mmproj_tensors(model, feature_layer)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(gguf.Keys.Clip.HAS_LLAVA_PROJECTOR, True)
    writer.add_file_type(0)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, "mlp")
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.PROJECTION_DIM, vision.projection_dim),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.BLOCK_COUNT, blocks),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    if config.model_type == "llava_next":
        flat = [p for pinpoint in config.image_grid_pinpoints for p in pinpoint]
        writer.add_array("clip.vision.image_grid_pinpoints", flat)
        writer.add_string("clip.vision.image_aspect_ratio", "anyres")
        writer.add_string("clip.vision.mm_patch_merge_type", "spatial_unpad")
    if feature_layer:
        writer.add_array("clip.vision.feature_layer", [blocks])
    writer.add_array(key.IMAGE_MEAN, CLIP_MEAN)
    writer.add_array(key.IMAGE_STD, CLIP_STD)
    writer.add_bool(key.USE_GELU, vision.hidden_act == "gelu")
    for name, data in tensors.items():
        if qtype is not None and data.ndim == 2 and name.startswith("v.blk."):
            raw = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

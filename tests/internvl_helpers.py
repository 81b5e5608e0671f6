"""A tiny random InternVL (InternVLForConditionalGeneration, Qwen2 text) or Qianfan-OCR
(QianfanOCRForConditionalGeneration: InternVL's encoder, Qwen3 text) for the image tests: a
Hugging Face folder as save_pretrained writes it (stories260K's tokenizer plus Qwen's chat
tokens and InternVL's image tokens, the -hf repos' chat template or Qianfan-OCR's with
<image> for an image, a preprocessor_config.json), transformers' InternVLProcessor or
QianfanOCRProcessor inputs for it, and the InternVL as llama.cpp's converter writes an
original InternVL repo: a text GGUF (arch qwen2) and an mmproj GGUF
(conversion/internvl.py)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens.
INTERNVL_TOKENS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
IMG_START, IMG_END, IMG_CONTEXT = 514, 515, 516
VOCAB = 520
# 64-pixel tiles of 8x8 patches, pixel-shuffled 2x2: 16 tokens a tile; up to 4 tiles.
TILE, PATCH, MAX_TILES = 64, 8, 4
TOKENS_PER_TILE = 16
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# The -hf repos' chat template (transformers' convert_internvl_weights_to_hf.py).
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
# Qianfan-OCR's: the same with QianfanOCRProcessor's image placeholder.
QIANFAN_TEMPLATE = INTERNVL_TEMPLATE.replace("<IMG_CONTEXT>\\n", "<image>\\n")
TEXT = dict(
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens, not an early <|im_end|>
    tie_word_embeddings=False,
)
# InternViT-300M's shape (LayerNorm, q/k/v biases, no q/k norms), shrunk.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=PATCH,
    attention_bias=True,
    norm_type="layer_norm",
    use_qk_norm=False,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
)


def tiny_internvl(
    seed: int = 0, vision_layers: int = 2, text_type: str = "qwen2", family: str = "InternVL"
):
    """A random transformers InternVLForConditionalGeneration (`family` QianfanOCR:
    QianfanOCRForConditionalGeneration): Qwen2 text (InternVL 3's; or `text_type` qwen3,
    InternVL 3.5's and Qianfan-OCR's) of hidden 64 in 2 layers, InternViT of hidden 32 in
    `vision_layers` layers on 64-pixel tiles; layer scales, class token and position
    embeddings random too. (llama.cpp's converter maps the projector's mlp1.3 only where
    the tower has 4 layers or more.)"""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        text_config={**TEXT, "model_type": text_type},
        vision_config={**VISION, "num_hidden_layers": vision_layers},
        image_token_id=IMG_CONTEXT,
        image_seq_length=TOKENS_PER_TILE,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm_before.weight", "layernorm_after.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith(("lambda_1", "lambda_2")):
                p.normal_(0.5, 0.2)  # layer scales, which InternViT trains
    return model


def save_internvl_dir(model, path: Path, **processor_settings) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files (the
    -hf repos' extra_special_tokens, which InternVLProcessor reads) and the image
    processor's settings (GotOcr2ImageProcessor's, as the -hf repos have them, but tiles of
    TILE pixels and at most MAX_TILES)."""
    model.save_pretrained(path)
    template = _template(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(INTERNVL_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "extra_special_tokens": {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {
        "image_processor_type": "GotOcr2ImageProcessor",
        "crop_to_patches": False,  # InternVLProcessor crops whatever this says
        "image_mean": IMAGENET_MEAN,
        "image_std": IMAGENET_STD,
        "min_patches": 1,
        "max_patches": MAX_TILES,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"height": TILE, "width": TILE},
        **processor_settings,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def save_qianfan_ocr_dir(model, path: Path) -> Path:
    """A Qianfan-OCR's folder (save_internvl_dir's) with its weights as the Hub's files
    hold them: the original InternVL-chat names (original_layout; transformers renames
    them on loading), the language model as language_model.model.* and its head."""
    from safetensors.torch import save_file

    save_internvl_dir(model, path)
    tensors = {k: torch.from_numpy(v) for k, v in original_layout(model).items()}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model."):
            tensors["language_model.model." + name[len("model.language_model.") :]] = tensor
        elif name == "lm_head.weight":
            tensors["language_model.lm_head.weight"] = tensor
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def _template(folder: Path) -> str:
    """The chat template of the folder's family (its config.json's model_type)."""
    qianfan = json.loads((folder / "config.json").read_text())["model_type"] == "qianfan_ocr"
    return QIANFAN_TEMPLATE if qianfan else INTERNVL_TEMPLATE


def processor(folder: Path):
    """transformers' InternVLProcessor (QianfanOCRProcessor for a Qianfan-OCR) for the
    folder, with GotOcr2ImageProcessor's Pillow backend (the default one needs
    torchvision, which the tests go without)."""
    import transformers
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    template = _template(folder)
    base = transformers.QianfanOCRProcessor
    if template == INTERNVL_TEMPLATE:
        base = transformers.InternVLProcessor

    class Processor(base):
        # Images only: its video processor needs torchvision.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    keys = ("image_mean", "image_std", "min_patches", "max_patches", "size", "resample")
    return Processor(
        image_processor=GotOcr2ImageProcessorPil(**{k: settings[k] for k in keys}),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        image_seq_length=TOKENS_PER_TILE,
        chat_template=template,
    )


def processor_inputs(folder: Path, images: list, question: str):
    """The processor's inputs (input_ids, pixel_values) for one user message of `images`
    then `question`, with the generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes an InternVL 3's (arch qwen2;
    helpers.write_gguf, F32) with stories260K's vocabulary plus INTERNVL_TOKENS as control
    tokens and the chat template."""
    config = {**model.config.text_config.to_dict(), "model_type": "qwen2"}
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith(prefix) or k == "lm_head.weight"
    }
    extra_tokens = [*INTERNVL_TOKENS, "<pad0>", "<pad1>"]

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
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)  # as the text of the Hub's tokenizer.json
        writer.add_chat_template(INTERNVL_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


def original_layout(model) -> dict[str, np.ndarray]:
    """The vision tower and projector (InternVL's or Qianfan-OCR's) under an original
    InternVL repo's names (InternVLChatModel: vision_model.*, its qkv fused, mlp1.*), as
    transformers' convert_internvl_weights_to_hf.py reads them."""
    out = {}
    vision = "model.vision_tower."
    renames = {
        "embeddings.cls_token": "embeddings.class_embedding",
        "embeddings.position_embeddings": "embeddings.position_embedding",
        "embeddings.patch_embeddings.projection": "embeddings.patch_embedding",
    }
    layer_renames = {
        "attention.projection_layer": "attn.proj",
        "attention.q_norm": "attn.q_norm",
        "attention.k_norm": "attn.k_norm",
        "layernorm_before": "norm1",
        "layernorm_after": "norm2",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
        "lambda_1": "ls1",
        "lambda_2": "ls2",
    }
    qkv: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name.startswith("model.multi_modal_projector."):
            module, suffix = name[len("model.multi_modal_projector.") :].split(".")
            index = {"layer_norm": 0, "linear_1": 1, "linear_2": 3}[module]
            out[f"mlp1.{index}.{suffix}"] = data
            continue
        if not name.startswith(vision):
            continue
        rest = name[len(vision) :]
        for old, new in renames.items():
            if rest.startswith(old):
                out["vision_model." + new + rest[len(old) :]] = data
                break
        else:
            # encoder.layer.N.module... (Qianfan-OCR's: layers.N.module...)
            index, module = rest.removeprefix("encoder.").split(".", 2)[1:]
            base = f"vision_model.encoder.layers.{index}"
            part = module.split(".")
            if part[0] == "attention" and part[1] in ("q_proj", "k_proj", "v_proj"):
                qkv.setdefault(f"{base}.attn.qkv.{part[2]}", {})[part[1]] = data
                continue
            stem = next(old for old in layer_renames if module.startswith(old))
            out[f"{base}.{layer_renames[stem]}{module[len(stem) :]}"] = data
    for name, pieces in qkv.items():
        out[name] = np.concatenate([pieces["q_proj"], pieces["k_proj"], pieces["v_proj"]])
    return out


# The original names -> the mmproj's, as the converter maps them (gguf-py's
# tensor_mapping for MODEL_ARCH.MMPROJ; benchmarks/llama_cpp_internvl.py checks it).
_GGUF_LAYER = {
    "norm1": "ln1",
    "norm2": "ln2",
    "attn.proj": "attn_out",
    "attn.q_norm": "attn_q_norm",
    "attn.k_norm": "attn_k_norm",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
    "ls1": "ls1",
    "ls2": "ls2",
}
_GGUF_NAMES = {
    "vision_model.embeddings.class_embedding": "v.class_embd",
    "vision_model.embeddings.position_embedding": "v.position_embd.weight",
    "vision_model.embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "vision_model.embeddings.patch_embedding.bias": "v.patch_embd.bias",
}


def gguf_tensors(original: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """original_layout's tensors under the mmproj's names, each qkv split in three."""
    out = {}
    for name, data in original.items():
        if name in _GGUF_NAMES:
            out[_GGUF_NAMES[name]] = data
        elif name.startswith("mlp1."):
            out["mm.model.mlp." + name[len("mlp1.") :]] = data
        else:
            layer, module = name[len("vision_model.encoder.layers.") :].split(".", 1)
            if module.startswith("attn.qkv."):
                suffix = module.rsplit(".", 1)[1]
                for part, piece in zip("qkv", np.split(data, 3), strict=True):
                    out[f"v.blk.{layer}.attn_{part}.{suffix}"] = piece
                continue
            stem, _, suffix = module.rpartition(".")
            if stem in ("ls1", "ls2") or module in ("ls1", "ls2"):
                stem, suffix = module, "weight"
            out[f"v.blk.{layer}.{_GGUF_LAYER[stem]}.{suffix}"] = data
    return out


def write_mmproj(model, path: Path, qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """The vision tower and projector as llama.cpp's converter writes an mmproj GGUF from
    an original InternVL repo of the same weights (InternVisionModel): clip.* metadata
    with projector type internvl, F32 tensors; with `qtype`, the encoder layers' matrices
    in that type."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.INTERNVL)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size[0]),
        (key.PATCH_SIZE, vision.patch_size[0]),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.Projector.SCALE_FACTOR, int(1 / model.config.downsample_ratio)),
        (key.PREPROC_MIN_TILES, 1),
        (key.PREPROC_MAX_TILES, MAX_TILES),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, IMAGENET_MEAN)
    writer.add_array(key.IMAGE_STD, IMAGENET_STD)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    writer.add_bool(key.USE_GELU, True)
    for name, data in gguf_tensors(original_layout(model)).items():
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

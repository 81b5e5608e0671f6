"""A tiny random Granite 4 Vision (Granite4VisionForConditionalGeneration: SigLIP tower,
Window Q-Former projectors, Granite text) for the image tests: its Hugging Face folder
(llava_helpers' stories260K tokenizer plus <image>, chat template and LLaVA-NeXT image
processor settings) and transformers' Granite4VisionProcessor inputs for it.

The tower: hidden 64 (one 64-wide Q-Former head) in 6 layers on 32-pixel tiles of 4-pixel
patches, 8 patches a side; downsample_rate 2/4 keeps 4 a side. Two deepstack projectors
(the states after layers 3 and 4, named from the end) go to decoder layers 0 and 1, the
spatial ones (the last layer's corners) to 2..5 of the 6. The same model as llama.cpp's
converter writes it: a text GGUF (arch granite, deepstack_mapping) and an mmproj.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import llava_helpers
import numpy as np
import torch
from helpers import randomize
from llava_helpers import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGE,
    LLAVA_TEMPLATE,
    PINPOINTS,
    TILE,
    processor_settings,
    save_llava_dir,
)

PATCH = 4
DOWNSAMPLE = "2/4"
TEXT = dict(
    model_type="granite4_vision_text",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=520,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.25,
    logits_scaling=2.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=513,
    tie_word_embeddings=False,
)
VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=PATCH,
)
QFORMER = dict(
    model_type="blip_2_qformer",
    num_hidden_layers=1,
    intermediate_size=96,
    cross_attention_frequency=1,
    use_qformer_text_input=False,
    max_position_embeddings=2048,
)


def tiny_granite4_vision(seed: int = 0):
    """A random Granite4VisionForConditionalGeneration (helpers.randomize's weights)."""
    import transformers

    config = transformers.Granite4VisionConfig(
        text_config=TEXT,
        vision_config=VISION,
        qformer_config=QFORMER,
        image_token_index=IMAGE,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        downsample_rate=DOWNSAMPLE,
        deepstack_layer_map=[[-3, 0], [-2, 1]],
        spatial_vision_layer=-1,
        spatial_target_layers=[2, 3, 4, 5],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Granite4VisionForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_granite4_vision_dir(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with the tokenizer files and
    LlavaNextImageProcessor's settings."""
    return save_llava_dir(model, path, **processor_settings(next_=True))


def processor(folder: Path):
    """transformers' Granite4VisionProcessor for the folder (the Pillow image processor)."""
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    return transformers.Granite4VisionProcessor(
        image_processor=LlavaNextImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH,
        vision_feature_select_strategy="full",
        downsample_rate=DOWNSAMPLE,
        chat_template=LLAVA_TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs for one user message of `images` then `question`, with the
    generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(made(text=text, images=images, return_tensors="pt"))


def image_streams(model, inputs: dict) -> torch.Tensor:
    """transformers' image features of the inputs' images [tokens, K * hidden]: each
    projector's packed features, ordered by the decoder layer it goes to, side by side."""
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"])
    streams = sorted(out.deepstack_features, key=lambda pair: pair[0])
    return torch.cat([torch.cat(list(features)) for _, features in streams], dim=-1)


def text_gguf_keys(writer) -> None:
    """The Granite keys and deepstack_mapping that llama.cpp's converter (GraniteModel,
    conversion/granite.py) writes for the language model: each layer's stream, -1 for none
    and for layer 0, whose stream is the input."""
    keys = gguf.Keys
    for field, key in (
        ("logits_scaling", keys.LLM.LOGIT_SCALE),
        ("embedding_multiplier", keys.LLM.EMBEDDING_SCALE),
        ("residual_multiplier", keys.LLM.RESIDUAL_SCALE),
        ("attention_multiplier", keys.Attention.SCALE),
    ):
        writer.add_float32(key.format(arch="granite"), TEXT[field])
    mapping = [-1] * TEXT["num_hidden_layers"]
    for stream, layer in enumerate(sorted(STREAM_LAYERS)):
        if stream:
            mapping[layer] = stream
    writer.add_array("granite.deepstack_mapping", mapping)


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (arch granite)."""
    return llava_helpers.write_text_gguf(model, path, arch="granite", extra=text_gguf_keys)


# The tower's names after vision_model. -> the mmproj's (clip.cpp's SigLIP names).
_TOWER_NAMES = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
}
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
_QFORMER = "qformer.encoder.layer.0."
_PROJECTOR_NAMES = {
    "query": "query",
    "image_positions": "img_pos",
    "norm": "norm",
    "qformer.layernorm": "post_norm",
    "out_linear": "linear",
    _QFORMER + "intermediate_query.dense": "ffn_up",
    _QFORMER + "output_query.dense": "ffn_down",
    _QFORMER + "output_query.LayerNorm": "ffn_norm",
    **{
        f"{_QFORMER}{module}.{part}": f"{kind}_{short}"
        for module, kind in (("attention", "self_attn"), ("crossattention", "cross_attn"))
        for part, short in (
            ("attention.query", "q"),
            ("attention.key", "k"),
            ("attention.value", "v"),
            ("output.dense", "out"),
            ("output.LayerNorm", "norm"),
        )
    },
}
# The projectors in the order of their decoder layers: (HF module prefix, vision layer as
# the converter normalizes it (n + v for v < 0), spatial offset or -1).
STREAM_LAYERS = [0, 1, 2, 3, 4, 5]
_STREAMS = [
    ("layerwise_projectors.0", 3, -1),
    ("layerwise_projectors.1", 4, -1),
    *((f"spatial_projectors.{i}", 5, i) for i in range(4)),
]


def write_mmproj(model, path: Path) -> Path:
    """The image encoder as llama.cpp's converter writes it with --mmproj --outtype f32
    (Granite4VisionMmprojModel: projector type granite4_vision, the tower as SigLIP's v.*,
    projector K (by decoder layer) as v.proj_blk.K.*, pinpoints as width, height)."""
    config = model.config
    vision = config.vision_config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {"v.image_newline": state["model.image_newline"]}
    tower = "model.vision_tower."
    for name, data in state.items():
        if not name.startswith(tower) or name.startswith(tower + "head."):
            continue
        module, _, suffix = name[len(tower) :].rpartition(".")
        if module in _TOWER_NAMES:
            tensors[f"{_TOWER_NAMES[module]}.{suffix}"] = data
        else:
            _, _, layer, rest = module.split(".", 3)
            tensors[f"v.blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"] = data
    for k, (prefix, _, _) in enumerate(_STREAMS):
        for name, data in state.items():
            if name.startswith(f"model.{prefix}."):
                rest = name[len(f"model.{prefix}.") :]
                if rest in _PROJECTOR_NAMES:
                    tensors[f"v.proj_blk.{k}.{_PROJECTOR_NAMES[rest]}"] = data
                else:
                    module, _, suffix = rest.rpartition(".")
                    tensors[f"v.proj_blk.{k}.{_PROJECTOR_NAMES[module]}.{suffix}"] = data
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, "granite4_vision")
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.PROJECTION_DIM, config.text_config.hidden_size),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        ("clip.vision.preproc_image_size", vision.image_size),
        ("clip.vision.projector.query_side", 2),
        ("clip.vision.projector.window_side", 4),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    writer.add_bool(key.USE_GELU, True)
    writer.add_array(key.IMAGE_MEAN, CLIP_MEAN)
    writer.add_array(key.IMAGE_STD, CLIP_STD)
    writer.add_array("clip.vision.feature_layer", [v for _, v, _ in _STREAMS])
    writer.add_array("clip.vision.projector.spatial_offsets", [c for _, _, c in _STREAMS])
    writer.add_array("clip.vision.image_grid_pinpoints", [x for h, w in PINPOINTS for x in (w, h)])
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

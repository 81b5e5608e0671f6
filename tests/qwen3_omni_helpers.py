"""A tiny random Qwen3-Omni thinker (Qwen3OmniMoeThinkerForConditionalGeneration: a
Qwen3-MoE with interleaved M-RoPE, Qwen3-VL's vision tower with deepstack, its own audio
tower) for the image and audio tests: as a Hugging Face folder (stories260K's tokenizer
plus Qwen3-Omni's chat, vision and audio tokens, a chat template of its markers, one
preprocessor_config.json of both processors), as the Hub lays it out (thinker_config,
thinker.* weights beside talker and code2wav ones), as llama.cpp's converter writes it (a
text GGUF of arch qwen3vlmoe and one mmproj GGUF of both towers, laid out as
conversion/qwen3vl.py writes the tiny model's), and transformers' Qwen3OmniMoeProcessor
inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import randomize
from qwen2_5_omni_helpers import (
    AUDIO_LAYER_NAMES,
    add_audio_tower_keys,
    omni_processor,
    thinker_hub_layout,
    write_omni_tokenizer,
)
from qwen2_5_omni_helpers import processor_inputs as omni_inputs

# Ids 512 on, after stories260K's 512 tokens.
OMNI_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IM_START, IM_END, AUDIO_START, AUDIO_END, AUDIO, VISION_START, VISION_END, IMAGE, VIDEO = range(
    512, 521
)
VOCAB = 521
# Qwen3-Omni's markers in Qwen2.5-Omni's template (the Hub's adds reasoning and tools).
OMNI_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# 8 pairs a head in uneven sections, interleaved; 4 experts, 2 a token.
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [3, 2, 3],
        "mrope_interleaved": True,
    },
)
# One block, its features deepstacked; a 4x4 grid of learned positions.
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    deepstack_visual_indexes=[0],
    num_position_embeddings=16,
)
# Attention windows of 2 chunks (26 tokens), so that a 2.5-second clip spans two.
AUDIO_CONFIG = dict(
    d_model=32,
    encoder_ffn_dim=64,
    encoder_layers=1,
    encoder_attention_heads=2,
    num_mel_bins=128,
    output_dim=64,
    downsample_hidden_size=8,
    n_window=50,
    n_window_infer=200,
)
# Qwen3-VL's image settings (those llmrun gives an mmproj, which holds none) and the Hub's
# feature extractor's.
PROCESSOR = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 65536,
    "max_pixels": 16777216,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def tiny_qwen3_omni(seed: int = 0, deepstack: bool = True):
    """A random transformers Qwen3OmniMoeThinkerForConditionalGeneration: TEXT, VISION
    (without its deepstack merger unless `deepstack`) and AUDIO_CONFIG."""
    import transformers

    config = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=TEXT,
        vision_config={**VISION, "deepstack_visual_indexes": [0] if deepstack else []},
        audio_config=AUDIO_CONFIG,
        audio_token_id=AUDIO,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_start_token_id=AUDIO_START,
        vision_start_token_id=VISION_START,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and (".norm" in name or ".ln_q" in name) and "weight" in name:
                p.normal_(1.0, 0.1)
    return model


def save_qwen3_omni_dir(model, path: Path) -> Path:
    """The thinker's folder, as save_pretrained writes it, with the tokenizer files and
    PROCESSOR."""
    model.save_pretrained(path)
    write_omni_tokenizer(path, OMNI_TOKENS, OMNI_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def hub_layout(folder: Path, path: Path) -> Path:
    """The thinker's folder as the Hub's Qwen3OmniMoeForConditionalGeneration lays it out:
    config.json with thinker_config (and a talker's), every thinker weight under thinker.,
    and talker and code2wav weights beside them."""
    config = {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "talker_config": {"model_type": "qwen3_omni_moe_talker", "thinker_hidden_size": 64},
    }
    unread = ("talker.model.codec_embedding.weight", "code2wav.code_embedding.weight")
    return thinker_hub_layout(folder, path, config, unread)


def processor(folder: Path):
    """transformers' Qwen3OmniMoeProcessor for the folder (Qwen2VLImageProcessorPil with
    PROCESSOR's settings, WhisperFeatureExtractor of 128 mel bins)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    names = dict(
        image_token="<|image_pad|>",
        audio_token="<|audio_pad|>",
        video_token="<|video_pad|>",
        vision_bos_token="<|vision_start|>",
        vision_eos_token="<|vision_end|>",
        audio_bos_token="<|audio_start|>",
        audio_eos_token="<|audio_end|>",
    )
    image = Qwen2VLImageProcessorPil(
        min_pixels=PROCESSOR["min_pixels"],
        max_pixels=PROCESSOR["max_pixels"],
        patch_size=16,
        image_mean=PROCESSOR["image_mean"],
        image_std=PROCESSOR["image_std"],
    )
    base = transformers.Qwen3OmniMoeProcessor
    return omni_processor(base, folder, names, image, OMNI_TEMPLATE)


def processor_inputs(folder: Path, messages: list[dict], images=None, clips=None):
    """The processor's inputs for `messages` (their image and audio parts take `images`
    and `clips`, 16 kHz float samples, in order), with the generation prompt."""
    return omni_inputs(folder, messages, images, clips, made=processor(folder))


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/qwen3vl.py
    Qwen3OmniMoeTextModel: arch qwen3vlmoe, Qwen3-MoE's tensors with the experts stacked,
    rope.dimension_sections, n_deepstack_layers 0), F32, with stories260K's vocabulary plus
    OMNI_TOKENS as control tokens and the chat template."""
    from helpers import STORIES_GGUF
    from moe_helpers import stacked_gguf_state, write_moe_gguf

    from llmrun.loading import experts, loader
    from llmrun.loading.gguf_io import read_gguf

    config = {**model.config.text_config.to_dict(), "model_type": "qwen3_moe"}
    language = {
        key.replace("model.language_model.", "model."): loader.Weight(value)
        for key, value in model.state_dict().items()
        if key.startswith("model.language_model.") or key == "lm_head.weight"
    }
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    split = experts.split_stacked(language, loader._STACKED_EXPERTS, hidden, width, loader.Weight)
    tensors = stacked_gguf_state({key: w.tensor for key, w in split.items()}, config)
    sections = list(config["rope_parameters"]["mrope_section"])

    def tokenizer(writer) -> None:
        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *OMNI_TOKENS])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(OMNI_TOKENS)])
        control = [gguf.TokenType.CONTROL] * len(OMNI_TOKENS)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(OMNI_TEMPLATE)

    keys = {
        "{arch}.rope.dimension_sections": ([*sections, 0], "array"),
        "{arch}.n_deepstack_layers": 0,
    }
    return write_moe_gguf(
        path, config, tensors, metadata=keys, arch="qwen3vlmoe", tokenizer=tokenizer
    )


_AUDIO_NAMES = {
    "conv2d1": "a.conv2d.1",
    "conv2d2": "a.conv2d.2",
    "conv2d3": "a.conv2d.3",
    "conv_out": "a.conv_out",
    "ln_post": "a.post_ln",
    "proj1": "mm.a.mlp.1",
    "proj2": "mm.a.mlp.2",
}
_VISION_LAYER = {
    "attn.qkv": "attn_qkv",
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.linear_fc1": "ffn_up",
    "mlp.linear_fc2": "ffn_down",
}
_MERGER = {"ln_q": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2"}
_DEEPSTACK = {"ln_q": "norm", "mlp.0": "fc1", "mlp.2": "fc2"}


def write_mmproj(model, path: Path) -> Path:
    """Both towers as llama.cpp's converter writes Qwen3-Omni's one mmproj GGUF with
    --outtype f32 (conversion/qwen3vl.py Qwen3OmniMmprojModel; the names, shapes, types and
    keys it gives the tiny model): clip.vision.projector_type qwen3vl_merger and
    clip.audio.projector_type qwen3a; the vision tower as Qwen3-VL's (the Conv3d patch
    weight split into its two frames, the merger as v.post_ln, mm.0 and mm.2, each
    deepstack merger as v.deepstack.BLOCK.*); the audio tower's conv weights and conv_out
    F16, its conv biases [channels, 1, 1], the sinusoid table as a.position_embd, proj1 and
    proj2 as mm.a.mlp.1 and mm.a.mlp.2."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        SinusoidsPositionEmbedding,
    )

    config = model.config
    vision, audio = config.vision_config, config.audio_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, vision.out_hidden_size),
        (key.IMAGE_SIZE, int(vision.num_position_embeddings**0.5 * vision.patch_size)),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.depth),
        (key.Attention.HEAD_COUNT, vision.num_heads),
        (key.SPATIAL_MERGE_SIZE, vision.spatial_merge_size),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, PROCESSOR["image_mean"])
    writer.add_array(key.IMAGE_STD, PROCESSOR["image_std"])
    writer.add_bool(key.USE_GELU, True)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
    deepstack = list(vision.deepstack_visual_indexes)
    writer.add_array(key.IS_DEEPSTACK_LAYERS, [i in deepstack for i in range(vision.depth)])
    writer.add_string(key.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN3VL)
    add_audio_tower_keys(writer, config)
    key = gguf.Keys.ClipAudio
    writer.add_string(key.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN3A)
    table = SinusoidsPositionEmbedding(1500, audio.d_model)
    writer.add_tensor("a.position_embd.weight", table.positional_embedding.numpy())
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name.startswith("model.visual."):
            module, _, suffix = name[len("model.visual.") :].rpartition(".")
            if module == "patch_embed.proj" and suffix == "weight":
                writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0]))
                writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))
            elif module == "patch_embed.proj":
                writer.add_tensor(f"v.patch_embd.{suffix}", data)
            elif module == "pos_embed":
                writer.add_tensor(f"v.position_embd.{suffix}", data)
            elif module.startswith("merger."):
                writer.add_tensor(f"{_MERGER[module[len('merger.') :]]}.{suffix}", data)
            elif module.startswith("merger_list."):
                _, index, part = module.split(".", 2)
                block = deepstack[int(index)]
                writer.add_tensor(f"v.deepstack.{block}.{_DEEPSTACK[part]}.{suffix}", data)
            else:
                _, block, rest = module.split(".", 2)
                writer.add_tensor(f"v.blk.{block}.{_VISION_LAYER[rest]}.{suffix}", data)
        elif name.startswith("model.audio_tower."):
            module, _, suffix = name[len("model.audio_tower.") :].rpartition(".")
            if module.startswith("conv"):
                data = data[:, None, None] if suffix == "bias" else data.astype(np.float16)
            if module in _AUDIO_NAMES:
                writer.add_tensor(f"{_AUDIO_NAMES[module]}.{suffix}", data)
            else:
                _, layer, rest = module.split(".", 2)
                writer.add_tensor(f"a.blk.{layer}.{AUDIO_LAYER_NAMES[rest]}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

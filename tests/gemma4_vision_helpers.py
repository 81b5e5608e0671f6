"""A tiny random Gemma 4 with its vision tower (Gemma4ForConditionalGeneration) for the
image tests: as a Hugging Face folder (stories260K's tokenizer plus Gemma 4's turn, image
and audio tokens, Gemma 4's chat template, a preprocessor_config.json), transformers'
Gemma4Processor on it, and as llama.cpp's converter writes it: a gemma4 text GGUF and an
mmproj GGUF (conversion/gemma.py Gemma4Model and Gemma4VisionAudioModel, gguf's tensor
name maps)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, TEMPLATES_DIR, randomize

# Ids 512 on, after stories260K's 512 tokens.
GEMMA4_TOKENS = (
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<|image|>",
    "<image|>",
    "<|audio>",
    "<|audio|>",
    "<audio|>",
    "<|channel>",
    "<channel|>",
)
BOI, IMAGE, EOI = 514, 515, 516
VOCAB = 512 + len(GEMMA4_TOKENS)
TEMPLATE = "google-gemma-4-31B-it.jinja"
PATCH, POOL, MAX_SOFT_TOKENS = 4, 3, 70  # images of at most 630 patches of 4x4 pixels
WINDOW = 8
LOCAL_DIM, GLOBAL_DIM = 16, 32
S, F = "sliding_attention", "full_attention"


def tiny_gemma4_vl(seed: int = 0, audio: dict | None = None):
    """A random transformers Gemma4ForConditionalGeneration: text hidden 64 (a sliding
    layer of window 8, then a global one; per-layer inputs of 16; image tokens attending
    each other both ways on the sliding layer), a vision tower of hidden 32 (2 layers,
    heads of 16, 2D RoPE, pooling 3x3 patches, standardized features, clipped linears);
    with `audio`, an audio tower of that Gemma4AudioConfig too."""
    import transformers

    text = dict(
        model_type="gemma4_text",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=LOCAL_DIM,
        global_head_dim=GLOBAL_DIM,
        layer_types=[S, F],
        sliding_window=WINDOW,
        vocab_size=VOCAB,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=10.0,
        use_bidirectional_attention="vision",
        max_position_embeddings=512,
        rope_parameters={
            F: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=10000.0),
            S: dict(rope_type="default", rope_theta=1000.0),
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        pooling_kernel_size=POOL,
        position_embedding_size=128,
        use_clipped_linears=True,
        standardize=True,
    )
    config = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        image_token_id=IMAGE,
        video_token_id=VOCAB,  # none: past the vocabulary
        audio_token_id=518,
        boa_token_id=517,
        eoa_token_index=519,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    # Norms near 1 (q and k norms at half that: Gemma 4 leaves scores unscaled), the
    # embeddings (tied to the head) at a tenth (at randomize()'s size, times sqrt(64), a
    # token's own embedding dominates the residual and greedy decoding repeats it), the
    # clipping bounds cutting the largest values only, the standardization near the
    # identity.
    scales = {"q_norm.weight": 0.5, "k_norm.weight": 0.5, "embed_tokens.weight": 0.1}
    randomize(model, scales)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5)
            elif name.endswith("std_bias"):
                buffer.normal_(0, 0.5)
            elif name.endswith("std_scale"):
                buffer.normal_(1, 0.1)
        for layer in model.model.language_model.layers:
            layer.layer_scalar.fill_(0.7)
    return model


def save_gemma4_vl_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files (Gemma
    4's chat template) and the image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(GEMMA4_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "chat_template": (TEMPLATES_DIR / TEMPLATE).read_text(),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    image_processor().to_json_file(path / "preprocessor_config.json")
    return path


def image_processor(tokens: int = MAX_SOFT_TOKENS):
    """transformers' Gemma 4 image processor (its PIL backend) for the tiny model, with
    a budget of `tokens` soft tokens an image."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(
        patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=tokens
    )


def processor(folder: Path, tokens: int = MAX_SOFT_TOKENS):
    """transformers' Gemma4Processor of the folder (its PIL image processor)."""
    import transformers
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {
        "boi_token": "<|image>",
        "image_token": "<|image|>",
        "eoi_token": "<image|>",
        "boa_token": "<|audio>",
        "audio_token": "<|audio|>",
        "eoa_token": "<audio|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # Its constructor checks each part's class, and transformers without torchvision has
    # no video processor class to check against: the check is skipped (no video here).
    check = transformers.ProcessorMixin.check_argument_for_proper_class
    with patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)):  # fmt: skip
        return transformers.Gemma4Processor(
            feature_extractor=Gemma4AudioFeatureExtractor(),
            image_processor=image_processor(tokens),
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            video_processor=None,
            chat_template=config["chat_template"],
        )


def processor_inputs(folder: Path, images: list, question: str, tokens: int = MAX_SOFT_TOKENS):
    """Gemma4Processor's inputs (input_ids, pixel_values, image_position_ids,
    mm_token_type_ids) for one user message of `images` then `question`, with the
    generation prompt; `tokens`: the soft-token budget of an image."""
    proc = processor(folder, tokens)
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes BOS already.
    return proc(text=text, images=images, return_tensors="pt", add_special_tokens=False)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()


def _vocabulary(writer, template: str) -> None:
    """stories260K's vocabulary plus GEMMA4_TOKENS as control tokens, and the template."""
    from llmrun.loading.gguf_io import read_gguf

    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *GEMMA4_TOKENS])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(GEMMA4_TOKENS)])
    control = [gguf.TokenType.CONTROL] * len(GEMMA4_TOKENS)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(template)


def write_text_gguf(model, path: Path) -> Path:
    """The language model as conversion/gemma.py Gemma4Model writes it (F32): its keys,
    gguf's gemma4 tensor names, norms as they are, rope_freqs for the global layer's
    proportional RoPE, no output.weight (tied)."""
    config = model.config.text_config
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters[F]["rope_theta"])
    writer.add_float32(
        gguf.Keys.Rope.FREQ_BASE_SWA.format(arch="gemma4"), config.rope_parameters[S]["rope_theta"]
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == S for t in config.layer_types])
    writer.add_shared_kv_layers(0)
    # Gemma 4 Unified's config has no per-layer inputs (the converter writes 0).
    writer.add_embedding_length_per_layer_input(getattr(config, "hidden_size_per_layer_input", 0))
    writer.add_key_length(GLOBAL_DIM)
    writer.add_value_length(GLOBAL_DIM)
    writer.add_key_length_swa(LOCAL_DIM)
    writer.add_value_length_swa(LOCAL_DIM)
    writer.add_rope_dimension_count(GLOBAL_DIM)
    writer.add_uint32(gguf.Keys.Rope.DIMENSION_COUNT_SWA.format(arch="gemma4"), LOCAL_DIM)
    _vocabulary(writer, (TEMPLATES_DIR / TEMPLATE).read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers)
    prefix = "model.language_model."
    for name, tensor in model.state_dict().items():
        if not name.startswith(prefix):
            continue
        name = "model." + name[len(prefix) :]
        data = np.ascontiguousarray(tensor.float().numpy())
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", data)
    dim = GLOBAL_DIM
    turned = int(config.rope_parameters[F]["partial_rotary_factor"] * dim // 2)
    freqs = np.array([1.0] * turned + [1e30] * (dim // 2 - turned), np.float32)
    writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_mmproj(model, path: Path, audio: bool = False, f16: bool = False, extra=None) -> Path:
    """The vision tower and embedder as conversion/gemma.py Gemma4VisionAudioModel writes
    an mmproj GGUF with --outtype f32 (with `f16`, its default: the matrices but the
    position table in F16): clip.* metadata (no pooling size: clip.cpp takes 3,
    as the model has), the patch
    projection as a [hidden, 3, patch, patch] convolution, the position table, the
    clipping bounds as 1-element tensors, gguf's mmproj tensor names. With `audio`, an
    audio encoder's keys and (random) tensors too, as E2B's and E4B's files hold them;
    `extra(writer)` adds more keys and tensors before the file is written."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.ClipVision.PROJECTOR_TYPE, gguf.VisionProjectorType.GEMMA4V)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.IMAGE_SIZE, 224),  # the converter's placeholder
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.rms_norm_eps)
    writer.add_array(key.IMAGE_MEAN, [0.0, 0.0, 0.0])
    writer.add_array(key.IMAGE_STD, [1.0, 1.0, 1.0])
    if audio:
        writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
        writer.add_string(gguf.Keys.ClipAudio.PROJECTOR_TYPE, gguf.VisionProjectorType.GEMMA4A)
        rng = np.random.default_rng(0)
        for name in ("a.conv1d.0.weight", "a.blk.0.attn_q.weight", "mm.a.input_projection.weight"):
            writer.add_tensor(name, rng.standard_normal((8, 8), dtype=np.float32))
    if extra is not None:
        extra(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        data = tensor.detach().float()
        if data.dim() == 0:
            data = data[None]
        name = name.replace("model.vision_tower.encoder.", "vision_model.model.")
        name = name.replace(".linear.weight", ".weight")
        if name.endswith("position_embedding_table"):
            name += ".weight"
        if name.endswith("patch_embedder.input_proj.weight"):
            hidden = data.shape[0]
            data = data.reshape(hidden, PATCH, PATCH, 3).permute(0, 3, 1, 2)
        gguf_name = names.get_name(name, try_suffixes=suffixes)
        data = np.ascontiguousarray(data.numpy())
        if f16 and data.ndim >= 2 and not name.endswith("position_embedding_table.weight"):
            data = data.astype(np.float16)
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""A tiny random Qwen3-VL with its vision tower for the image tests: a Hugging Face folder
as save_pretrained writes it (qwen2_vl_helpers' tokenizer and chat template, a Qwen3-VL
preprocessor_config.json with a smaller least pixel count so that small images stay
small), transformers' Qwen3VLProcessor inputs for it, and its files as llama.cpp's
converter writes them (a qwen3vl text GGUF, an mmproj GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from qwen2_vl_helpers import (
    IMAGE,
    QWEN2_VL_TEMPLATE,
    TEXT,
    VIDEO,
    VISION_END,
    VISION_START,
    save_qwen_vl_dir,
    write_text_gguf,
)

# 8 pairs a head in uneven sections, interleaved: pairs 1 and 4 turn by the height,
# 2 and 5 by the width, 0, 3, 6 and 7 by the time.
QWEN3_TEXT = {
    **TEXT,
    "head_dim": 16,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [3, 2, 3],
        "mrope_interleaved": True,
    },
}
# 3 blocks, the second's features deepstacked; a 4x4 grid of learned positions that every
# image resamples.
QWEN3_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    deepstack_visual_indexes=[1],
    num_position_embeddings=16,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
# Qwen3-VL's preprocessor_config.json, its least pixel count 64x64 (the Hub's is 256x256).
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 4096, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def tiny_qwen3_vl(moe: bool = False, seed: int = 1):
    """A random transformers Qwen3VLForConditionalGeneration (Qwen3VLMoe's with `moe`):
    text hidden 64 in 2 layers, a vision tower of hidden 32 in 3 blocks."""
    import transformers

    prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{prefix}Config")(
        text_config={**QWEN3_TEXT, **(MOE if moe else {})},
        vision_config=QWEN3_VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in name and "visual" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
    return model


# Qwen3.5's language model: 3 Gated DeltaNet layers, then a full-attention one whose RoPE
# turns 8 of 32 features, 4 pairs interleaved: pair 1 by the height, 2 by the width.
QWEN3_5_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=TEXT["vocab_size"],
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)


def tiny_qwen3_5(seed: int = 1):
    """A random transformers Qwen3_5ForConditionalGeneration: QWEN3_5_TEXT, and
    QWEN3_VISION's tower without deepstack (Qwen3.5 has none), slow decays."""
    import transformers

    vision = {k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"}
    config = transformers.Qwen3_5Config(
        text_config=QWEN3_5_TEXT,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, {"lm_head.weight": 0.4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.0)
            elif ".norm" in name and "visual" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
    return model


def save_qwen3_vl_dir(model, path: Path) -> Path:
    """The model's folder with the tokenizer files and PROCESSOR."""
    save_qwen_vl_dir(model, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' Qwen3VLProcessor for the folder (Qwen2VLImageProcessorPil)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(transformers.Qwen3VLProcessor):
        # Images only: its video processor needs torchvision, which the tests go without.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    # The folder's tokenizer as it is (Qwen3.5's model type would pick Qwen3_5Tokenizer).
    return Processor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=QWEN2_VL_TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str):
    """The processor's inputs for one user message of `images` then `question`, with the
    generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return made(text=text, images=images, return_tensors="pt", add_special_tokens=False)


def write_qwen3_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/qwen3vl.py
    Qwen3VLTextModel: arch qwen3vl, Qwen3's tensors, rope.dimension_sections and
    n_deepstack_layers)."""
    deepstack = len(model.config.vision_config.deepstack_visual_indexes)

    def keys(writer) -> None:
        writer.add_uint32("qwen3vl.n_deepstack_layers", deepstack)

    return write_text_gguf(model, path, arch="qwen3vl", model_type="qwen3", keys=keys)


def write_qwen3_mmproj(model, path: Path, qtype=None) -> Path:
    """The vision tower as llama.cpp's converter writes its mmproj (conversion/qwen3vl.py
    Qwen3VLVisionModel, the same names, shapes and keys as the converter gives the tiny
    model): the Conv3d patch weight split into its two frames, each block as v.blk.N.*,
    the merger as v.post_ln, mm.0 and mm.2, the deepstack mergers as v.deepstack.BLOCK.*;
    F32, or with `qtype` the blocks' matrices whose rows are whole blocks of it."""
    import gguf
    import numpy as np

    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, vision.out_hidden_size),
        (key.IMAGE_SIZE, int(vision.num_position_embeddings**0.5 * vision.patch_size)),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.depth),
        (key.Attention.HEAD_COUNT, vision.num_heads),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, [0.5, 0.5, 0.5])
    writer.add_array(key.IMAGE_STD, [0.5, 0.5, 0.5])
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN3VL)
    writer.add_bool(key.USE_GELU, True)
    writer.add_uint32(key.SPATIAL_MERGE_SIZE, vision.spatial_merge_size)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
    deepstack = list(vision.deepstack_visual_indexes)
    writer.add_array(key.IS_DEEPSTACK_LAYERS, [i in deepstack for i in range(vision.depth)])
    layer = {
        "attn.qkv": "attn_qkv",
        "attn.proj": "attn_out",
        "norm1": "ln1",
        "norm2": "ln2",
        "mlp.linear_fc1": "ffn_up",
        "mlp.linear_fc2": "ffn_down",
    }
    merger = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
    stack = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}

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
        elif module == "patch_embed.proj":
            add(f"v.patch_embd.{suffix}", data)
        elif module == "pos_embed":
            add(f"v.position_embd.{suffix}", data)
        elif module.startswith("merger."):
            add(f"{merger[module.split('.')[1]]}.{suffix}", data)
        elif module.startswith("deepstack_merger_list."):
            _, index, part = module.split(".")
            add(f"v.deepstack.{deepstack[int(index)]}.{stack[part]}.{suffix}", data)
        else:
            _, block, rest = module.split(".", 2)
            add(f"v.blk.{block}.{layer[rest]}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

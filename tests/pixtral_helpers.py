"""A tiny random Mistral 3 with its Pixtral vision tower (Mistral3ForConditionalGeneration)
for the image tests: as a Hugging Face folder (stories260K's tokenizer plus Mistral's
instruction and image tokens, a Mistral Small 3.1-shaped chat template without its long
default system prompt, a preprocessor_config.json), and as llama.cpp's converter writes
it, a text GGUF plus an mmproj GGUF (conversion/llava.py LlavaVisionModel: q/k rows
permuted as Llama's)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens.
MISTRAL3_TOKENS = ("[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
IMG, IMG_BREAK, IMG_END = 514, 515, 516
VOCAB = 517
PATCH, MERGE, LONGEST_EDGE = 14, 2, 84
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# mistralai/Mistral-Small-3.1-24B-Instruct-2503's template, its user turns (an image part
# is "[IMG]") without the default system prompt.
MISTRAL3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}
                    {{- block['text'] }}
                {%- elif block['type'] in ['image', 'image_url'] %}
                    {{- '[IMG]' }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""


def tiny_mistral3(seed: int = 0, vision_layers: int = 2):
    """A random transformers Mistral3ForConditionalGeneration: text hidden 64 (two
    layers), Pixtral of hidden 32 (`vision_layers` layers, heads of 16, SiLU) on patches
    of 14. (llama.cpp's converter maps mm.2 only where the tower has 3 layers or more.)"""
    import transformers

    text = dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        model_type="pixtral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=LONGEST_EDGE,
        patch_size=PATCH,
        hidden_act="silu",
    )
    config = transformers.Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_mistral3_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and
    the image processor's settings (PixtralImageProcessor's, as Mistral Small 3.1 has
    them)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(MISTRAL3_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": MISTRAL3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {
        "image_processor_type": "PixtralImageProcessor",
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "patch_size": {"height": PATCH, "width": PATCH},
        "size": {"longest_edge": LONGEST_EDGE},
        "resample": 3,
        "rescale_factor": 1 / 255,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def image_processor():
    """transformers' PixtralImageProcessor (its Pillow backend) as PixtralProcessor runs
    it for Mistral 3: sides in multiples of patch_size * spatial_merge_size."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    unit = PATCH * MERGE
    return PixtralImageProcessorPil(
        patch_size={"height": unit, "width": unit}, size={"longest_edge": LONGEST_EDGE}
    )


def reference_inputs(folder: Path, images: list, text: str, expansions: list[str]):
    """The inputs of transformers' Mistral3ForConditionalGeneration for `text` (its image
    places "[IMG]"), each place replaced by the literal `expansions` in order (what
    PixtralProcessor writes: PixtralProcessor itself needs torchvision), and pixel values
    and image sizes from PixtralImageProcessor."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pieces = text.split("[IMG]")
    assert len(pieces) == len(expansions) + 1
    expanded = pieces[0] + "".join(e + p for e, p in zip(expansions, pieces[1:], strict=True))
    ids = tokenizer(expanded, add_special_tokens=False, return_tensors="pt").input_ids
    pixels = image_processor()(images=images, return_tensors="pt")
    return dict(input_ids=ids, pixel_values=pixels.pixel_values, image_sizes=pixels.image_sizes)


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of reference_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter wrote Mistral3ForConditionalGeneration's
    (arch llama, q/k permuted; helpers.write_gguf, F32; today's writes arch mistral3,
    which loads alike) with stories260K's vocabulary plus MISTRAL3_TOKENS as control
    tokens."""
    config = model.config.text_config.to_dict()
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith((prefix, "lm_head."))
    }

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *MISTRAL3_TOKENS])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(MISTRAL3_TOKENS)])
        control = [gguf.TokenType.CONTROL] * len(MISTRAL3_TOKENS)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_space_prefix(False)  # Mistral 3's is a BPE vocabulary
        writer.add_chat_template(MISTRAL3_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


def permute_heads(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: each head's two RoPE halves interleaved (rows, or a bias)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# HF names after vision_tower. / multi_modal_projector. -> the mmproj's (gguf-py's
# tensor_mapping for MODEL_ARCH.MMPROJ).
_LAYER_NAMES = {
    "attention_norm": "ln1",
    "attention.q_proj": "attn_q",
    "attention.k_proj": "attn_k",
    "attention.v_proj": "attn_v",
    "attention.o_proj": "attn_out",
    "ffn_norm": "ln2",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
}
_NAMES = {
    "vision_tower.patch_conv": "v.patch_embd",
    "vision_tower.ln_pre": "v.pre_ln",
    "multi_modal_projector.norm": "mm.input_norm",
    "multi_modal_projector.patch_merger.merging_layer": "mm.patch_merger",
    "multi_modal_projector.linear_1": "mm.1",
    "multi_modal_projector.linear_2": "mm.2",
}


def write_mmproj(
    model, path: Path, qtype: gguf.GGMLQuantizationType | None = None, f16: bool = True
) -> Path:
    """The vision tower and projector as llama.cpp's converter writes an mmproj GGUF
    from the folder (benchmarks/llama_cpp_pixtral.py checks it against the converter):
    clip.* metadata with projector type pixtral, F32 tensors but the 2-D matrices' F16,
    q/k rows permuted per head; and v.token_embd.img_break, the [IMG_BREAK] row of the
    text embeddings, which clip.cpp requires and older converters wrote (today's leaves
    it out of a Hugging Face folder's mmproj; llmrun reads neither way); with `qtype`, the encoder layers' matrices in that type; without `f16`,
    every tensor in F32 (the converter's --outtype f32)."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.PIXTRAL)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.SPATIAL_MERGE_SIZE, model.config.spatial_merge_size),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, CLIP_MEAN)
    writer.add_array(key.IMAGE_STD, CLIP_STD)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-5)
    writer.add_bool(key.USE_SILU, True)
    heads = vision.num_attention_heads
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "model.language_model.embed_tokens.weight":
            writer.add_tensor("v.token_embd.img_break", np.ascontiguousarray(data[IMG_BREAK]))
            continue
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        module, _, suffix = name[len("model.") :].rpartition(".")
        if module.startswith("vision_tower.transformer.layers."):
            layer, rest = module.split(".", 4)[3:]
            gguf_name = f"v.blk.{layer}.{_LAYER_NAMES[rest]}"
            if rest in ("attention.q_proj", "attention.k_proj"):
                data = permute_heads(data, heads)
            if qtype is not None and data.ndim == 2:
                raw = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
                writer.add_tensor(
                    f"{gguf_name}.{suffix}", raw, raw_shape=raw.shape, raw_dtype=qtype
                )
                continue
        else:
            gguf_name = _NAMES[module]
        if f16 and data.ndim >= 2:
            data = data.astype(np.float16)
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""A tiny random HunYuan-VL (HunYuanVLForConditionalGeneration, HunyuanOCR's architecture)
for the image tests: a Hugging Face folder as save_pretrained writes it (Tencent's vit.*
names; stories260K's tokenizer plus HunyuanOCR's image tokens, a chat template that wraps
each image in them, a preprocessor_config.json), transformers' HunYuanVLProcessor inputs
for it, and its language model as llama.cpp's converter writes it (a hunyuan_vl GGUF).
The transformers reference runs with Tencent's XD-RoPE split (tencents_xd_rope)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import torch
from helpers import STORIES_GGUF, STORIES_HF, gguf_name, randomize

from llmrun.loading.gguf_io import read_gguf

# Ids 512 on, after stories260K's 512 tokens: image start, end, pad, newline.
HY_TOKENS = tuple(f"<｜hy_place▁holder▁no▁{n}｜>" for n in (100, 101, 102, 103))
IMAGE_START, IMAGE_END, IMAGE, NEWLINE = 512, 513, 514, 515
VOCAB = 520
PADS = tuple(f"<pad{i}>" for i in range(VOCAB - 512 - len(HY_TOKENS)))
START, END, PAD = HY_TOKENS[:3]
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}{%- set parts = message['content'] -%}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{- 'User: ' -}}"
    "{%- for content in parts -%}{%- if content['type'] == 'image' -%}"
    "{{ '" + START + PAD + END + "' }}"
    "{%- elif content['type'] == 'text' -%}{{ content['text'] }}{%- endif -%}{%- endfor -%}"
    "{{- '\n' -}}"
    "{%- else -%}{{- 'Assistant: ' -}}"
    "{%- for content in parts -%}{%- if content['type'] == 'text' -%}"
    "{{ content['text'] }}{%- endif -%}{%- endfor -%}{{- '</s>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # 8 pairs a head in uneven sections over four axes (place, column, row, image index).
    rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, alpha=50.0, factor=1.0, mrope_section=[1, 3, 2, 2]
    ),
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>
    tie_word_embeddings=True,
)
# A learned position table of 4x4 patches; 3 layers, the fewest whose projector
# (perceive.proj.2) llama.cpp's converter maps.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_hidden_layers=3,
    out_hidden_size=64,
    patch_size=16,
    max_image_size=64,
)
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 36
PROCESSOR = {
    "image_processor_type": "HunYuanVLImageProcessor",
    "image_mean": [0.5, 0.4, 0.3],
    "image_std": [0.2, 0.25, 0.3],
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    "patch_size": 16,
    "temporal_patch_size": 1,
    "merge_size": 2,
}


def tencents_recomposition(self, freq: torch.Tensor) -> torch.Tensor:
    """HunYuanVLRotaryEmbedding.recomposition_frequencies as Tencent's own modeling code
    does it: the section list repeated (`xdrope_section * 2`), so both halves of a rotated
    pair turn by one axis. transformers 5.25 doubles each size instead (`section * 2`),
    giving a pair's halves to different axes; vLLM and llama.cpp do as Tencent."""
    sections = list(self.mrope_section)
    whole = torch.cat((freq, freq), dim=-1)
    runs = whole.split(sections * 2, dim=-1)
    return torch.cat([run[i % len(sections)] for i, run in enumerate(runs)], dim=-1)


@contextmanager
def tencents_xd_rope() -> Iterator[None]:
    """transformers' HunYuan-VL with tencents_recomposition while the block runs."""
    from transformers.models.hunyuan_vl import modeling_hunyuan_vl

    rotary = modeling_hunyuan_vl.HunYuanVLRotaryEmbedding
    original = rotary.recomposition_frequencies
    rotary.recomposition_frequencies = tencents_recomposition
    try:
        yield
    finally:
        rotary.recomposition_frequencies = original


def tiny_hunyuan_vl(seed: int = 4, sections: list[int] | None = None):
    """A random transformers HunYuanVLForConditionalGeneration: text hidden 64 in 2 layers
    (tied head; XD-RoPE `sections` in place of TEXT's), a vision tower of hidden 32 in 3
    layers; seed 4 gives varied greedy replies (seed 1 repeats one token after the two
    images)."""
    import transformers

    text = TEXT
    if sections is not None:
        rope = {**TEXT["rope_parameters"], "mrope_section": sections}
        text = {**TEXT, "rope_parameters": rope}
    config = transformers.HunYuanVLConfig(
        text_config=text,
        vision_config=VISION,
        image_token_id=IMAGE,
        im_start_id=IMAGE_START,
        im_end_id=IMAGE_END,
        im_newline_id=NEWLINE,
    )
    torch.manual_seed(seed)
    model = transformers.HunYuanVLForConditionalGeneration(config).float().eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "layer_norm1.weight", "layer_norm2.weight")):
                p.normal_(1.0, 0.1)
            if name.endswith(("before_rms.weight", "after_rms.weight")):
                p.normal_(1.0, 0.1)
    return model


def save_hunyuan_vl_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    # Every id of the model's vocabulary a token, as its random head may choose any.
    for i, content in enumerate((*HY_TOKENS, *PADS), start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "pad_token": PADS[0],
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
        "extra_special_tokens": {
            "image_token": PAD,
            "image_start_token": START,
            "image_end_token": END,
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' HunYuanVLProcessor for the folder (HunYuanVLImageProcessorPil with the
    folder's settings)."""
    import transformers
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import (
        HunYuanVLImageProcessorPil,
    )

    skip = ("image_processor_type", "min_pixels", "max_pixels")
    settings = {k: v for k, v in PROCESSOR.items() if k not in skip}
    return transformers.HunYuanVLProcessor(
        image_processor=HunYuanVLImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str):
    """The processor's inputs (input_ids, pixel_values, image_grid_thw, mm_token_type_ids)
    for one user message of `images` then `question`, with the generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return made(text=text, images=images, return_tensors="pt")


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs (with Tencent's XD-RoPE)."""
    with torch.no_grad(), tencents_xd_rope():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/hunyuan.py
    HunyuanVLTextModel: the plain base with rope.scaling.alpha, the sections as
    rope.dimension_sections, q/k norms as attn_q_norm/attn_k_norm, no output matrix when
    tied), F32, with stories260K's vocabulary plus the image tokens and the chat template."""
    text = model.config.text_config
    rope = text.rope_parameters
    writer = gguf.GGUFWriter(str(path), "hunyuan_vl")
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_alpha(rope["alpha"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_rope_scaling_factor(1.0)
    writer.add_rope_dimension_sections(list(rope["mrope_section"]))
    writer.add_chat_template(TEMPLATE)
    state = {
        k.replace("model.language_model.", "model."): v
        for k, v in model.state_dict().items()
        if k.startswith("model.language_model.")
    }
    return _finish(writer, path, state)


def _finish(writer, path: Path, state: dict) -> Path:
    """stories260K's vocabulary with the image tokens as control tokens, then `state`."""
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    extra = len(HY_TOKENS) + len(PADS)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *HY_TOKENS, *PADS])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * extra])
    types = [*meta["tokenizer.ggml.token_type"], *[gguf.TokenType.CONTROL] * extra]
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    names = {"self_attn.query_layernorm": "self_attn.q_norm", "self_attn.key_layernorm": "self_attn.k_norm"}  # fmt: skip
    for name, tensor in state.items():
        for hf_part, ours in names.items():
            name = name.replace(hf_part, ours)
        writer.add_tensor(gguf_name(name), tensor.float().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def flatten_as_tencent(folder) -> None:
    """config.json as Tencent's files write it: the text fields at the top level,
    attention_head_dim for head_dim, rope_scaling {"type": "xdrope", "xdrope_section"}
    and rope_theta; the vision tower's keys under vit."""
    file = folder / "config.json"
    config = json.loads(file.read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    text["attention_head_dim"] = text.pop("head_dim")
    config.update(text, rope_theta=rope["rope_theta"])
    config["rope_scaling"] = {
        "type": "xdrope",
        "alpha": rope["alpha"],
        "factor": rope["factor"],
        "xdrope_section": rope["mrope_section"],
    }
    file.write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights_file = next(folder.glob("*.safetensors"))
    weights = load_file(weights_file)
    renamed = {}
    for key, value in weights.items():
        key = key.replace("model.language_model.", "model.")
        renamed[key.replace("model.vision_tower.", "vit.")] = value
    save_file(renamed, weights_file, metadata={"format": "pt"})

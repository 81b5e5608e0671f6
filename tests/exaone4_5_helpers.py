"""A tiny random EXAONE 4.5 (Exaone4_5_ForConditionalGeneration: Qwen2.5-VL's vision tower
with grouped-query attention, an EXAONE 4 language model) for the image tests: a Hugging
Face folder as save_pretrained writes it (stories260K's tokenizer plus EXAONE's turn and
vision tokens, a chat template that writes each image as <vision><|image_pad|></vision>,
Qwen2VLImageProcessor's preprocessor_config.json), transformers' Exaone4_5_Processor
inputs for it, and its language model as llama.cpp's converter writes it (an exaone4 GGUF
ending with a multi-token-prediction layer; the mmproj is the converter's own, made by
the tests).

The chat template: EXAONE 4.0's turns, and its image place as vLLM, SGLang and llama.cpp's
mtmd (<vision> ... </vision> around an image's tokens) place EXAONE 4.5's images."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, gguf_name, randomize

from llmrun.loading.gguf_io import read_gguf

# Ids 512 on, after stories260K's 512 tokens.
EXAONE_TOKENS = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|endofturn|>",
    "<vision>",
    "</vision>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_START, VISION_END, IMAGE, VIDEO = 516, 517, 518, 519
VOCAB = 520
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' -%}{{- '<vision><|image_pad|></vision>' -}}"
    "{%- elif content['type'] == 'text' -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|endofturn|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)
TEXT = dict(
    model_type="exaone4",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # The 1.2B's form: every layer global and rotated (llama.cpp's hybrid wants 64 layers).
    sliding_window=None,
    sliding_window_pattern=None,
    layer_types=["full_attention"] * 2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
)
# Heads of 8 features (a quarter turned by rows, a quarter by columns), 2 of keys and
# values for 4 of queries; windows of 112 pixels (4x4 merged tokens), the second of the
# three blocks attending to the whole image (llama.cpp's converter maps merger.mlp.2
# only where there are 3 blocks).
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    num_key_value_heads=2,
    out_hidden_size=64,
    fullatt_block_indexes=[1],
    window_size=112,
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def tiny_exaone4_5(seed: int = 0):
    """A random transformers Exaone4_5_ForConditionalGeneration: EXAONE 4 of hidden 64 in
    2 layers, a vision tower of hidden 32 in 3 blocks (VISION)."""
    import transformers

    config = transformers.Exaone4_5_Config(
        text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO
    )
    torch.manual_seed(seed)
    model = transformers.Exaone4_5_ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm1", "norm2", "ln_q"):
                p.normal_(1.0, 0.1)
    return model


def save_exaone4_5_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(EXAONE_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' Exaone4_5_Processor for the folder (Qwen2VLImageProcessorPil, the
    image processor transformers' auto classes give exaone4_5)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(transformers.Exaone4_5_Processor):
        # Images only: its video processor needs torchvision, which the tests go without.
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return Processor(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs (input_ids, pixel_values, image_grid_thw) for one user
    message of `images` then `question`, with the generation prompt."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    messages = [{"role": "user", "content": content}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {k: inputs[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/exaone.py
    Exaone4_5_TextModel: Exaone4Model's keys, tensors unpermuted, the post-sublayer norms
    as post_attention_norm and post_ffw_norm), F32, with stories260K's vocabulary plus
    EXAONE_TOKENS as control tokens and the chat template; one multi-token-prediction
    layer after the two (nextn_predict_layers 1, blk.2 counted in block_count: a copy of
    layer 0 with random weights and the NextN tensors)."""
    text = model.config.text_config
    writer = gguf.GGUFWriter(str(path), "exaone4")
    writer.add_block_count(text.num_hidden_layers + 1)
    writer.add_nextn_predict_layers(1)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_rope_freq_base(text.rope_parameters["rope_theta"])
    writer.add_vocab_size(VOCAB)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *EXAONE_TOKENS])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(EXAONE_TOKENS)])
    control = [gguf.TokenType.CONTROL] * len(EXAONE_TOKENS)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(TEMPLATE)
    prefix = "model.language_model."
    rng = np.random.default_rng(0)
    hidden = text.hidden_size
    for name, tensor in model.state_dict().items():
        if not name.startswith((prefix, "lm_head.")):
            continue
        hf = "model." + name[len(prefix) :] if name.startswith(prefix) else name
        data = tensor.detach().float().numpy()
        writer.add_tensor(gguf_name(hf, "gemma2"), np.ascontiguousarray(data))
        if hf.startswith("model.layers.0."):
            mtp = gguf_name(hf, "gemma2").replace("blk.0.", "blk.2.", 1)
            writer.add_tensor(mtp, rng.normal(0, 0.2, data.shape).astype(np.float32))
    for name, shape in (("eh_proj", (hidden, 2 * hidden)), ("enorm", (hidden,)), ("hnorm", (hidden,))):  # fmt: skip
        writer.add_tensor(f"blk.2.nextn.{name}.weight", rng.normal(0, 0.2, shape).astype(np.float32))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

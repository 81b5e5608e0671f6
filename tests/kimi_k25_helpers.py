"""A tiny random Kimi K2.5 (Kimi_K25ForConditionalGeneration: a DeepSeek-V3 MoE text model
and MoonViT) for the image tests: a Hugging Face folder laid out as the Hub's files are
(its tensor names: vision_tower.encoder.blocks.N.wqkv with the queries' and keys' RoPE
pairs interleaved, mm_projector.proj.0/2, language_model.model.*, one tensor per expert;
stories260K's tokenizer plus Kimi's turn and media tokens, a Kimi K2.5-style chat
template, the image processor's settings), which transformers reads back to the same
model; and the processor's inputs for it, stored in GOLDEN (transformers'
Kimi_K25ImageProcessor needs torchvision, which the suite goes without)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
KIMI_TOKENS = (
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
IMAGE, VIDEO = 520, 521
ARCHITECTURE = "KimiK25ForConditionalGeneration"
VOCAB = 524
# moonshotai/Kimi-K2.5's chat_template.jinja in short: its turns, an image as
# <|media_begin|>image<|media_content|><|media_pad|><|media_end|> then a newline; a
# message's content may be a string (the tests' replies).
KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
TEXT = dict(
    model_type="deepseek_v3",
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
# A learned 4x4 table of positions, resized to every image's grid.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,  # llama.cpp's converter maps mm_projector.proj.linear_2 only where there are 3
    num_attention_heads=2,
    patch_size=14,
    pos_emb_height=4,
    pos_emb_width=4,
    merge_kernel_size=[2, 2],
)
# Kimi_K25ImageProcessor's settings, its limits lowered so that larger images shrink: at
# most 64 patches, 10 a side.
PROCESSOR = {
    "image_processor_type": "Kimi_K25ImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_patches": 64,
    "size": {"max_height": 10, "max_width": 10},
    "patch_size": 14,
    "merge_size": 2,
}


def tiny_kimi_k25(seed: int = 1):
    """A random transformers Kimi_K25ForConditionalGeneration: text hidden 64 in 2 layers
    (one dense, one of 4 routed experts and a shared one) with its own head, a vision
    tower of hidden 32 in 3 layers."""
    import transformers

    config = transformers.Kimi_K25Config(
        text_config=TEXT,
        vision_config=VISION,
        projection_hidden_size=VISION["hidden_size"],
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "layernorm.weight")):
                p.normal_(1.0, 0.1)
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.3)
    return model


def _interleaved(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Query or key rows (or biases) from transformers' rotate_half layout back to the
    Hub's interleaved pairs: row j of a head's first half and row j of its second half are
    the Hub's rows 2j and 2j + 1 (the inverse of transformers' PermuteForRope)."""
    half = rows.shape[0] // heads // 2
    per_head = rows.reshape(heads, 2, half, *rows.shape[1:])
    return per_head.transpose(1, 2).reshape(rows.shape)


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's names and layout."""
    heads = model.config.vision_config.num_attention_heads
    layer_parts = {
        "norm1": "norm0",
        "norm2": "norm1",
        "attn.proj": "wo",
        "mlp.fc1": "mlp.fc0",
        "mlp.fc2": "mlp.fc1",
    }
    state = model.state_dict()
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            rest = key[len("model.language_model.") :]
            head, sep, tail = rest.partition(".mlp.experts.")
            if not sep:
                out["language_model.model." + rest] = value
            elif tail == "gate_up_proj":
                width = value.shape[1] // 2
                for e in range(value.shape[0]):
                    out[f"language_model.model.{head}.mlp.experts.{e}.gate_proj.weight"] = value[
                        e, :width
                    ]
                    out[f"language_model.model.{head}.mlp.experts.{e}.up_proj.weight"] = value[
                        e, width:
                    ]
            else:
                for e in range(value.shape[0]):
                    out[f"language_model.model.{head}.mlp.experts.{e}.down_proj.weight"] = value[e]
        elif key == "lm_head.weight":
            out["language_model.lm_head.weight"] = value
        elif key.startswith("model.mm_projector."):
            rest = key[len("model.mm_projector.") :]
            rest = rest.replace("in_proj.", "proj.0.").replace("out_proj.", "proj.2.")
            out["mm_projector." + rest] = value
        elif key == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = value
        elif key.startswith("model.vision_tower.patch_embed."):
            out[key[len("model.") :]] = value
        elif key.startswith("model.vision_tower.final_layernorm."):
            out["vision_tower.encoder." + key[len("model.vision_tower.") :]] = value
        elif key.startswith("model.vision_tower.layers."):
            _, _, _, layer, rest = key.split(".", 4)
            module, _, suffix = rest.rpartition(".")
            block = f"vision_tower.encoder.blocks.{layer}"
            if module == "attn.q_proj":
                q = value
                k = state[key.replace("q_proj", "k_proj")]
                v = state[key.replace("q_proj", "v_proj")]
                qkv = [_interleaved(q, heads), _interleaved(k, heads), v]
                out[f"{block}.wqkv.{suffix}"] = torch.cat(qkv)
            elif module in ("attn.k_proj", "attn.v_proj"):
                continue
            else:
                out[f"{block}.{layer_parts[module]}.{suffix}"] = value
        else:
            raise AssertionError(f"unexpected tensor {key}")
    return {k: v.contiguous() for k, v in out.items()}


def save_kimi_k25_dir(model, path: Path) -> Path:
    """The model's folder as the Hub lays it out (hub_state_dict), with config.json as
    transformers writes it (but the Hub's architecture name), the tokenizer files and the
    image processor's settings."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]  # the Hub's, which llama.cpp's converter knows
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(hub_state_dict(model), path / "model.safetensors", metadata={"format": "pt"})
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    # Every id of the model's vocabulary a token, as its random head may choose any.
    for i, content in enumerate((*KIMI_TOKENS, "<pad0>", "<pad1>"), start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": KIMI_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of a prompt's inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def reference_inputs(engine, ids: list[int], images: list) -> dict:
    """transformers' inputs for prompt `ids` with (Pillow) `images`, whose pixels are
    llmrun.kimi_k25_images' (the processor's: test_the_prompt_and_pixels_are_the_
    processors holds them to GOLDEN)."""
    from llmrun.kimi_k25_images import pixel_patches

    patches = [pixel_patches(image, engine.vision) for image in images]
    return dict(
        input_ids=torch.tensor([ids]),
        pixel_values=torch.cat([p for p, *_ in patches]).view(-1, 3, 14, 14),
        image_grid_thw=torch.tensor([[1, rows, columns] for _, rows, columns in patches]),
    )


# The processor's inputs for these images (height, width, picture seed), one user message
# of the images then GOLDEN_QUESTION, stored in GOLDEN (processor_record writes them).
GOLDEN = Path(__file__).parent / "data" / "kimi_k25_processor.json"
GOLDEN_QUESTION = "What is in these pictures?"
GOLDEN_CASES = (
    [(40, 60, 1), (100, 150, 2)],  # no resizing, then shrunk to 10 patches a side
    [(300, 20, 3)],  # 64 patches at most
    [(5, 300, 4)],  # a side shorter than a patch
    [(90, 120, 4)],  # test_run_with_an_image_replies_as_transformers's
)


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Two checksums of pixel values: their sum, and their sum weighted by position (which
    moves where values change places)."""
    flat = pixels.double().flatten()
    weights = (torch.arange(flat.numel(), dtype=torch.float64) % 251) + 1
    return [flat.sum().item(), (flat * weights).sum().item()]


def processor(folder: Path):
    """transformers' Kimi_K25Processor for the folder (its image and video processors need
    torchvision)."""
    import transformers
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(**settings),
        video_processor=Kimi_K25VideoProcessor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=KIMI_TEMPLATE,
    )


def processor_record(folder: Path) -> list[dict]:
    """The processor's input ids, grids and pixel checksums (and the first pixel values)
    for GOLDEN_CASES (json.dumps of it is GOLDEN)."""
    from vision_helpers import picture

    from llmrun.images import open_image

    made = processor(folder)
    records = []
    for case in GOLDEN_CASES:
        images = [open_image(picture(h, w, seed)) for h, w, seed in case]
        content = [{"type": "image"}] * len(images)
        content.append({"type": "text", "text": GOLDEN_QUESTION})
        messages = [{"role": "user", "content": content}]
        text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
        records.append({
            "images": [list(c) for c in case],
            "input_ids": inputs["input_ids"][0].tolist(),
            "image_grid_thw": inputs["image_grid_thw"].tolist(),
            "pixel_sums": pixel_sums(inputs["pixel_values"]),
            "first_pixels": inputs["pixel_values"].flatten()[:64].tolist(),
        })  # fmt: skip
    return records


def write_text_gguf(model, path: Path) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/deepseek.py
    DeepseekV2Model: arch deepseek2, MLA as MQA with kv_b_proj split per head, experts
    stacked), F32, with stories260K's vocabulary plus KIMI_TOKENS as control tokens and
    the chat template."""
    from types import SimpleNamespace

    import gguf
    import numpy as np
    from test_deepseek import deepseek2_keys, gguf_tensors

    from llmrun.loading.gguf_io import read_gguf

    text = model.config.text_config
    prefix = "model.language_model."
    state = {
        "model." + k[len(prefix) :]: v
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    state["lm_head.weight"] = model.lm_head.weight.detach()
    tensors = gguf_tensors(SimpleNamespace(config=text, state_dict=lambda: state), split_kv=True)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in deepseek2_keys(text, split_kv=True).items():
        name = key.format(arch=arch)
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_string(name, value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    added = [*KIMI_TOKENS, "<pad0>", "<pad1>"]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *added])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(added)])
    control = [gguf.TokenType.CONTROL] * len(added)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(KIMI_TEMPLATE)
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

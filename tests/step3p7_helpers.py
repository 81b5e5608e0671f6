"""A tiny random Step 3.7 (Step3p7ForConditionalGeneration: text hidden 64 in 2 layers,
a global dense one and a sliding one of experts; vision hidden 32 in 2 layers of 2 heads,
14-pixel patches, a 112-pixel global view of 4 soft tokens, 56-pixel local crops of 1) for
the image tests and the llama.cpp comparison: its folder as save_pretrained writes it
(StepFun's tensor names) with stories260K's tokenizer plus Step 3.7's image tokens, and the
Python that lets llama.cpp's converter take it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

from llmrun import step3p7_images

# Ids 512 on, after stories260K's 512 tokens.
STEP_TOKENS = ("<|im_start|>", "<|im_end|>", *step3p7_images.TOKENS)
IM_PATCH, PATCH_START, PATCH_END, NEWLINE, IM_START, IM_END = range(514, 520)
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<im_patch>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {"size": {"height": 112, "width": 112}, "patch_size": 56, "max_image_size": 400}
# The text_config in StepFun's own names (as the Hub's config.json has it, and llama.cpp's
# converter reads it, the first layer's RoPE base the global layers'): a global dense
# layer rotating half of each head, a sliding layer of experts rotating whole heads.
HUB_TEXT = dict(
    model_type="step3p5",
    vocab_size=520,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_attention_groups=2,
    head_dim=16,
    layer_types=["full_attention", "sliding_attention"],
    sliding_window=8,
    rope_theta=[10000.0, 500.0],
    partial_rotary_factors=[0.5, 1.0],
    moe_layers_enum="1",
    moe_num_experts=4,
    moe_top_k=2,
    moe_intermediate_size=32,
    share_expert_dim=48,
    norm_expert_weight=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    eos_token_id=2,
)


def tiny_model():
    import transformers

    config = transformers.Step3p7Config(
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=112,
            patch_size=14,
            mlp_ratio=2.0,
        ),
        text_config=dict(HUB_TEXT),
        image_token_id=IM_PATCH,
    )
    torch.manual_seed(0)
    model = transformers.Step3p7ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Step 3.5's norms store the w of x * (1 + w).
            if name.startswith("model.language_model.") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


def save_folder(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with stories260K's tokenizer plus
    STEP_TOKENS, TEMPLATE and Step3p7ImageProcessor's settings of PROCESSOR."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(STEP_TOKENS, start=512):
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
    processor = {"image_processor_type": "Step3p7ImageProcessor", **PROCESSOR}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


# conversion/step3.py asserts that the tower is Step3-VL-10B's (1536 wide, 47 layers, 728
# pixels): its code runs as it is, with assertions off, for the tiny tower. It reads
# StepFun's config names, which transformers 5.25's Step3p7Config renames: the converter
# reads config.json itself, as under the transformers its requirements pin (no Step 3.7).
CONVERT_TINY = (
    "base.AutoConfig = None\n"
    "import conversion.step3 as step3\n"
    "source = Path(step3.__file__).read_text()\n"
    "exec(compile(source, step3.__file__, 'exec', optimize=1), step3.__dict__)\n"
)

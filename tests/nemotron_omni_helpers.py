"""A tiny random Nemotron 3 Nano Omni (transformers' NemotronH_Omni_Reasoning_V3: a RADIO
tower, the pixel shuffle and projector, a Parakeet audio tower and its projector, a
Nemotron-H language model of a Mamba-2 and an attention layer) for the image and audio
tests: a Hugging Face folder as save_pretrained writes it (the Hub's tensor names;
stories260K's tokenizer plus ChatML's turn tokens, the image tokens <img>, </img>, <image>
and the audio tokens <so_start>, <so_end>, <so_embedding>; a chat template that writes an
image as <image> and a clip as <so_embedding>; the image processor's settings with a
small patch budget), and transformers' processor inputs.

NemotronH_Omni_Reasoning_V3ImageProcessor needs torchvision, which the suite goes
without: the processor here takes llmrun's pixel patches (llmrun.nemotron_omni_images)
instead, and GOLDEN holds what the real image processor gives for GOLDEN_CASES
(processor_record rewrites it where torchvision is installed; a test checks it there)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
OMNI_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<image>",
    "<so_start>",
    "<so_end>",
    "<so_embedding>",
)
IM_END, IMG, IMG_END, IMAGE, SO_START, SO_END, SOUND = 513, 514, 515, 516, 517, 518, 519
VOCAB = 520
PATCH, MERGE = 8, 2
TEXT = dict(
    model_type="nemotron_h",
    vocab_size=VOCAB,
    hidden_size=64,
    layers_block_type=["mamba", "attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    layer_norm_epsilon=1e-5,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=8,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# A 16 x 16 table of positions (128 / 8), 2 class and 3 register tokens.
VISION = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    patch_size=PATCH,
    max_img_size=128,
    num_cls_tokens=2,
    num_registers=3,
    video_temporal_patch_size=2,
)
# Parakeet of hidden 32 in 2 blocks over 16 mel bins (a kernel of 5), subsampled 8 times
# by convolutions of 8 channels; a projector through 40, with biases.
AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_kernel_size=5,
    subsampling_conv_channels=8,
    num_mel_bins=16,
    projection_hidden_size=40,
    projection_bias=True,
)
# The image processor's defaults but the patches: of 8 pixels, 16 to 96 an image.
PROCESSOR = {
    "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
    "patch_size": PATCH,
    "downsample_ratio": 0.5,
    "min_num_patches": 16,
    "max_num_patches": 96,
    "max_model_len": 16384,
}
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' -%}{{- '<image>\n' -}}"
    "{%- elif content['type'] == 'audio' -%}{{- '<so_embedding>\n' -}}"
    "{%- elif content['type'] == 'text' -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
GOLDEN = Path(__file__).parent / "data" / "nemotron_omni_processor.json"
# Grids of patches: shrunk into the budget (200x130: 12x8), grown into it (20x30: 4x6),
# the image's own (32x48: 4x6, no resize), counted up from 7x9 (56x72: 8x10), a strip
# whose rows are rounded down to stay in the budget (24x300: 2x30, wider than the table).
GOLDEN_CASES = ((200, 130, 1), (20, 30, 2), (32, 48, 3), (56, 72, 4), (24, 300, 5))


def tiny_nemotron_omni(seed: int = 0):
    """A random transformers NemotronH_Omni_Reasoning_V3: Nemotron-H of hidden 64 (a Mamba-2
    layer, an attention layer), RADIO of hidden 32 in 2 blocks on patches of 8, a projector
    through 48, Parakeet (AUDIO); norms and layer scales near 1, the batch norms' running
    statistics drawn."""
    import transformers

    config = transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=TEXT,
        vision_config=VISION,
        audio_config=AUDIO,
        projector_hidden_size=48,
        vision_hidden_size=32,
        image_token_id=IMAGE,
        audio_token_id=SOUND,
    )
    torch.manual_seed(seed)
    model = transformers.NemotronH_Omni_Reasoning_V3(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("lambda1"):
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.normal_(0.0, 0.2)
            elif name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
    return model


def save_nemotron_omni_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(OMNI_TOKENS, start=512):
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


class _Patches:
    """The image processor's part in the processor, given llmrun's pixel patches: GOLDEN
    checks them against the real one's."""

    downsample_ratio = PROCESSOR["downsample_ratio"]

    def __init__(self, vision) -> None:
        self.vision = vision

    def fetch_images(self, images):
        return images

    def __call__(self, images, **kwargs):
        from transformers import BatchFeature

        from llmrun.nemotron_omni_images import pixel_patches

        values, grids = [], []
        for image in images:
            patches, rows, columns = pixel_patches(image, self.vision)
            values.append(patches)
            grids.append([rows, columns])
        return BatchFeature(
            {"pixel_values": torch.cat(values), "image_grid_hw": torch.tensor(grids)}
        )


def processor(folder: Path, vision):
    """transformers' NemotronH_Omni_Reasoning_V3Processor for the folder: its tokenizer,
    the image and audio places expanded by its own code, the pixels llmrun's (_Patches),
    the audio features ParakeetFeatureExtractor's."""
    import transformers

    original = transformers.ProcessorMixin.check_argument_for_proper_class

    def check(self, name: str, arg) -> None:
        if name not in ("image_processor", "video_processor", "feature_extractor"):
            original(self, name, arg)

    with patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", check):
        return transformers.NemotronH_Omni_Reasoning_V3Processor(
            image_processor=_Patches(vision),
            video_processor=None,
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            feature_extractor=transformers.ParakeetFeatureExtractor(
                feature_size=AUDIO["num_mel_bins"]
            ),
            chat_template=TEMPLATE,
        )


def processor_inputs(folder: Path, vision, images: list, question: str, clips=()) -> dict:
    """The processor's inputs (input_ids; pixel_values and image_grid_hw for images,
    input_features and input_features_mask for clips) for one user message of `images`,
    then `clips` (float32 16 kHz samples), then `question`, with the generation prompt."""
    made = processor(folder, vision)
    content = [{"type": "image"}] * len(images) + [{"type": "audio"}] * len(clips)
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    media = {"images": images or None, "audio": list(clips) or None}
    inputs = made(text=text, **media, return_tensors="pt", add_special_tokens=False)
    keys = ("pixel_values", "image_grid_hw") * bool(images)
    keys += ("input_features", "input_features_mask") * bool(clips)
    return {k: inputs[k] for k in ("input_ids", *keys)}


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of `inputs`."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Two checksums of pixel values [patches, values]: their sum, and their sum weighted
    by position (which moves where values change places)."""
    flat = pixels.double().flatten()
    weights = (torch.arange(flat.numel(), dtype=torch.float64) % 251) + 1
    return [flat.sum().item(), (flat * weights).sum().item()]


def real_processor_pixels(height: int, width: int, seed: int) -> dict:
    """The real image processor's (PROCESSOR's settings) output for one picture; needs
    torchvision."""
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
    )
    from vision_helpers import picture

    from llmrun.images import open_image

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = NemotronH_Omni_Reasoning_V3ImageProcessor(**settings)
    return made(images=[open_image(picture(height, width, seed))], return_tensors="pt")


def processor_record() -> list[dict]:
    """The real image processor's grid and pixel checksums for GOLDEN_CASES (json.dumps of
    it is GOLDEN); needs torchvision."""
    records = []
    for height, width, seed in GOLDEN_CASES:
        out = real_processor_pixels(height, width, seed)
        records.append(
            {
                "image": [height, width, seed],
                "image_grid_hw": out["image_grid_hw"][0].tolist(),
                "pixel_sums": pixel_sums(out["pixel_values"]),
            }
        )
    return records

"""A tiny random Muse Glimmer (MuseGlimmerForConditionalGeneration: its windowed ViT,
adapter and projection, and its language model) for the text and image tests: a Hugging
Face folder as save_pretrained writes it (stories260K's tokenizer plus Muse Glimmer's
turn and image tokens, its chat template from llama.cpp's models/templates, a
preprocessor_config.json), transformers' MuseGlimmerProcessor inputs for it, and its
GGUFs as llama.cpp's converter writes them (the converter run on the folder: a
muse-glimmer text GGUF, an mmproj GGUF of projector muse-glimmer).

MuseGlimmerImageProcessor needs torchvision, which the suite goes without: the
processor here takes llmrun's pixel patches (llmrun.muse_glimmer_images) instead, and
GOLDEN holds what the real image processor gives for GOLDEN_CASES (processor_record
rewrites it where torchvision is installed; a test checks it there)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import llama_converter
import torch
from helpers import STORIES_HF, TEMPLATES_DIR, randomize

# Ids 512 on, after stories260K's 512 tokens.
MUSE_TOKENS = (
    "<|start|>",
    "<|message|>",
    "<|eot|>",
    "<|eom|>",
    "<|patch|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|video|>",
)
EOT, PATCH, IMAGE_START, IMAGE_END, VIDEO = 514, 516, 517, 518, 519
VOCAB = 520
PATCH_SIZE, MERGE, SIDE, MAX_TOKENS = 14, 2, 4, 24  # windows of 4 x 4 patches
TEMPLATE = TEMPLATES_DIR / "muse-glimmer.jinja"
# Meta's preprocessor_config.json settings (MuseGlimmerImageProcessor's defaults), with a
# cap of 24 merged tokens an image (the Hub's is 4096).
PROCESSOR = {
    "image_processor_type": "MuseGlimmerImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": PATCH_SIZE,
    "temporal_patch_size": 2,
    "merge_size": MERGE,
    "max_image_tokens": MAX_TOKENS,
    "resample": 1,
}
GOLDEN = Path(__file__).parent / "data" / "muse_glimmer_processor.json"
GOLDEN_CASES = ((50, 90, 1), (90, 50, 2), (200, 130, 3), (28, 28, 4), (500, 37, 5))


def tiny_muse_glimmer(seed: int = 0):
    """A random transformers MuseGlimmerForConditionalGeneration: a language model of
    hidden 64 in two layers (a sliding one of window 4, then a global one without RoPE),
    its logits scaled by 1 (Meta's 0.196 would squeeze them) and capped at 20; a vision
    tower of hidden 32 in two layers (a windowed one, then a global one) on patches of 14,
    its position table 4 x 4 (windows of 4 x 4 patches), merged 2x2. Its centered norms
    get N(0, 0.1) weights (x * (1 + w)), the others randomize()'s."""
    import transformers

    text = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        sliding_window=4,
        output_multiplier=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,  # stories260K's </s>: the greedy tests want 8 tokens
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=PATCH_SIZE,
        pos_emb_height=SIDE,
        pos_emb_width=SIDE,
        merge_size=MERGE,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    config = transformers.MuseGlimmerConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=PATCH,
        video_token_id=VIDEO,
        out_hidden_size=32 * MERGE * MERGE,
        projector_hidden_size=48,
    )
    torch.manual_seed(seed)
    model = transformers.MuseGlimmerForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.language_model.layers.") and name.endswith(
                "layernorm.weight"
            ):
                p.normal_(0.0, 0.1)
    return model


def save_muse_glimmer_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files (the
    chat template llama.cpp keeps as models/templates/muse-glimmer.jinja) and the image
    processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(MUSE_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "<|eot|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE.read_text(),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


class _Patches:
    """MuseGlimmerImageProcessor's part in the processor, given llmrun's pixel patches
    (the temporal slab repeated, as the processor lays them out): GOLDEN checks them
    against the real one's."""

    merge_size = MERGE

    def __init__(self, vision) -> None:
        self.vision = vision

    def fetch_images(self, images):
        return images

    def __call__(self, images, **kwargs):
        from transformers import BatchFeature

        from llmrun.muse_glimmer_images import pixel_patches

        values, grids = [], []
        for image in images:
            patches, grid_h, grid_w = pixel_patches(image, self.vision)
            values.append(torch.cat([patches, patches], dim=-1))
            grids.append([1, grid_h, grid_w])
        return BatchFeature(
            {"pixel_values": torch.cat(values), "image_grid_thw": torch.tensor(grids)}
        )


def processor(folder: Path, vision):
    """transformers' MuseGlimmerProcessor for the folder: its tokenizer and chat template,
    the image places expanded by its own code, the pixels llmrun's (_Patches)."""
    import transformers

    original = transformers.ProcessorMixin.check_argument_for_proper_class

    def check(self, name: str, arg) -> None:
        if name not in ("image_processor", "video_processor"):  # the stand-in, and no video
            original(self, name, arg)

    with patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", check):
        return transformers.MuseGlimmerProcessor(
            image_processor=_Patches(vision),
            video_processor=None,
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            chat_template=TEMPLATE.read_text(),
        )


def processor_inputs(folder: Path, vision, images: list, question: str) -> dict:
    """The processor's inputs (input_ids, pixel_values, image_grid_thw) for one user
    message of `images` then `question`, with the generation prompt."""
    made = processor(folder, vision)
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = made(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {k: inputs[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of `inputs`."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def folder_of(tmp_path_factory) -> Path:
    """tiny_muse_glimmer()'s folder (save_muse_glimmer_dir), written once a test session."""
    folder = tmp_path_factory.getbasetemp() / "muse_glimmer" / "folder"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        save_muse_glimmer_dir(tiny_muse_glimmer(), folder)
    return folder


def converted(tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's GGUFs of folder_of's folder as its converter writes them: the text
    model in F32, F16 and Q8_0 ("f32", "f16", "q8_0"), the mmproj in F32 ("mmproj");
    converted once a test session."""
    folder = folder_of(tmp_path_factory)
    files = {t: folder.parent / f"text-{t}.gguf" for t in ("f32", "f16", "q8_0")}
    files["mmproj"] = folder.parent / "mmproj-f32.gguf"
    if not all(path.is_file() for path in files.values()):
        flags = {t: f"--outtype {t}" for t in ("f32", "f16", "q8_0")}
        flags["mmproj"] = "--outtype f32 --mmproj"
        llama_converter.run_converter(folder, {files[t]: flags[t] for t in files})
    return files


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Two checksums of pixel values [patches, values]: their sum, and their sum weighted
    by position (which moves where values change places)."""
    flat = pixels.double().flatten()
    weights = (torch.arange(flat.numel(), dtype=torch.float64) % 251) + 1
    return [flat.sum().item(), (flat * weights).sum().item()]


def processor_record() -> list[dict]:
    """MuseGlimmerImageProcessor's (with PROCESSOR's settings) grid and pixel checksums for
    GOLDEN_CASES (json.dumps of it is GOLDEN); needs torchvision."""
    from transformers.models.muse_glimmer.image_processing_muse_glimmer import (
        MuseGlimmerImageProcessor,
    )
    from vision_helpers import picture

    from llmrun.images import open_image

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = MuseGlimmerImageProcessor(**settings)
    records = []
    for height, width, seed in GOLDEN_CASES:
        out = made(images=[open_image(picture(height, width, seed))], return_tensors="pt")
        records.append(
            {
                "image": [height, width, seed],
                "image_grid_thw": out["image_grid_thw"][0].tolist(),
                "pixel_sums": pixel_sums(out["pixel_values"]),
            }
        )
    return records

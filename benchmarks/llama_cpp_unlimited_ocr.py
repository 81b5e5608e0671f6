"""llama.cpp itself answers about images with the Unlimited-OCR files the image tests use,
as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_unlimited_ocr.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random UnlimitedOcrForConditionalGeneration
(tests/unlimited_ocr_helpers.py), with text and mmproj GGUFs laid out as llama.cpp's
converter writes them. This is the llama.cpp half: the model's checkpoint under DeepSeek's
own config.json (architecture UnlimitedOCRForCausalLM, vision_config's width.sam_vit_b and
width.clip-l-14-224, language_config, sliding_window), which the converter reads, goes
through llama.cpp's converter (SRC/convert_hf_to_gguf.py --mmproj --outtype f32), whose
tower must equal the tests' mmproj's tensor for tensor; the text GGUF is the tests' (arch
deepseek2-ocr). `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no
flash attention, a 4096-token context) answers /completion with the image as
multimodal_data at the template's "<image>\\n". Both engines resize images with their own
bicubic filters (llama.cpp's is not Pillow's), so their pixels differ slightly; an image
over 640 pixels takes crops, whose CLIP positions llama.cpp resizes without antialiasing.
Per image: the 8 greedy tokens of each engine, how many agree, and the largest difference
of the chosen tokens' log-probabilities. Results go to --out
(benchmarks/out/llama_cpp_unlimited_ocr.json).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from deepseek_ocr2_helpers import write_text_gguf  # noqa: E402
from llama_cpp_qwen_vision import compare_family  # noqa: E402
from llama_server_compare import arguments  # noqa: E402
from unlimited_ocr_helpers import (  # noqa: E402
    SLIDING_WINDOW,
    save_unlimited_ocr_dir,
    tiny_unlimited_ocr,
    write_mmproj,
)

OUT = ROOT / "benchmarks" / "out"
PLACE = "<image>\n"
# (height, width, seed): the whole view only (273 tokens), then 2 x 2 and 3 x 2 crops.
IMAGES = [(480, 360, 1), (900, 900, 2), (800, 1200, 3)]


def deepseek_folder(model, folder: Path, out: Path) -> Path:
    """The folder's checkpoint under the config.json DeepSeek's own files have, which
    llama.cpp's converter reads (DeepseekOCRVisionModel.get_vision_config,
    DeepseekV2Model's language_config and sliding_window)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ):
        shutil.copy(folder / name, out / name)
    vision = model.config.vision_config
    sam, clip = vision.sam_config, vision.encoder_config
    text = model.config.text_config.to_dict()
    language = {
        k: v
        for k, v in text.items()
        if k not in ("model_type", "mlp_layer_types", "layer_types", "rope_parameters")
    }
    language.update(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        first_k_dense_replace=text["mlp_layer_types"].count("dense"),
        qk_rope_head_dim=0,
        use_mla=False,
        rope_theta=text["rope_parameters"]["rope_theta"],
    )
    config = {
        "architectures": ["UnlimitedOCRForCausalLM"],
        "model_type": "deepseek_vl_v2",
        "language_config": language,
        "sliding_window": SLIDING_WINDOW,
        "vision_config": {
            "image_size": sam.image_size,
            "width": {
                "sam_vit_b": {
                    "layers": sam.num_hidden_layers,
                    "width": sam.hidden_size,
                    "heads": sam.num_attention_heads,
                    "downsample_channels": list(sam.downsample_channels),
                    "global_attn_indexes": list(sam.global_attn_indexes),
                },
                "clip-l-14-224": {
                    "layers": clip.num_hidden_layers,
                    "width": clip.hidden_size,
                    "heads": clip.num_attention_heads,
                    "image_size": clip.image_size,
                    "patch_size": clip.patch_size,
                },
            },
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_unlimited_ocr.json")
    from llmrun.loading.unlimited_ocr_vision import from_mmproj

    work = OUT / "unlimited_ocr"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_unlimited_ocr()
    folder = save_unlimited_ocr_dir(model, work / "hf")
    tests_mmproj = write_mmproj(model, folder, work / "mmproj-tests.gguf", f16=False)
    text = write_text_gguf(model, folder, work / "model.gguf", SLIDING_WINDOW)
    deepseek = deepseek_folder(model, folder, work / "deepseek")
    results = compare_family(
        args, deepseek, tests_mmproj, text, from_mmproj, IMAGES, PLACE, ("-c", "4096")
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

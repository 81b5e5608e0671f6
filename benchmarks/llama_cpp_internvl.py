"""llama.cpp's converter and llama-server against llmrun on the tiny InternVL model the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_internvl.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random InternVLForConditionalGeneration
(tests/internvl_helpers.py), reading an mmproj GGUF that the tests lay out themselves
(write_mmproj) as the converter lays out an original InternVL repo's (InternVLChatModel;
the converter does not take the "-hf" layout). Here, first, the same weights (a tower of 4
layers: the converter maps mlp1.3 only where there are 4 or more) are written as such a
repo (config.json with llm_config and vision_config InternVisionModel,
vision_model.* and mlp1.* tensors, each qkv fused) and llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32) turns it into an mmproj GGUF: its
metadata and tensors are compared with write_mmproj's, name by name, bit for bit, and
llmrun loads it. Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV
cache, no flash attention) answers /completion with an image as multimodal_data, and
llmrun gets the same prompt. The images' sizes are ones that both engines cut into the
same tiles (a 64x64 image is one tile; 128x64, 64x128 and 128x128 are 2, 2 and 4 tiles
and a thumbnail; llama.cpp picks other grids for other shapes and resizes the thumbnail
with its own bicubic filter, not Pillow's). Per image: the 8 greedy tokens of each
engine, how many agree, the largest difference of the chosen tokens' log-probabilities;
and the same for llmrun with llama.cpp's order of the tower's input (clip.cpp's
clip_graph_internvl appends the class token after the patches, then adds the position
table in order: each patch takes its predecessor's row, the class token the last one;
transformers and the original InternViT put the class token first), which shows that the
rest of the pipeline agrees. Results go to --out (benchmarks/out/llama_cpp_internvl.json).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from internvl_helpers import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_TILES,
    original_layout,
    tiny_internvl,
    write_mmproj,
    write_text_gguf,
)
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    convert,
    converter_agreement,
    greedy_completion,
    llmrun_greedy,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is in this picture?"
TOKENS = 8
# (height, width, seed): sizes both engines tile alike.
IMAGES = ((64, 64, 1), (64, 128, 2), (128, 64, 3), (128, 128, 4), (64, 64, 5))


def save_original_repo(model, path: Path) -> Path:
    """The model's vision tower and projector as an original InternVL repo holds them,
    with the config.json and preprocessor_config.json the converter reads."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    vision = model.config.vision_config
    text = model.config.text_config.to_dict()
    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "downsample_ratio": model.config.downsample_ratio,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": MAX_TILES,
        "llm_config": {**text, "architectures": ["Qwen2ForCausalLM"]},
        "vision_config": {
            "architectures": ["InternVisionModel"],
            "model_type": "intern_vit_6b",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_hidden_layers,
            "num_attention_heads": vision.num_attention_heads,
            "image_size": vision.image_size[0],
            "patch_size": vision.patch_size[0],
            "layer_norm_eps": vision.layer_norm_eps,
            "hidden_act": vision.hidden_act,
            "qkv_bias": vision.attention_bias,
            "qk_normalization": vision.use_qk_norm,
            "norm_type": vision.norm_type,
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD})
    )
    save_file(original_layout(model), str(path / "model.safetensors"))
    return path


@contextmanager
def llama_cpp_positions():
    """llmrun's tower with clip.cpp's order: the class token after the patches when the
    position table is added (then moved first again, where the encoder drops it)."""
    import torch

    from llmrun.models import internvl_vision

    def embeddings(self, pixels):
        patches = self.patch_embeddings.projection(pixels).flatten(2).mT
        x = torch.cat([patches, self.cls_token.expand(len(pixels), -1, -1)], dim=1)
        x = x + self.position_embeddings
        return torch.cat([x[:, -1:], x[:, :-1]], dim=1)

    original = internvl_vision.Embeddings.forward
    internvl_vision.Embeddings.forward = embeddings
    try:
        yield
    finally:
        internvl_vision.Embeddings.forward = original


def ours(engine, text: str, image, answer: dict) -> tuple[int, dict]:
    """llmrun's prompt length and greedy tokens for a prompt with one image, how many
    agree with llama.cpp's and the largest difference of the agreeing tokens'
    log-probabilities."""
    ids, images = engine.image_prompt(text, [image])
    record = agreement(*llmrun_greedy(engine, ids, TOKENS, images), answer)
    del record["llama_cpp"]  # once per image, beside both of llmrun's
    return len(ids), record


def compare(engine, server: LlamaServer, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun (as transformers, and with llama.cpp's position order) and
    of llama.cpp on one image."""
    from llmrun.images import open_image

    data = picture(height, width, seed)
    text = engine.prompt_text(QUESTION, images=1)
    prompt = text.replace("<IMG_CONTEXT>", server.media_marker)
    answer = greedy_completion(server, prompt, [data], TOKENS)
    length, as_transformers = ours(engine, text, open_image(data), answer)
    with llama_cpp_positions():
        _, shifted = ours(engine, text, open_image(data), answer)
    return dict(
        image=f"{width}x{height} seed {seed}",
        llama_cpp=answer["tokens"],
        as_transformers=as_transformers,
        with_llama_cpp_positions=shifted,
        prompt_tokens_llmrun=length,
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_internvl.json")
    from llmrun import api

    work = OUT / "internvl"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_internvl(vision_layers=4)
    repo = save_original_repo(model, work / "original")
    converted = work / "mmproj-converter.gguf"
    convert(args.converter, repo, converted, "--mmproj", "--outtype", "f32")
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    layout = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(layout)}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)  # llmrun reads the converter's
    results = []
    with LlamaServer(args.llama_cpp, text, work / "server.log", mmproj=converted) as server:
        for height, width, seed in IMAGES:
            record = compare(engine, server, height, width, seed)
            results.append(record)
            line = [f"{record['image']:>16}:"]
            for kind in ("as_transformers", "with_llama_cpp_positions"):
                got = record[kind]
                diff = got["max_abs_logprob_diff"]
                diff = "-" if diff is None else f"{diff:.2e}"
                line.append(f"{kind} {got['tokens_agreeing']}/{TOKENS} agree (|dlogprob| {diff});")
            line.append(
                f"prompt tokens {record['prompt_tokens_llmrun']} / "
                f"{record['prompt_tokens_llama_cpp']}"
            )
            print(" ".join(line))
    args.out.write_text(json.dumps(dict(converter=layout, greedy=results), indent=1))


if __name__ == "__main__":
    main()

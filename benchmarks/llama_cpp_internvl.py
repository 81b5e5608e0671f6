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

import argparse
import json
import subprocess
import sys
import urllib.request
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
from llama_cpp_pixtral import EXACT, converter_agreement  # noqa: E402
from tokenizer_fuzz import Server  # noqa: E402
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


def greedy(engine, text: str, image) -> tuple[list[int], list]:
    """llmrun's greedy tokens and their log-probabilities for a prompt with one image."""
    from llmrun.sampling import SamplingParams

    ids, images = engine.image_prompt(text, [image])
    stream = engine.generate(
        ids, SamplingParams(temperature=0.0), TOKENS, logprobs=0, images=images
    )
    chosen = [lp for r in stream for lp in r.logprobs]
    return ids, chosen


def agreement(chosen: list, answer: dict) -> dict:
    """How many of llama.cpp's greedy tokens llmrun's agree with, and the largest
    difference of the agreeing tokens' log-probabilities."""
    ours, theirs = [lp.token for lp in chosen], answer["tokens"]
    pairs = zip(ours, theirs, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
    # The server reports no probability for a token whose text is an incomplete UTF-8
    # character: its entries are matched to the agreeing tokens by id, in order.
    diffs, cursor = [], 0
    for entry in answer["completion_probabilities"]:
        while cursor < agree and ours[cursor] != entry["id"]:
            cursor += 1
        if cursor == agree:
            break
        diffs.append(abs(chosen[cursor].logprob - entry["logprob"]))
        cursor += 1
    return dict(llmrun=ours, tokens_agreeing=agree, max_abs_logprob_diff=max(diffs, default=None))


def compare(engine, server, marker: str, height: int, width: int, seed: int) -> dict:
    """Greedy tokens of llmrun (as transformers, and with llama.cpp's position order) and
    of llama.cpp on one image."""
    import base64

    from llmrun.images import open_image

    data = picture(height, width, seed)
    text = engine.prompt_text(QUESTION, images=1)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": text.replace("<IMG_CONTEXT>", marker),
                "multimodal_data": [base64.b64encode(data).decode()],
            },
            "n_predict": TOKENS,
            "temperature": 0,
            "top_k": 1,
            "n_probs": 1,
            "return_tokens": True,
            "cache_prompt": False,
        },
    )
    ids, chosen = greedy(engine, text, open_image(data))
    with llama_cpp_positions():
        _, shifted = greedy(engine, text, open_image(data))
    return dict(
        image=f"{width}x{height} seed {seed}",
        llama_cpp=answer["tokens"],
        as_transformers=agreement(chosen, answer),
        with_llama_cpp_positions=agreement(shifted, answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_internvl.json")
    args = parser.parse_args()
    from llmrun import api

    work = OUT / "internvl"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_internvl(vision_layers=4)
    repo = save_original_repo(model, work / "original")
    converted = work / "mmproj-converter.gguf"
    converter = [sys.executable, str(args.converter / "convert_hf_to_gguf.py"), str(repo)]
    subprocess.run(
        [*converter, "--mmproj", "--outtype", "f32", "--outfile", str(converted)],
        check=True,
        capture_output=True,
    )
    mmproj = write_mmproj(model, work / "mmproj.gguf")
    agreement = converter_agreement(converted, mmproj)
    print(f"converter vs write_mmproj: {json.dumps(agreement)}")
    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=converted)  # llmrun reads the converter's
    server = Server(
        args.llama_cpp / "llama-server",
        text,
        work / "server.log",
        ("--mmproj", str(converted), *EXACT),
    )
    results = []
    try:
        url = f"http://127.0.0.1:{server.port}/props"
        with urllib.request.urlopen(url, timeout=10) as response:
            marker = json.loads(response.read())["media_marker"]
        for height, width, seed in IMAGES:
            record = compare(engine, server, marker, height, width, seed)
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
    finally:
        server.close()
    args.out.write_text(json.dumps(dict(converter=agreement, greedy=results), indent=1))


if __name__ == "__main__":
    main()

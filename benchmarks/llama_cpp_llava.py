"""llama.cpp's LLaVA mmproj script against the tests' layout, on the tiny LLaVA models the
image tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_llava.py --converter SRC [--out FILE]

The tests hold llmrun to transformers on tiny random LlavaForConditionalGeneration and
LlavaNextForConditionalGeneration models (tests/llava_helpers.py), reading an mmproj GGUF
that the tests lay out themselves (write_mmproj). llama.cpp's convert_hf_to_gguf.py does
not take LLaVA's -hf folders for the mmproj; its LLaVA script does
(SRC/tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py --clip-model-is-vision
--llava-projector, the route of its docs/multimodal/llava.md for LLaVA 1.6): here it turns
each model's CLIP tower (a folder as transformers saves a CLIPVisionModel, with LLaVA-NeXT's
pinpoints in its config, as llava-1.6's config_vit.json has them) and its projector
(llava_surgery_v2.py's names: model.mm_projector.0/2, model.image_newline) into an mmproj,
compared with write_mmproj's name by name, bit for bit. The script was written for
transformers 4, whose CLIPVisionModel holds a vision_model: it runs under a stand-in that
gives the transformers 5 tower that level back. Then llmrun loads the script's file and
its image features are compared with transformers'.

With --llama-cpp DIR, `DIR/llama-server -m text.gguf --mmproj <the script's LLaVA 1.5
mmproj>` (f32 KV cache, no flash attention) answers /completion for 32x32 images (no
resizing in either engine), and llmrun gets the same prompt: its greedy tokens as
transformers computes, and with clip.cpp's order put into its tower (llama_cpp_order: the
class token after the patches, rows 1..n of that as features, one layer fewer than the
file holds), which shows that order is the whole difference. Results go to --out
(benchmarks/out/llama_cpp_llava.json).
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreeing,
    converter_agreement,
    greedy_completion,
    llmrun_greedy,
)
from llava_helpers import (  # noqa: E402
    image_features,
    processor_inputs,
    save_llava_dir,
    tiny_llava,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SCRIPT = Path("tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py")
QUESTION = "What is in this picture?"
TOKENS = 8


def tower_folder(model, path: Path) -> Path:
    """The CLIP tower as a CLIPVisionModel folder and the projector as llava.projector."""
    path.mkdir(parents=True, exist_ok=True)
    model.model.vision_tower.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    if model.config.model_type == "llava_next":
        config.update(
            image_grid_pinpoints=model.config.image_grid_pinpoints,
            image_aspect_ratio="anyres",
            mm_patch_merge_type="spatial_unpad",
        )
    (path / "config.json").write_text(json.dumps(config))
    projector = model.model.multi_modal_projector
    tensors = {
        f"model.mm_projector.{index}.{kind}": getattr(layer, kind).detach().clone()
        for index, layer in ((0, projector.linear_1), (2, projector.linear_2))
        for kind in ("weight", "bias")
    }
    if model.config.model_type == "llava_next":
        tensors["model.image_newline"] = model.model.image_newline.detach().clone()
    torch.save(tensors, path / "llava.projector")
    return path


def run_script(converter: Path, folder: Path, out: Path) -> Path:
    """The script on the folder, its CLIPVisionModel wrapped as transformers 4's."""
    import transformers

    class Transformers4Tower(torch.nn.Module):
        def __init__(self, tower) -> None:
            super().__init__()
            self.vision_model = tower

        @classmethod
        def from_pretrained(cls, path):
            return cls(clip_vision_model.from_pretrained(path))

    clip_vision_model = transformers.CLIPVisionModel
    arguments = ["-m", str(folder), "--llava-projector", str(folder / "llava.projector")]
    arguments += ["--output-dir", str(out), "--clip-model-is-vision", "--use-f32"]
    saved = sys.argv
    transformers.CLIPVisionModel = Transformers4Tower
    sys.argv = [str(converter / SCRIPT), *arguments]
    try:
        runpy.run_path(str(converter / SCRIPT), run_name="__main__")
    finally:
        transformers.CLIPVisionModel, sys.argv = clip_vision_model, saved
    return out / "mmproj-model-f32.gguf"


@contextmanager
def llama_cpp_order():
    """llmrun's LLaVA tower as clip.cpp's graph runs it (models/llava.cpp): the class token
    after the patches, the layers but the last, that sequence's rows 1..n as features."""
    import torch

    from llmrun.models import llava_vision

    def forward(self, tiles):
        tower = self.vision_tower.vision_model
        embeddings = tower.embeddings
        patches = embeddings.patch_embedding(tiles).flatten(2).mT
        classes = embeddings.class_embedding.expand(len(tiles), 1, -1)
        x = torch.cat([patches, classes], dim=1) + embeddings.position_embedding.weight
        x = tower.pre_layrnorm(x)
        for layer in tower.encoder.layers[:-1]:
            x = layer(x)
        return self.multi_modal_projector(x[:, 1:])

    original = llava_vision.ImageEncoder.forward
    llava_vision.ImageEncoder.forward = forward
    try:
        yield
    finally:
        llava_vision.ImageEncoder.forward = original


def server_agreement(llama_cpp: Path, model, mmproj: Path, work: Path) -> list[dict]:
    """llama-server's greedy tokens against llmrun's, both orders, on 32x32 images."""
    from llmrun import api
    from llmrun.images import open_image

    text = write_text_gguf(model, work / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    results = []
    with LlamaServer(llama_cpp, text, work / "server.log", mmproj=mmproj) as server:
        prompt = engine.prompt_text(QUESTION, images=1)
        marked = prompt.replace("<image>", server.media_marker)
        for seed in (1, 2, 3):
            data = picture(32, 32, seed)
            theirs = greedy_completion(server, marked, [data], TOKENS, n_probs=0)
            ids, images = engine.image_prompt(prompt, [open_image(data)])
            ours, _ = llmrun_greedy(engine, ids, TOKENS, images)
            with llama_cpp_order():
                _, reordered_images = engine.image_prompt(prompt, [open_image(data)])
                reordered, _ = llmrun_greedy(engine, ids, TOKENS, reordered_images)
            results.append(
                dict(
                    seed=seed,
                    llama_cpp=theirs["tokens"],
                    as_transformers=ours,
                    with_llama_cpp_order=reordered,
                    agree_as_transformers=agreeing(ours, theirs["tokens"]),
                    agree_with_llama_cpp_order=agreeing(reordered, theirs["tokens"]),
                    prompt_tokens=[len(ids), theirs["tokens_evaluated"]],
                )
            )
            print(f"llama-server, 32x32 seed {seed}: {json.dumps(results[-1])}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--llama-cpp", type=Path, help="its bin/ folder, for llama-server")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_llava.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmrun-llava-bench"))
    args = parser.parse_args()
    from llmrun.images import open_image
    from llmrun.llava_images import encode
    from llmrun.loading.llava_vision import from_mmproj

    results = {}
    images = [open_image(picture(50, 90, 1)), open_image(picture(100, 40, 2))]
    for kind in ("llava", "llava_next"):
        model = tiny_llava(next_=kind == "llava_next")
        work = args.work / kind
        converted = run_script(args.converter, tower_folder(model, work / "vit"), work / "out")
        agreement = converter_agreement(converted, write_mmproj(model, work / "mmproj.gguf"))
        # LLaVA 1.5's mmproj images are padded square: the reference's processor too.
        folder = save_llava_dir(model, work / "hf", do_pad=True)
        expected = image_features(model, processor_inputs(folder, images, "What is it?"))
        features = torch.cat(encode(from_mmproj(converted, 64), images))
        difference = (features - expected).abs().max().item()
        results[kind] = dict(converter=agreement, features_max_abs_difference=difference)
        print(f"{kind}: script vs write_mmproj {json.dumps(agreement)}")
        print(f"{kind}: features from the script's mmproj vs transformers' {difference:.2e}")
        if args.llama_cpp is not None and kind == "llava":
            results["llama_server"] = server_agreement(args.llama_cpp, model, converted, work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""llama.cpp's converter and llama-server against llmrun on the Qwen3-Omni files the image
and audio tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_qwen3_omni.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Qwen3-Omni thinker
(tests/qwen3_omni_helpers.py), reading an mmproj GGUF they lay out themselves
(write_mmproj). Here the thinker's folder, laid out as the Hub's
Qwen3OmniMoeForConditionalGeneration (thinker_config, thinker.* weights, talker and
code2wav weights beside them), goes through llama.cpp's own converter
(SRC/convert_hf_to_gguf.py --mmproj --outtype f32). Its Qwen3OmniMmprojModel renames
thinker.visual.* to model.visual.*, which its tensor map lacks (it stops at "Can not map
tensor 'model.visual.blocks.0.attn.proj.bias'"), so it runs with that one rename made
visual.* instead. Its clip.* metadata and tensors are compared with write_mmproj's, name
by name, bit for bit; llmrun loads the converter's file, and its image and audio
embeddings and logits are compared with transformers' on a tower without deepstack (the
audio convolutions and conv_out rounded to F16 as the converter stores them, the Hub's
800-frame attention windows, which the file does not hold). (The converter cannot write this tiny model's
text GGUF: stories260K's tokenizer is no pre-tokenizer it knows; the tests' text GGUF is
the qwen3vlmoe layout, which tests/models/test_qwen3_vl.py checks.)

mtmd refuses an mmproj whose vision embeddings (with the deepstack features) are wider
than its audio ones, which the converter writes for any Qwen3-Omni (the Hub's tower has 3
deepstack layers): that is tried and recorded. Then, on a tower without deepstack,
`DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash attention)
answers /completion for an image and for a 2.5-second clip (shorter than a window, so the
attention is the same). Per input: the 8 greedy tokens of each engine, how many agree, and
the prompt sizes. Results go to --out (benchmarks/out/llama_cpp_qwen3_omni.json).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_cpp_qwen25_omni import TOKENS, compare, media_parity  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    arguments,
    clip_layout,
    describe,
)
from qwen3_omni_helpers import (  # noqa: E402
    AUDIO,
    IMAGE,
    hub_layout,
    processor_inputs,
    save_qwen3_omni_dir,
    tiny_qwen3_omni,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture  # noqa: E402
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACES = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
}
IMAGE_BYTES = picture(256, 320, 1)  # 8x10 merged tokens, at least Qwen3-VL's least pixels
CLIP_BYTES = wav_bytes(chirp(2.5, 16000, seed=1), 16000)
# The converter, its Qwen3-Omni vision names made those its tensor map has.
_CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.qwen3vl as q
rename = q.Qwen3OmniMmprojModel.modify_tensors
def modify_tensors(self, data, name, bid):
    yield from rename(self, data, name.replace("thinker.visual.", "visual."), bid)
q.Qwen3OmniMmprojModel.modify_tensors = modify_tensors
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_mmproj(converter: Path, hub: Path, out: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py")}
    flags = ("--mmproj", "--outtype", "f32", "--outfile", str(out))
    command = [sys.executable, "-c", _CONVERT, str(converter), str(hub), *flags]
    subprocess.run(command, check=True, env=env, capture_output=True)
    return out


def parity(model, folder: Path, engine) -> dict:
    """llmrun on the converter's mmproj against transformers, for one image and one clip."""
    rounded = copy.deepcopy(model)
    tower = rounded.model.audio_tower
    for layer in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
        layer.weight.data = layer.weight.data.half().float()
    tower.n_window_infer = 800
    media = {"image": (IMAGE, IMAGE_BYTES), "audio": (AUDIO, CLIP_BYTES)}
    return media_parity(rounded, folder, engine, processor_inputs, media)


def files(model, tmp: Path, converter: Path) -> tuple[Path, Path, Path, dict]:
    """The thinker's folder, the converter's mmproj, the tests' text GGUF, and where the
    converter's mmproj and write_mmproj's differ."""
    tmp.mkdir()
    folder = save_qwen3_omni_dir(model, tmp / "thinker")
    hub = hub_layout(folder, tmp / "hub")
    theirs = convert_mmproj(converter, hub, tmp / "converted-mmproj.gguf")
    layout = clip_layout(theirs, write_mmproj(model, tmp / "ours-mmproj.gguf"))
    return folder, theirs, write_text_gguf(model, tmp / "model.gguf"), layout


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_qwen3_omni.json")
    from llmrun import api

    result: dict = {"inputs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        _, mmproj, text, result["layout"] = files(tiny_qwen3_omni(), tmp / "ds", args.converter)
        print("layout:", json.dumps(result["layout"]))
        log = tmp / "deepstack-server.log"
        try:
            with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=mmproj):
                result["deepstack_mmproj"] = "loads"
        except Exception as e:  # the server exits: its log says why
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            refusal = [line for line in lines if "mismatch" in line] or [str(e)]
            result["deepstack_mmproj"] = refusal[0]
        print("llama-server on a tower with deepstack:", result["deepstack_mmproj"])
        model = tiny_qwen3_omni(deepstack=False)
        folder, mmproj, text, result["layout_plain"] = files(model, tmp / "plain", args.converter)
        engine = api.load(str(text), device="cpu", mmproj=mmproj, vision=True, audio=True)
        result["llmrun_on_converted"] = parity(model, folder, engine)
        print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
        log = tmp / "server.log"
        with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=mmproj) as server:
            for kind, data in (("image", IMAGE_BYTES), ("audio", CLIP_BYTES)):
                record = compare(engine, server, kind, data, PLACES)
                result["inputs"].append(record)
                print(f"{kind}: {describe(record, TOKENS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

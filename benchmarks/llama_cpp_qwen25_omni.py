"""llama.cpp's converter and llama-server against llmrun on the Qwen2.5-Omni files the image
and audio tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_qwen25_omni.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Qwen2.5-Omni thinker
(tests/qwen2_5_omni_helpers.py), reading an mmproj GGUF they lay out themselves
(write_mmproj). Here the thinker's folder, laid out as the Hub's Qwen2_5OmniModel
(thinker_config, thinker.* weights, talker weights beside them), goes through llama.cpp's
own converter (SRC/convert_hf_to_gguf.py --mmproj --outtype f32): its clip.* metadata and
tensors are compared with write_mmproj's, name by name, bit for bit; llmrun loads the
converter's file, and its image and audio embeddings and logits are compared with
transformers' (the audio conv weights rounded to F16 as the converter stores them). The
audio tower has 3 layers here: gguf-py maps audio_tower.conv2 only where there are 3
blocks or more. (The converter cannot write this tiny model's text GGUF: stories260K's
tokenizer is no pre-tokenizer it knows; the tests' text GGUF is Qwen2-VL's layout, arch
qwen2vl, which benchmarks/llama_cpp_qwen_vision.py checks.)

Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion for an image and for a 2-second clip. mtmd wraps an image
in <|vision_start|> and <|vision_end|>, which Qwen2.5-Omni's tokenizer calls <|vision_bos|>
and <|vision_eos|> (so with the Hub's files they reach llama.cpp's model as plain text):
llama-server's text GGUF names those two ids as mtmd does, so that both engines see the
same prompt. The audio is not expected to agree: llama.cpp runs this tower as Qwen2-Audio's
(whole 30-second chunks, 750 tokens each, attending over all of a chunk), where
transformers and llmrun attend within 2-second windows over the clip's own length. Per
input: the 8 greedy tokens of each engine, how many agree, and the prompt sizes.
Results go to --out (benchmarks/out/llama_cpp_qwen25_omni.json).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from llama_cpp_qwen2_audio import EXACT, compare_files  # noqa: E402
from qwen2_5_omni_helpers import (  # noqa: E402
    AUDIO,
    IMAGE,
    hub_layout,
    processor_inputs,
    save_qwen25_omni_dir,
    tiny_qwen25_omni,
    write_mmproj,
    write_text_gguf,
)
from tokenizer_fuzz import Server  # noqa: E402
from vision_helpers import picture  # noqa: E402
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What is this?"
PLACES = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}
TOKENS = 8
IMAGE_BYTES = picture(112, 84, 1)  # 4x3 merged tokens: a size neither engine resizes
CLIP_BYTES = wav_bytes(chirp(2.0, 16000, seed=1), 16000)


def converted_mmproj(converter: Path, folder: Path, out: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py")}
    command = [sys.executable, str(converter / "convert_hf_to_gguf.py"), "--mmproj"]
    subprocess.run(
        [*command, "--outtype", "f32", "--outfile", str(out), str(folder)],
        check=True,
        env=env,
        capture_output=True,
    )
    return out


def parity(model, folder: Path, engine) -> dict:
    """llmrun on the converter's mmproj against transformers, for one image and one clip."""
    from llmrun import audio
    from llmrun.images import open_image

    rounded = copy.deepcopy(model)
    for conv in (rounded.model.audio_tower.conv1, rounded.model.audio_tower.conv2):
        conv.weight.data = conv.weight.data.half().float()
    image, clip = open_image(IMAGE_BYTES), audio.open_audio(CLIP_BYTES)
    out = {}
    for kind, token, made in (
        ("image", IMAGE, engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])),
        ("audio", AUDIO, engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])),
    ):
        ids, prompt_images = made
        messages = [
            {"role": "user", "content": [{"type": kind}, {"type": "text", "text": QUESTION}]}
        ]
        media = {"images": [image]} if kind == "image" else {"clips": [clip.samples]}
        inputs = processor_inputs(folder, messages, **media)
        taken = {}

        def keep(module, args, kwargs, taken=taken):
            taken["embeds"] = kwargs["inputs_embeds"][0]

        hook = rounded.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
        with torch.no_grad():
            expected = rounded(**inputs).logits[0]
            got = engine.model(
                torch.tensor([ids]),
                torch.arange(len(ids))[None],
                images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
            )[0]
        hook.remove()
        rows = taken["embeds"][inputs["input_ids"][0] == token]
        out[kind] = {
            "same_ids": ids == inputs["input_ids"][0].tolist(),
            "embeddings_max_abs_diff": float((prompt_images.embeds[0] - rows).abs().max()),
            "logits_max_abs_diff": float((got - expected).abs().max()),
            "logits_max_abs": float(expected.abs().max()),
        }
    return out


def compare(engine, server: Server, marker: str, kind: str, data: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one image or clip and QUESTION."""
    from llmrun import audio
    from llmrun.images import open_image
    from llmrun.sampling import SamplingParams

    if kind == "image":
        text = engine.prompt_text(QUESTION, images=1)
        ids, media = engine.image_prompt(text, [open_image(data)])
    else:
        text = engine.prompt_text(QUESTION, audio=1)
        ids, media = engine.audio_prompt(text, [audio.open_audio(data)])
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": text.replace(PLACES[kind], marker),
                "multimodal_data": [base64.b64encode(data).decode()],
            },
            "n_predict": TOKENS,
            "temperature": 0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
        },
    )
    theirs = answer["tokens"]
    stream = engine.generate(ids, SamplingParams(temperature=0.0), TOKENS, images=media)
    ours = [r.token for r in stream if r.token is not None]
    pairs = zip(ours, theirs, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
    return dict(
        kind=kind,
        llmrun=ours,
        llama_cpp=theirs,
        tokens_agreeing=agree,
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="its bin/ folder")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_qwen25_omni.json")
    args = parser.parse_args()
    from llmrun import api

    model = tiny_qwen25_omni(audio_layers=3)
    result: dict = {"inputs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_qwen25_omni_dir(model, tmp / "thinker")
        hub = hub_layout(folder, tmp / "hub")
        theirs = converted_mmproj(args.converter, hub, tmp / "converted-mmproj.gguf")
        ours = write_mmproj(model, tmp / "ours-mmproj.gguf")
        result["layout"] = compare_files(theirs, ours)
        print("layout:", json.dumps(result["layout"]))
        text = write_text_gguf(model, tmp / "model.gguf")
        engine = api.load(str(text), device="cpu", mmproj=theirs, vision=True, audio=True)
        result["llmrun_on_converted"] = parity(model, folder, engine)
        print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
        mtmd_names = {"<|vision_bos|>": "<|vision_start|>", "<|vision_eos|>": "<|vision_end|>"}
        served = write_text_gguf(model, tmp / "model-mtmd.gguf", mtmd_names)
        server = Server(
            args.llama_cpp / "llama-server",
            served,
            tmp / "server.log",
            ("--mmproj", str(theirs), *EXACT),
        )
        try:
            url = f"http://127.0.0.1:{server.port}/props"
            with urllib.request.urlopen(url, timeout=10) as response:
                marker = json.loads(response.read())["media_marker"]
            for kind, data in (("image", IMAGE_BYTES), ("audio", CLIP_BYTES)):
                record = compare(engine, server, marker, kind, data)
                result["inputs"].append(record)
                print(
                    f"{kind}: {record['tokens_agreeing']}/{TOKENS} greedy tokens agree; "
                    f"prompt tokens {record['prompt_tokens_llmrun']} (llmrun) / "
                    f"{record['prompt_tokens_llama_cpp']} (llama.cpp)"
                )
        finally:
            server.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

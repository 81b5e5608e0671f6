"""llama.cpp's converter and llama-server against llmrun on the Qwen2-Audio files the audio
tests use (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_qwen2_audio.py --llama-cpp DIR --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Qwen2AudioForConditionalGeneration
(tests/qwen2_audio_helpers.py), reading an mmproj GGUF that they lay out themselves
(write_mmproj). Here llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj
--outtype f32) turns the model's folder into an mmproj GGUF: its clip.* metadata and
tensors are compared with write_mmproj's, name by name, bit for bit; llmrun loads the
converter's file and its audio embeddings and logits for a 2-second clip are compared
with transformers' (conv weights rounded to F16 as the converter stores them). (The
tower has 3 layers here: gguf-py maps audio_tower.conv2 only where there are 3 blocks or
more.)

Then `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no flash
attention) answers /completion with each clip as multimodal_data (mtmd puts
<|audio_bos|> and <|audio_eos|> around the clip's tokens itself, the chat template's
layout). llama.cpp gives every clip whole 30-second chunks (750 tokens each: it pads 30
seconds of zeros and drops the last incomplete chunk), the processor a clip its own
length's tokens, so a 2-second clip's prompts differ in size (printed); a clip of
29.9875 seconds (479,800 samples, 2999 feature frames) is one chunk to llama.cpp and 750
tokens to the processor too, and there the two engines' greedy tokens are compared.
Per clip: the 8 greedy tokens of each engine and how many agree. Results go to --out
(benchmarks/out/llama_cpp_qwen2_audio.json).
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from qwen2_audio_helpers import (  # noqa: E402
    AUDIO,
    processor_inputs,
    save_qwen2_audio_dir,
    tiny_qwen2_audio,
    write_mmproj,
    write_text_gguf,
)
from tokenizer_fuzz import Server  # noqa: E402
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
EXACT = (
    "--cache-type-k",
    "f32",
    "--cache-type-v",
    "f32",
    "-fa",
    "off",
    "--temp",
    "0",
    "-c",
    "2048",
)
QUESTION = "What do you hear?"
PLACE = "<|audio_bos|><|AUDIO|><|audio_eos|>"
TOKENS = 8
# (seconds, sample rate, seed): prompts of different sizes, then of the same.
CLIPS = [(2.0, 16000, 1), (29.9875, 16000, 2)]


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


def compare_files(theirs: Path, ours: Path) -> dict:
    import gguf

    a, b = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    meta = {
        name: (a.fields[name].contents(), b.fields[name].contents() if name in b.fields else None)
        for name in a.fields
        if name.startswith("clip.")
    }
    tensors_a = {t.name: t for t in a.tensors}
    tensors_b = {t.name: t for t in b.tensors}
    differing = [
        name
        for name, t in tensors_a.items()
        if name not in tensors_b
        or t.tensor_type != tensors_b[name].tensor_type
        or not np.array_equal(np.asarray(t.data), np.asarray(tensors_b[name].data))
    ]
    return {
        "metadata_differing": [k for k, (x, y) in meta.items() if x != y],
        "tensors": len(tensors_a),
        "tensors_only_ours": sorted(set(tensors_b) - set(tensors_a)),
        "tensors_differing": differing,
    }


def parity(model, folder: Path, engine) -> dict:
    """llmrun on the converter's mmproj against transformers, for a 2-second clip."""
    from llmrun import audio

    clip = audio.open_audio(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    ids, prompt_images = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}
    ]
    inputs = processor_inputs(folder, [clip.samples], messages)
    rounded = copy.deepcopy(model)
    for conv in (rounded.model.audio_tower.conv1, rounded.model.audio_tower.conv2):
        conv.weight.data = conv.weight.data.half().float()
    taken = {}

    def keep(module, args, kwargs):
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
    expected_embeds = taken["embeds"][inputs["input_ids"][0] == AUDIO]
    return {
        "same_ids": ids == inputs["input_ids"][0].tolist(),
        "embeddings_max_abs_diff": float((prompt_images.embeds[0] - expected_embeds).abs().max()),
        "logits_max_abs_diff": float((got - expected).abs().max()),
        "logits_max_abs": float(expected.abs().max()),
    }


def compare(engine, server: Server, marker: str, wav: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one clip and QUESTION."""
    from llmrun import audio
    from llmrun.sampling import SamplingParams

    text = engine.prompt_text(QUESTION, audio=1)
    answer = server._post(
        "/completion",
        {
            "prompt": {
                "prompt_string": text.replace(PLACE, marker),
                "multimodal_data": [base64.b64encode(wav).decode()],
            },
            "n_predict": TOKENS,
            "temperature": 0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
        },
    )
    theirs = answer["tokens"]
    ids, clips = engine.audio_prompt(text, [audio.open_audio(wav)])
    stream = engine.generate(ids, SamplingParams(temperature=0.0), TOKENS, images=clips)
    ours = [r.token for r in stream if r.token is not None]
    pairs = zip(ours, theirs, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
    return dict(
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
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_qwen2_audio.json")
    args = parser.parse_args()
    from llmrun import api

    model = tiny_qwen2_audio(audio_layers=3)
    result: dict = {"clips": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_qwen2_audio_dir(model, tmp / "hf")
        theirs = converted_mmproj(args.converter, folder, tmp / "converted-mmproj.gguf")
        ours = write_mmproj(model, tmp / "ours-mmproj.gguf")
        result["layout"] = compare_files(theirs, ours)
        print("layout:", json.dumps(result["layout"]))
        text = write_text_gguf(model, tmp / "model.gguf")
        engine = api.load(str(text), device="cpu", mmproj=theirs, audio=True)
        result["llmrun_on_converted"] = parity(model, folder, engine)
        print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
        server = Server(
            args.llama_cpp / "llama-server",
            text,
            tmp / "server.log",
            ("--mmproj", str(theirs), *EXACT),
        )
        try:
            url = f"http://127.0.0.1:{server.port}/props"
            with urllib.request.urlopen(url, timeout=10) as response:
                marker = json.loads(response.read())["media_marker"]
            for seconds, rate, seed in CLIPS:
                record = compare(
                    engine, server, marker, wav_bytes(chirp(seconds, rate, seed), rate)
                )
                record.update(seconds=seconds, rate=rate)
                result["clips"].append(record)
                print(
                    f"{seconds} s at {rate} Hz: {record['tokens_agreeing']}/{TOKENS} greedy "
                    f"tokens agree; prompt tokens {record['prompt_tokens_llmrun']} (llmrun) / "
                    f"{record['prompt_tokens_llama_cpp']} (llama.cpp)"
                )
        finally:
            server.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

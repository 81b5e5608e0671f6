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

import copy
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import (  # noqa: E402
    LlamaServer,
    against_transformers,
    agreement,
    arguments,
    clip_layout,
    convert,
    describe,
    greedy_completion,
    llmrun_greedy,
)
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


def parity(model, folder: Path, engine) -> dict:
    """llmrun on the converter's mmproj against transformers, for one image and one clip."""
    rounded = copy.deepcopy(model)
    for conv in (rounded.model.audio_tower.conv1, rounded.model.audio_tower.conv2):
        conv.weight.data = conv.weight.data.half().float()
    media = {"image": (IMAGE, IMAGE_BYTES), "audio": (AUDIO, CLIP_BYTES)}
    return media_parity(rounded, folder, engine, processor_inputs, media)


def media_parity(rounded, folder: Path, engine, processor_inputs, media: dict) -> dict:
    """llmrun on the converter's mmproj against the transformers model `rounded` (its
    weights rounded as the file holds them), for the image and the clip of `media`
    ({"image": (placeholder id, bytes), "audio": (...)}; `processor_inputs(folder,
    messages, images=, clips=)`: the family's processor)."""
    from llmrun import audio
    from llmrun.images import open_image

    (image_token, image_bytes), (audio_token, clip_bytes) = media["image"], media["audio"]
    image, clip = open_image(image_bytes), audio.open_audio(clip_bytes)
    out = {}
    for kind, token, made in (
        (
            "image",
            image_token,
            engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image]),
        ),
        ("audio", audio_token, engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])),
    ):
        ids, prompt_images = made
        messages = [
            {"role": "user", "content": [{"type": kind}, {"type": "text", "text": QUESTION}]}
        ]
        inputs_media = {"images": [image]} if kind == "image" else {"clips": [clip.samples]}
        inputs = processor_inputs(folder, messages, **inputs_media)
        out[kind] = against_transformers(rounded, inputs, token, engine, ids, prompt_images)
    return out


def compare(engine, server: LlamaServer, kind: str, data: bytes, places: dict = PLACES) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one image or clip and QUESTION;
    `places`: the chat template's image and audio places, which the server's media marker
    replaces."""
    from llmrun import audio
    from llmrun.images import open_image

    if kind == "image":
        text = engine.prompt_text(QUESTION, images=1)
        ids, media = engine.image_prompt(text, [open_image(data)])
    else:
        text = engine.prompt_text(QUESTION, audio=1)
        ids, media = engine.audio_prompt(text, [audio.open_audio(data)])
    prompt = text.replace(places[kind], server.media_marker)
    answer = greedy_completion(server, prompt, [data], TOKENS, n_probs=0)
    return dict(
        kind=kind,
        **agreement(*llmrun_greedy(engine, ids, TOKENS, media), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_qwen25_omni.json")
    from llmrun import api

    model = tiny_qwen25_omni(audio_layers=3)
    result: dict = {"inputs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_qwen25_omni_dir(model, tmp / "thinker")
        hub = hub_layout(folder, tmp / "hub")
        theirs = convert(
            args.converter, hub, tmp / "converted-mmproj.gguf", "--mmproj", "--outtype", "f32"
        )
        ours = write_mmproj(model, tmp / "ours-mmproj.gguf")
        result["layout"] = clip_layout(theirs, ours)
        print("layout:", json.dumps(result["layout"]))
        text = write_text_gguf(model, tmp / "model.gguf")
        engine = api.load(str(text), device="cpu", mmproj=theirs, vision=True, audio=True)
        result["llmrun_on_converted"] = parity(model, folder, engine)
        print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
        mtmd_names = {"<|vision_bos|>": "<|vision_start|>", "<|vision_eos|>": "<|vision_end|>"}
        served = write_text_gguf(model, tmp / "model-mtmd.gguf", mtmd_names)
        log = tmp / "server.log"
        with LlamaServer(args.llama_cpp, served, log, "-c", "2048", mmproj=theirs) as server:
            for kind, data in (("image", IMAGE_BYTES), ("audio", CLIP_BYTES)):
                record = compare(engine, server, kind, data)
                result["inputs"].append(record)
                print(f"{kind}: {describe(record, TOKENS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

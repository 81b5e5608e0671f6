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
from qwen2_audio_helpers import (  # noqa: E402
    AUDIO,
    processor_inputs,
    save_qwen2_audio_dir,
    tiny_qwen2_audio,
    write_mmproj,
    write_text_gguf,
)
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
QUESTION = "What do you hear?"
PLACE = "<|audio_bos|><|AUDIO|><|audio_eos|>"
TOKENS = 8
# (seconds, sample rate, seed): prompts of different sizes, then of the same.
CLIPS = [(2.0, 16000, 1), (29.9875, 16000, 2)]


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
    return against_transformers(rounded, inputs, AUDIO, engine, ids, prompt_images)


def compare(engine, server: LlamaServer, wav: bytes) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for one clip and QUESTION."""
    from llmrun import audio

    text = engine.prompt_text(QUESTION, audio=1)
    prompt = text.replace(PLACE, server.media_marker)
    answer = greedy_completion(server, prompt, [wav], TOKENS, n_probs=0)
    ids, clips = engine.audio_prompt(text, [audio.open_audio(wav)])
    return dict(
        **agreement(*llmrun_greedy(engine, ids, TOKENS, clips), answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_qwen2_audio.json")
    from llmrun import api

    model = tiny_qwen2_audio(audio_layers=3)
    result: dict = {"clips": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_qwen2_audio_dir(model, tmp / "hf")
        theirs = convert(
            args.converter, folder, tmp / "converted-mmproj.gguf", "--mmproj", "--outtype", "f32"
        )
        ours = write_mmproj(model, tmp / "ours-mmproj.gguf")
        result["layout"] = clip_layout(theirs, ours)
        print("layout:", json.dumps(result["layout"]))
        text = write_text_gguf(model, tmp / "model.gguf")
        engine = api.load(str(text), device="cpu", mmproj=theirs, audio=True)
        result["llmrun_on_converted"] = parity(model, folder, engine)
        print("llmrun on the converter's mmproj:", json.dumps(result["llmrun_on_converted"]))
        log = tmp / "server.log"
        with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=theirs) as server:
            for seconds, rate, seed in CLIPS:
                record = compare(engine, server, wav_bytes(chirp(seconds, rate, seed), rate))
                record.update(seconds=seconds, rate=rate)
                result["clips"].append(record)
                print(f"{seconds} s at {rate} Hz: {describe(record, TOKENS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

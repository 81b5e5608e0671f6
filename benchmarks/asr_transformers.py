"""llmrun's Cohere Transcribe or Moonshine transcription next to transformers' on one clip:
the same folder, the same WAV, greedy decoding on CPU in f32 (transformers' processor and
generate: CohereAsrProcessor's prompt for --language and its chunks of a long clip;
Moonshine's Wav2Vec2FeatureExtractor samples and, where generation_config.json gives no
max_length, the model card's 6.5 tokens a second, as llmrun). Prints each side's median
seconds over --repeats runs (after a warm-up run), the real-time factor, the ratio, and
whether the texts are the same. llama.cpp runs neither, so transformers is the peer.
Whisper's twin is benchmarks/whisper_transformers.py (its `timed` is reused).

    python benchmarks/asr_transformers.py ./cohere-transcribe-03-2026 speech.wav --language en
    python benchmarks/asr_transformers.py ./moonshine-base speech.wav [--repeats 3] [--threads 8]
"""

from __future__ import annotations

import argparse

import torch
from whisper_transformers import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("wav")
    parser.add_argument("--language")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    import transformers

    from llmrun import api, audio, moonshine

    if args.threads:
        torch.set_num_threads(args.threads)
    clip = audio.open_audio(args.wav)
    seconds = len(clip.samples) / audio.SAMPLE_RATE
    engine = api.load(args.folder, device="cpu", dtype="f32", threads=args.threads, transcribe=True)
    kind = engine.checkpoint.config["model_type"]
    hf = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(
        args.folder, dtype=torch.float32
    ).eval()
    processor = transformers.AutoProcessor.from_pretrained(args.folder)
    options = {}
    if kind == "cohere_asr":
        inputs = processor(clip.samples, language=args.language, sampling_rate=16000)
        chunks = inputs.pop("audio_chunk_index")
    else:
        inputs = processor(clip.samples, sampling_rate=16000, return_tensors="pt")
        generation = engine.checkpoint.generation_config
        if generation.get("max_length") is None and generation.get("max_new_tokens") is None:
            limit = int(len(clip.samples) * moonshine.TOKENS_PER_SECOND / audio.SAMPLE_RATE)
            options["max_length"] = limit

    def theirs():
        with torch.inference_mode():
            out = hf.generate(**inputs, **options)
        if kind == "cohere_asr":
            text = processor.decode(
                out, skip_special_tokens=True, audio_chunk_index=chunks, language=args.language
            )
            return text[0]
        return processor.batch_decode(out, skip_special_tokens=True)[0]

    def ours():
        return engine.transcribe(clip, args.language).text

    hf_seconds, hf_text = timed(theirs, args.repeats)
    llmrun_seconds, llmrun_text = timed(ours, args.repeats)
    print(f"{kind}, clip: {seconds:.1f} s, {torch.get_num_threads()} threads")
    print("| engine | seconds | real-time factor |")
    print("| --- | --- | --- |")
    for name, took in (("transformers", hf_seconds), ("llmrun", llmrun_seconds)):
        print(f"| {name} | {took:.2f} | {took / seconds:.3f} |")
    print(f"llmrun / transformers: {llmrun_seconds / hf_seconds:.2f}x the time")
    print(f"same text: {hf_text == llmrun_text}")
    if hf_text != llmrun_text:
        print(f"transformers: {hf_text!r}\nllmrun:       {llmrun_text!r}")


if __name__ == "__main__":
    main()

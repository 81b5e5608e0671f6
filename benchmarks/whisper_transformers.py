"""llmrun's Whisper transcription next to transformers' on one clip: the same folder, the
same WAV, greedy decoding on CPU in f32 (transformers' WhisperForConditionalGeneration
.generate with WhisperFeatureExtractor's features; a clip over 30 seconds by its long-form
algorithm, truncation=False). Prints each side's median seconds over --repeats runs (after
a warm-up run), the real-time factor, the ratio, and whether the token ids are the same.
llama.cpp has no Whisper, so transformers is the peer.

    python benchmarks/whisper_transformers.py ./whisper-large-v3-turbo speech.wav \
        [--language en] [--task translate] [--repeats 3] [--threads 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(run, repeats: int):
    run()  # warm-up: first-call allocations, kernel builds
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("wav")
    parser.add_argument("--language")
    parser.add_argument("--task")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    import transformers

    from llmrun import api, audio

    if args.threads:
        torch.set_num_threads(args.threads)
    clip = audio.open_audio(args.wav)
    seconds = len(clip.samples) / audio.SAMPLE_RATE
    engine = api.load(args.folder, device="cpu", dtype="f32", threads=args.threads, transcribe=True)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(
        args.folder, dtype=torch.float32
    ).eval()
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(args.folder)
    long = seconds > 30
    options = dict(truncation=False, padding="longest", return_attention_mask=True) if long else {}
    inputs = extractor(clip.samples, sampling_rate=16000, return_tensors="pt", **options)
    config = transformers.GenerationConfig.from_pretrained(args.folder)

    def theirs():
        hf.generation_config = config  # generate changes its model's (long-form max_length)
        with torch.inference_mode():
            return hf.generate(
                inputs.input_features,
                attention_mask=inputs.get("attention_mask"),
                language=args.language,
                task=args.task,
            )[0].tolist()

    def ours():
        return engine.transcribe(clip, args.language, args.task).ids

    hf_seconds, hf_ids = timed(theirs, args.repeats)
    llmrun_seconds, llmrun_ids = timed(ours, args.repeats)
    print(
        f"clip: {seconds:.1f} s{' (long-form)' if long else ''}, {torch.get_num_threads()} threads"
    )
    print("| engine | seconds | real-time factor |")
    print("| --- | --- | --- |")
    for name, took in (("transformers", hf_seconds), ("llmrun", llmrun_seconds)):
        print(f"| {name} | {took:.2f} | {took / seconds:.3f} |")
    print(f"llmrun / transformers: {llmrun_seconds / hf_seconds:.2f}x the time")
    print(f"same token ids: {hf_ids == llmrun_ids} ({len(llmrun_ids)} tokens)")


if __name__ == "__main__":
    main()

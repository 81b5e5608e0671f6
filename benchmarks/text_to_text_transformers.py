"""llmrun's text-to-text generation (T5, BART, Marian, M2M100/NLLB, ...) next to
transformers' generate on one prompt: the same folder, f32 on CPU, the decoding the folder's
generation_config.json asks for (beam search where it gives num_beams, else greedy) or
--beams N on both sides, a translator's --source-language and --target-language (transformers:
the tokenizer's src_lang and forced_bos_token_id). Prints each side's median seconds over
--repeats runs (after a warm-up run), the ratio, and whether the texts are the same.
llama.cpp runs no beam search of an encoder-decoder, so transformers is the peer.

    python benchmarks/text_to_text_transformers.py ./bart-large-cnn "$(cat article.txt)"
    python benchmarks/text_to_text_transformers.py ./opus-mt-en-de "Hello there." --beams 1
    python benchmarks/text_to_text_transformers.py ./nllb-200-distilled-600M "Hello there." \\
        --source-language eng_Latn --target-language deu_Latn [--max-tokens 64] [--threads 8]
"""

from __future__ import annotations

import argparse

import torch
from whisper_transformers import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("prompt")
    parser.add_argument("--beams", type=int)
    parser.add_argument("--source-language")
    parser.add_argument("--target-language")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    import transformers

    from llmrun import api
    from llmrun.sampling import SamplingParams
    from llmrun.text_to_text import Options

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = api.load(
        args.folder, device="cpu", dtype="f32", threads=args.threads, text_to_text=True
    )
    options = Options(args.beams, args.source_language, args.target_language)
    ids = engine.tokenizer.encode(args.prompt)
    greedy = SamplingParams(temperature=0.0)

    def ours() -> str:
        responses = engine.generate(ids, greedy, args.max_tokens, options=options)
        return "".join(r.text for r in responses)

    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    extra = {} if args.source_language is None else {"src_lang": args.source_language}
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.folder, **extra)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    kw = {"do_sample": False}
    if args.beams is not None:
        kw["num_beams"] = args.beams
    if args.max_tokens is not None:
        kw["max_new_tokens"] = args.max_tokens
    if args.target_language is not None:
        kw["forced_bos_token_id"] = tokenizer.convert_tokens_to_ids(args.target_language)

    def theirs() -> str:
        with torch.inference_mode():
            out = hf.generate(**inputs, **kw)
        return tokenizer.decode(out[0], skip_special_tokens=True)

    mine, our_text = timed(ours, args.repeats)
    peer, their_text = timed(theirs, args.repeats)
    plan = engine.text_to_text_plan(greedy, None, options)
    print(f"beams: {plan.beams.num_beams}, threads: {torch.get_num_threads()}")
    print(f"llmrun        {mine:8.3f} s")
    print(f"transformers  {peer:8.3f} s")
    print(f"ratio (transformers / llmrun): {peer / mine:.2f}x")
    print(f"same text: {our_text == their_text}")
    if our_text != their_text:
        print(f"  llmrun:       {our_text!r}\n  transformers: {their_text!r}")


if __name__ == "__main__":
    main()

"""Decode speed of a Gemma 4 model with and without its assistant drafter, llmrun beside
transformers (its assisted generation, Gemma4AssistantCandidateGenerator) on the same
prompt: greedy tokens/s of each engine alone and drafted, the drafted speed relative to
plain, llmrun's acceptance, and whether each engine's drafted text equals its plain text.

Needs a real pair (e.g. google/gemma-4-E2B-it and google/gemma-4-E2B-it-assistant
folders, or a Gemma 4 Unified folder and its gemma4_unified_assistant); with random
tiny weights the assistant's drafts are never accepted, so the numbers mean nothing there.

Usage:
  python benchmarks/gemma4_assistant.py MODEL_DIR ASSISTANT_DIR [-n 128] [-t 4]
      [--draft-max 3] [--prompt TEXT] [--no-transformers]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from llmrun import api
from llmrun.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def llmrun_tokens_per_second(
    model: Path, assistant: Path | None, prompt: str, tokens: int, draft_max: int
) -> tuple[float, list[int], str]:
    """Greedy decode speed (after the prompt), the tokens, and the acceptance."""
    engine = api.load(str(model), device="cpu")
    if assistant is not None:
        engine.use_assistant(assistant, draft_max)
    ids = engine.tokenizer.encode(prompt)
    responses = list(engine.generate(ids, SamplingParams(temperature=0), tokens))
    stats = responses[-1].stats
    out = [r.token for r in responses if r.token is not None]
    acceptance = f"{stats.accepted}/{stats.drafted}" if stats.drafted else "-"
    return stats.completion_tokens / stats.generation_seconds, out, acceptance


def transformers_tokens_per_second(
    model: Path, assistant: Path | None, prompt: str, tokens: int, draft_max: int
) -> tuple[float, list[int]]:
    """transformers' greedy decode speed (prefill timed apart) and tokens."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    target = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    extra = {}
    if assistant is not None:
        helper = transformers.AutoModelForCausalLM.from_pretrained(assistant, dtype=torch.bfloat16)
        helper.generation_config.num_assistant_tokens = draft_max
        extra = {"assistant_model": helper}
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        start = time.perf_counter()
        target.generate(ids, max_new_tokens=1, do_sample=False, **extra)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=tokens, do_sample=False, **extra)
        seconds = time.perf_counter() - start - prefill
    new = out[0, ids.shape[1] :].tolist()
    return (len(new) - 1) / seconds, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("assistant", type=Path)
    parser.add_argument("-n", "--tokens", type=int, default=128)
    parser.add_argument("-t", "--threads", type=int, default=4)
    parser.add_argument("--draft-max", type=int, default=3)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = (args.prompt, args.tokens, args.draft_max)
    print("| engine | plain t/s | drafted t/s | ratio | acceptance | same text |")
    print("|---|---|---|---|---|---|")
    plain, plain_ids, _ = llmrun_tokens_per_second(args.model, None, *run)
    drafted, drafted_ids, acceptance = llmrun_tokens_per_second(args.model, args.assistant, *run)
    print(
        f"| llmrun | {plain:.2f} | {drafted:.2f} | {drafted / plain:.2f} | {acceptance} "
        f"| {plain_ids == drafted_ids} |"
    )
    if not args.no_transformers:
        plain, plain_ids = transformers_tokens_per_second(args.model, None, *run)
        drafted, drafted_ids = transformers_tokens_per_second(args.model, args.assistant, *run)
        print(
            f"| transformers (bf16) | {plain:.2f} | {drafted:.2f} | {drafted / plain:.2f} | - "
            f"| {plain_ids == drafted_ids} |"
        )


if __name__ == "__main__":
    main()

"""Unlimited-OCR's reference sliding window against transformers: a tiny random
UnlimitedOcrForConditionalGeneration (unlimited_ocr_helpers) whose window is 4 tokens, so a
token decoded past the 4th sees its prompt and the last 4 positions only. 24 greedy tokens
and the logits of every step equal transformers' generate for two prompts of different
lengths: through the generation loop (also from a GGUF, whose window llama.cpp's converter
writes), `llmrun run`, and serve's scheduler (batched
together; and a second turn, whose prompt holds the first reply, where the prefix cache
and a chat's KV cache reuse only what a full prefill computes alike). Full attention (the
window dropped) fails.

Tolerances: logits 1e-4 (absolute), tokens exact.
"""

import dataclasses
import json

import pytest
import torch
from deepseek_ocr2_helpers import write_text_gguf
from serving import scheduled
from unlimited_ocr_helpers import save_unlimited_ocr_dir, tiny_unlimited_ocr

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.generate import KVState, generate_step, reuse_prefix
from llmrun.sampling import Sampler, SamplingParams

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0)
WINDOW, TOKENS = 4, 24
QUESTIONS = ["Read the page.", "What is written on this page, line by line?"]


@pytest.fixture(scope="module")
def model():
    return tiny_unlimited_ocr(sliding_window=WINDOW)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_unlimited_ocr_dir(model, tmp_path_factory.mktemp("unlimited_ocr_window"))


@pytest.fixture(scope="module")
def engine(folder):
    return dataclasses.replace(api.load(str(folder), device="cpu"), eos_ids=[])


def reference(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy TOKENS after `ids` (never stopping at EOS) and the logits
    [TOKENS, V] each was drawn from."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=TOKENS,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float()


def ours(engine, ids: list[int], state: KVState | None = None) -> tuple[list[int], torch.Tensor]:
    """The generation loop's greedy TOKENS after `ids` (through `state`, reusing the
    prefix it holds as a chat does) and their logits."""
    state = state or KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
    kept = reuse_prefix(state, ids)
    tokens, logits = [], []
    steps = generate_step(engine.model, state, ids[kept:], Sampler(GREEDY), list(ids))
    for token, row in steps:
        tokens.append(token)
        logits.append(row.float())
        if len(tokens) == TOKENS:
            break
    steps.close()
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def prompts(engine):
    return [
        engine.tokenizer.encode(engine.render([{"role": "user", "content": q}])) for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def expected(model, prompts):
    return [reference(model, ids) for ids in prompts]


def test_the_window_is_the_configs(engine):
    assert engine.model.args.reference_window == WINDOW


def test_logits_and_tokens_follow_transformers_and_full_attention_fails(engine, prompts, expected):
    assert len(prompts[0]) != len(prompts[1])
    for ids, (tokens, logits) in zip(prompts, expected, strict=True):
        got_tokens, got_logits = ours(engine, ids)
        assert got_tokens == tokens
        torch.testing.assert_close(got_logits, logits, atol=1e-4, rtol=0)
    engine.model.args.reference_window = None  # the planted bug: full attention
    try:
        _, full_logits = ours(engine, prompts[0])
    finally:
        engine.model.args.reference_window = WINDOW
    assert (full_logits - expected[0][1]).abs().max() > 1e-2


def test_a_gguf_keeps_the_window_the_converter_writes(model, folder, prompts, expected, tmp_path):
    """llama.cpp's converter writes the window (llama.cpp never reads it)."""
    gguf = write_text_gguf(model, folder, tmp_path / "model.gguf", WINDOW)
    engine = api.load(str(gguf), device="cpu")
    assert engine.model.args.reference_window == WINDOW
    tokens, logits = ours(engine, prompts[1])
    assert tokens == expected[1][0]
    torch.testing.assert_close(logits, expected[1][1], atol=1e-4, rtol=0)


def test_a_second_turn_reuses_the_cache_as_far_as_a_prefill_agrees(
    engine, model, prompts, expected
):
    """The second turn's prompt holds the first reply (computed with the window); its
    prefill, as transformers' generate of that prompt, sees it whole."""
    state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
    ours(engine, prompts[0], state)
    second = second_turn(engine, prompts[0], expected[0][0])
    tokens, logits = reference(model, second)
    got_tokens, got_logits = ours(engine, second, state)
    assert got_tokens == tokens
    torch.testing.assert_close(got_logits, logits, atol=1e-4, rtol=0)


def second_turn(engine, first: list[int], reply: list[int]) -> list[int]:
    """The prompt of a next question after `first` and its `reply` (ids)."""
    return [*first, *reply, *engine.tokenizer.encode("Now the next line.")]


def test_run_replies_as_transformers(folder, expected):
    from in_process import llmrun

    tokens = expected[0][0]
    assert 2 not in tokens[:20]  # run stops at EOS: 20 tokens at least compared
    tokens = tokens[: tokens.index(2)] if 2 in tokens else tokens
    args = [str(folder), QUESTIONS[0], "-n", str(TOKENS), "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == tokens


def test_serve_batches_rows_of_other_prompt_lengths_and_reuses_prefixes_as_transformers(
    engine, model, prompts, expected
):
    requests = [Request(ids, GREEDY, TOKENS, ignore_eos=True) for ids in prompts]
    got = scheduled(Scheduler(engine, parallel=2), requests)
    assert [tokens for _, tokens in got] == [tokens for tokens, _ in expected]
    # One at a time: the second turn finds the first's blocks in the prefix cache.
    second = second_turn(engine, prompts[0], expected[0][0])
    requests = [Request(ids, GREEDY, TOKENS, ignore_eos=True) for ids in (prompts[0], second)]
    got = scheduled(Scheduler(engine, parallel=1), requests)
    assert [tokens for _, tokens in got] == [expected[0][0], reference(model, second)[0]]

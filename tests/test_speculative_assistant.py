"""Speculative decoding with Gemma 4's assistant (llmrun.speculative.Assistant) on a tiny
random Gemma 4 and assistant (tests/gemma4_assistant_helpers.py) as a user sees it:
greedy output is plain greedy decoding's token for token; every round's drafts are those
transformers' assistant makes from transformers' target state for that round's sequence
(the model's hidden state at the right position, its keys and values of the right
layers and positions, sliding ones through the ring after it wrapped); an assistant that
drafts the last token again has some drafts accepted and some taken back, greedy and
sampled; `run` and `bench --draft ASSISTANT_FOLDER` work, and `run --draft` with the
assistant's GGUF; an assistant for another model is refused in one line, and serve
refuses one (its paged rounds do not give the assistant the model's state).

The random assistant's drafts are never accepted (it is not trained on the target); the
acceptance says nothing about speed. Tolerance: tokens exact."""

import pytest
import torch
from gemma4_assistant_helpers import ASSISTANT, converted, hf_drafts, hf_pair
from helpers import our_model, save_hf_dir
from in_process import llmrun

from llmrun import api, bench
from llmrun.errors import UsageError
from llmrun.generate import KVState, stream_generate
from llmrun.loading import gemma4_assistant
from llmrun.models.gemma4_assistant import Model, ModelArgs
from llmrun.sampling import Sampler, SamplingParams
from llmrun.server.app import _use_speculation
from llmrun.speculative import Assistant
from llmrun.tokenizer import load_tokenizer

PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' target and assistant, llmrun's, and their folders."""
    hf_target, hf_assistant = hf_pair()
    root = tmp_path_factory.mktemp("pair")
    target_dir = save_hf_dir(hf_target, root / "target", tokenizer=True)
    assistant_dir = root / "assistant"
    hf_assistant.save_pretrained(assistant_dir)
    target = our_model(hf_target.config.to_dict(), hf_target.state_dict())
    assistant = gemma4_assistant.load(assistant_dir, torch.device("cpu"), torch.float32)
    return hf_target, hf_assistant, target, assistant, target_dir, assistant_dir


def generate(target, tokenizer, speculator=None, tokens: int = 30, params=GREEDY):
    state = KVState(target.new_cache(1, 64, torch.float32, "cpu"))
    responses = list(
        stream_generate(
            target, tokenizer, state, tokenizer.encode(PROMPT), Sampler(params), tokens, [2],
            (), None, None, speculator,
        )
    )  # fmt: skip
    return [r.token for r in responses if r.token is not None], responses[-1].stats


def repeater(target) -> Model:
    """An assistant that drafts the last token again: its input the target's embedding of
    the token (projected to 32 features), its layers adding nothing, its output rows those
    projections, normalized (the highest dot product is each token's own)."""
    model = Model(ModelArgs.from_config({**ASSISTANT, "use_ordered_embeddings": False}))
    projection = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) / 8
    embedded = target.model.embed_tokens.weight * 64**0.5
    with torch.no_grad():
        model.pre_projection.weight.zero_()
        model.pre_projection.weight[:, :64] = projection
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.nn.functional.normalize(embedded @ projection.T, dim=-1))
    return model.eval()


def test_drafts_are_transformers_assistants_and_greedy_is_plain(pair):
    hf_target, hf_assistant, target, assistant, target_dir, _ = pair
    tokenizer = load_tokenizer(target_dir)
    speculator = Assistant(assistant, 3)
    rounds = []
    propose = speculator.propose

    def recorded(sequence, *args):
        drafts = propose(sequence, *args)
        rounds.append((list(sequence), drafts[0]))
        return drafts

    speculator.propose = recorded
    plain, _ = generate(target, tokenizer)
    tokens, stats = generate(target, tokenizer, speculator)
    assert tokens == plain and len(tokens) == 30
    assert stats.drafted == 3 * len(rounds) and len(rounds[-1][0]) > 2 * 5  # rings wrapped
    for sequence, drafts in rounds:
        assert drafts == hf_drafts(hf_target, hf_assistant, sequence, 3)


def test_an_assistant_that_drafts_the_last_token_again(pair):
    _, _, target, _, target_dir, _ = pair
    tokenizer = load_tokenizer(target_dir)
    plain, _ = generate(target, tokenizer, tokens=40)
    tokens, stats = generate(target, tokenizer, Assistant(repeater(target), 4), tokens=40)
    assert tokens == plain
    assert 0 < stats.accepted < stats.drafted  # the tiny model repeats tokens in runs
    sampled = SamplingParams(temperature=0.7, seed=5)
    tokens, stats = generate(target, tokenizer, Assistant(repeater(target), 4), 40, sampled)
    assert len(tokens) == 40 and 0 < stats.accepted < stats.drafted


def test_run_and_bench_draft_with_an_assistant_folder_or_gguf(pair):
    _, hf_assistant, _, _, target_dir, assistant_dir = pair
    args = ("run", str(target_dir), PROMPT, "-n", "16", "--temperature", "0")
    plain = llmrun(*args)
    drafted = llmrun(*args, "-v", "--draft", str(assistant_dir), "--draft-max", "2")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and "| draft: 0/" in drafted.stderr
    options = bench.BenchOptions.from_flags(
        "0", "8", [], "0", "512", None, 1, "cpu", "auto", False, draft=str(assistant_dir)
    )
    (record,) = bench.benchmark([str(target_dir)], options)
    assert (record["draft"], record["draft_max"], record["accepted"]) == ("assistant", 3, 0)
    assert record["drafted"] > 0
    converted(hf_assistant, assistant_dir.parent / "assistant.gguf")
    from_gguf = llmrun(*args, "--draft", str(assistant_dir.parent / "assistant.gguf"))
    assert from_gguf.returncode == 0 and from_gguf.stdout == plain.stdout, from_gguf.stderr
    engine = api.load(str(target_dir), device="cpu")
    with pytest.raises(UsageError, match="serve does not draft with a Gemma 4 assistant"):
        _use_speculation(engine, (str(assistant_dir), assistant_dir), 3, 0.0, None, {})
    wrong = llmrun("run", PROMPT, "-n", "4", "--draft", str(assistant_dir))
    assert wrong.returncode == 2
    assert wrong.stderr == (
        f"error: --draft {assistant_dir}: a Gemma 4 assistant that does not fit the model "
        "(the model is not a Gemma 4)\n"
    )

"""Speculative decoding (llmrun.speculative) as a user sees it: greedy output is plain
greedy decoding's token for token (Llama, Qwen2, Mistral's masked sliding window,
Gemma 3's sliding-window rings, a Q8_0 GGUF through the native decode step), also where
a stop string or max tokens lands inside an accepted run and when a conversation
reuses the cache; a draft equal to the model accepts everything, and
drafts only where its top probability reaches --draft-p-min; sampled output follows
the model's own distribution (total variation against the distribution computed
directly from the model's logits, over 5000 fixed-seed draws); prompt lookup drafts
from earlier text with the same guarantees; a foreign vocabulary, a recurrent model, a
grammar and misused flags are refused in one line.

Tolerances: greedy tokens exact; sampled frequencies within 0.04 total variation of
the exact distribution over 16 outcomes (the rule as written: 0.015 with a draft model,
0.017 with prompt lookup, sampling noise; resampling a rejection from p instead of
max(0, p - q): 0.13 and 0.14; accepting every draft: 0.27).
"""

import copy

import gguf
import pytest
import torch
from helpers import STORIES_GGUF, our_model, tiny_hf_model, write_gguf
from in_process import llmrun
from typer.testing import CliRunner

from llmrun import api, bench, structured
from llmrun.cli import app
from llmrun.errors import UnsupportedError, UsageError
from llmrun.generate import KVState, Stats, stream_generate
from llmrun.models import model_module
from llmrun.models.cache import KVCache
from llmrun.sampling import Sampler, SamplingParams
from llmrun.speculative import Draft, Lookup, Speculator, check_vocab, lookup
from llmrun.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(STORIES_GGUF)  # the tiny models' 512 ids are stories260K's
PROMPT = TOKENIZER.encode("Once upon a time")
GREEDY = SamplingParams(temperature=0)


def perturbed(model, scale: float, seed: int = 1):
    """A copy of `model` with N(0, scale) noise on every weight: a draft that agrees with
    it often, but not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return draft


def generate(model, draft=None, params=GREEDY, max_tokens=40, stop=(), state=None, prompt=PROMPT):
    """(tokens, text, last Response) of stream_generate on `model`; `draft`: a Speculator,
    or a draft model proposing up to 4 tokens a step."""
    state = state or KVState(model.new_cache(1, 64, torch.float32, "cpu"))
    if draft is not None and not isinstance(draft, Speculator):
        draft = Draft(draft, lambda n, small=draft: draft_model_cache(small, n), 4)
    sampler = Sampler(params)
    responses = list(
        stream_generate(
            model, TOKENIZER, state, prompt, sampler, max_tokens, [2], stop, None, None, draft
        )
    )
    tokens = [r.token for r in responses if r.token is not None]
    return tokens, "".join(r.text for r in responses), responses[-1]


def draft_model_cache(model, size: int) -> KVCache:
    return model.new_cache(1, size, torch.float32, "cpu")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "gemma3"])
def family(request):
    """A tiny model of the family (Mistral: a sliding window of 5 masked in full buffers;
    Gemma 3: windows of 5 kept in rings) and a draft near it."""
    hf, config = tiny_hf_model(request.param)
    if request.param == "gemma3":
        # Its embeddings (scaled by sqrt(hidden), tied to the output) otherwise make it
        # repeat one token forever, which any draft predicts.
        with torch.no_grad():
            hf.model.embed_tokens.weight.mul_(0.3)
    model = our_model(config, hf.state_dict())
    return model, perturbed(model, 0.01)


def test_greedy_with_a_draft_is_plain_greedy_decoding(family):
    model, draft = family
    plain, text, last = generate(model)
    tokens, drafted_text, drafted = generate(model, draft)
    assert tokens == plain and drafted_text == text and len(tokens) == 40
    stats = drafted.stats
    assert 0 < stats.accepted < stats.drafted  # some drafts taken, some taken back
    assert (stats.completion_tokens, drafted.finish_reason) == (40, last.finish_reason)


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    assert lookup([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], 3) == [7, 8, 2]  # 2, 3 latest
    assert lookup([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 2) == [4, 2]  # 1, 2, 3 before 2, 3
    assert lookup([4, 4, 4, 4], 3) == [4]  # up to the sequence's end
    assert lookup([1, 2, 3], 3) == lookup([6], 1) == []
    assert lookup([1, 2, 1], 2) == []  # a single token repeated is no match


STORY = ", there was a little girl named Lily. She loved to play outside in the park."
TWICE = f"Once upon a time{STORY} Once upon a time"  # the bundled model retells it


def test_prompt_lookup_on_a_story_told_twice():
    engine = api.load(None, device="cpu")
    prompt = engine.tokenizer.encode(TWICE)
    plain = [r.token for r in engine.generate(prompt, GREEDY, 40) if r.token is not None]
    engine.use_lookup(5)
    responses = list(engine.generate(prompt, GREEDY, 40))
    assert [r.token for r in responses if r.token is not None] == plain
    assert responses[-1].stats.accepted >= 10  # the retold part came drafted


def test_a_draft_equal_to_the_model_accepts_everything(family):
    model, _ = family
    tokens, _, last = generate(model, model)
    assert tokens == generate(model)[0]
    assert last.stats.drafted > 0 and last.stats.acceptance == 1.0


def test_draft_p_min_drafts_only_where_the_draft_is_sure():
    # The model as its own draft accepts every draft, so how many a round drafts follows
    # from the model's top probability before each token of its greedy text (computed
    # here in one forward over the whole text): drafting stops below --draft-p-min.
    engine = api.load(None, device="cpu")
    plain = [r.token for r in engine.generate(PROMPT, GREEDY, 50) if r.token is not None]
    ids = torch.tensor([PROMPT + plain])
    with torch.inference_mode():
        cache = engine.model.new_cache(1, ids.shape[1], torch.float32, "cpu")
        logits = engine.model(ids, torch.arange(ids.shape[1])[None], cache)[0]
    tops = torch.softmax(logits[len(PROMPT) - 1 :], -1).amax(-1).tolist()  # per generated token
    for p_min in (0.0, 0.9, 0.99):
        expected, made = 0, 1  # the first token comes from the prefill
        while made < 40:
            drafts = 0
            while drafts < 4 and tops[made + drafts] >= p_min:
                drafts += 1
            expected, made = expected + drafts, made + drafts + 1
        engine.use_draft(api.load(None, device="cpu"), 4, p_min)
        responses = list(engine.generate(PROMPT, GREEDY, 40))
        assert [r.token for r in responses if r.token is not None] == plain[:40]
        assert responses[-1].stats.drafted == responses[-1].stats.accepted == expected
    assert 0 < expected < 20  # 0.99 left some out, not all
    lonely = CliRunner().invoke(app, ["run", "Once upon a time", "--draft-p-min", "0.5"])
    assert str(lonely.exception) == "--draft-p-min goes with --draft"


def test_limits_inside_an_accepted_run_end_where_plain_decoding_ends(family):
    model, _ = family
    plain, text, _ = generate(model)
    # Rounds of 5 tokens (4 drafts, all accepted, and the model's own): 7 ends inside one.
    tokens, cut, last = generate(model, model, max_tokens=7)
    assert tokens == plain[:7] and last.finish_reason == "length"
    assert cut == TOKENIZER.decode(PROMPT + plain[:7])[len(TOKENIZER.decode(PROMPT)) :]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    expected, shown, plain_last = generate(model, stop=[stop])
    tokens, cut, last = generate(model, model, stop=[stop])
    assert (tokens, cut) == (expected, shown) and len(tokens) < 40
    assert last.finish_reason == plain_last.finish_reason == "stop"


def test_a_conversation_reuses_the_cache_after_drafts(family):
    model, draft = family
    state = KVState(model.new_cache(1, 64, torch.float32, "cpu"))
    speculative = Draft(draft, lambda n: draft_model_cache(draft, n), 4)
    first, _, _ = generate(model, speculative, max_tokens=9, state=state)
    follow_up = PROMPT + first + TOKENIZER.encode(" and", add_bos=False)
    again, _, last = generate(model, speculative, max_tokens=12, state=state, prompt=follow_up)
    assert last.stats.prompt_processed < len(follow_up)  # the shared prefix was kept
    assert again == generate(model, max_tokens=12, prompt=follow_up)[0]


def test_a_q8_0_gguf_on_the_native_decode_step(tmp_path):
    hf, config = tiny_hf_model("llama")
    path = write_gguf(
        tmp_path / "model.gguf", config, hf.state_dict(), gguf.GGMLQuantizationType.Q8_0
    )
    noisy = perturbed(hf, 0.01)
    draft_path = write_gguf(
        tmp_path / "draft.gguf", config, noisy.state_dict(), gguf.GGMLQuantizationType.Q8_0
    )
    engine = api.load(str(path), device="cpu")
    assert engine.model.decode_step is not None  # the native step decodes one token
    plain = [r.token for r in engine.generate(PROMPT, GREEDY, 30) if r.token is not None]
    engine.use_draft(api.load(str(draft_path), device="cpu"), 4)
    responses = list(engine.generate(PROMPT, GREEDY, 30))
    assert [r.token for r in responses if r.token is not None] == plain
    assert 0 < responses[-1].stats.accepted < responses[-1].stats.drafted


class Bigram(torch.nn.Module):
    """A model whose next-token logits depend on the last token alone (a table), so the
    distribution of a continuation can be written down exactly."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.args = type("Args", (), {"vocab_size": table.shape[0]})

    def forward(self, ids, positions, cache=None, last_only=False):
        logits = self.table[ids]
        return logits[:, -1:] if last_only else logits

    def new_cache(self, batch, size, dtype, device):
        return KVCache(1, batch, 1, size, 1, dtype, device)


@pytest.mark.parametrize("drafts", ["model", "lookup"])
def test_sampled_tokens_follow_the_models_distribution(drafts):
    vocab, draws = 4, 5000
    torch.manual_seed(0)
    model = Bigram(torch.randn(vocab, vocab) * 1.5)
    draft = Bigram(model.table + torch.randn(vocab, vocab) * 1.5)
    params = SamplingParams(
        temperature=0.8,
        top_k=3,
        top_p=0.95,
        min_p=0.05,
        repeat_penalty=1.5,
        presence_penalty=0.2,
        logit_bias=((3, 0.5),),
        seed=7,
    )
    prompt = [0, 1, 2, 3, 1, 2]  # every token occurs, so prompt lookup drafts after each
    # The first token comes from the prefill; the second and third from the first round
    # of drafts (the third from the second round where the first draft was rejected).
    # Their exact joint distribution, from the model's own logits:
    reference = Sampler(params)

    def p(history):
        return reference.distribution(model.table[history[-1]], history)

    exact = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        for b in range(vocab):
            exact[b] += p(prompt)[a] * p([*prompt, a])[b] * p([*prompt, a, b])
    exact = exact.flatten()
    q = reference.distribution(draft.table[prompt[-1]], prompt)
    assert 0.5 * (q - p(prompt)).abs().sum() > 0.2  # the draft alone would be far off

    sampler, stats = Sampler(params), Stats()
    speculative = (
        Draft(draft, lambda n: draft.new_cache(1, n, torch.float32, "cpu"), 3)
        if drafts == "model"
        else Lookup(3)
    )
    state = KVState(model.new_cache(1, 16, torch.float32, "cpu"))
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for _ in range(draws):
        state.tokens.clear()
        steps = speculative.generate_step(model, state, prompt, sampler, list(prompt), stats)
        _, (b, _), (c, _) = next(steps), next(steps), next(steps)
        steps.close()
        counts[b * vocab + c] += 1
    assert 0.5 * (counts / draws - exact).abs().sum() < 0.04
    assert 0 < stats.accepted < stats.drafted


def test_a_foreign_vocabulary_is_refused():
    other = copy.copy(TOKENIZER)
    other.eos_id = 5
    with pytest.raises(UsageError, match="vocabulary is not the model's .*BOS/EOS"):
        check_vocab(TOKENIZER, other, "other.gguf")
    other = copy.copy(TOKENIZER)
    other._bytes = list(TOKENIZER._bytes)
    other._bytes[300] = b"changed"
    with pytest.raises(UsageError, match="token 300 is b'changed'"):
        check_vocab(TOKENIZER, other, "other.gguf")
    other = copy.copy(TOKENIZER)
    other.vocab_size = 32000
    with pytest.raises(UsageError, match="32000 tokens, the model 512"):
        check_vocab(TOKENIZER, other, "other.gguf")
    check_vocab(TOKENIZER, load_tokenizer(STORIES_GGUF), "same.gguf")


def test_a_recurrent_model_and_a_grammar_are_refused():
    module = model_module("mamba")
    config = dict(
        model_type="mamba", hidden_size=32, num_hidden_layers=1, state_size=8,
        conv_kernel=4, vocab_size=512, layer_norm_epsilon=1e-5,
    )  # fmt: skip
    mamba = module.Model(module.ModelArgs.from_config(config)).eval()
    with pytest.raises(UnsupportedError, match="recurrent state cannot go back"):
        generate(mamba, mamba)
    hf, config = tiny_hf_model("llama")
    model = our_model(config, hf.state_dict())
    grammar = structured.for_format(structured.vocabulary(TOKENIZER, [2]), "json")
    with pytest.raises(UsageError, match="speculative decoding does not combine with --grammar"):
        generate(model, model, params=SamplingParams(grammar=grammar))


def test_cli_run_with_a_draft_or_prompt_lookup():
    engine = api.load(None, device="cpu")
    plain = "".join(r.text for r in engine.generate(PROMPT, GREEDY, 30))
    args = ("run", "Once upon a time", "-n", "30", "--temperature", "0", "-v")
    drafted = llmrun(*args, "--draft", str(STORIES_GGUF), "--draft-max", "5")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain
    assert "| draft: " in drafted.stderr and "accepted (100%)" in drafted.stderr
    retold = "".join(r.text for r in engine.generate(engine.tokenizer.encode(TWICE), GREEDY, 30))
    looked_up = llmrun("run", TWICE, "-n", "30", "--temperature", "0", "-v", "--lookup", "4")
    assert looked_up.returncode == 0, looked_up.stderr
    assert looked_up.stdout == retold and "| draft: " in looked_up.stderr
    lonely = llmrun("run", "Once upon a time", "--draft-max", "2")
    assert lonely.returncode == 2 and lonely.stderr == "error: --draft-max goes with --draft\n"


def test_bench_reports_the_acceptance():
    options = bench.BenchOptions.from_flags(
        "0", "16", [], "0", "512", None, 1, "cpu", "auto", False, draft=str(STORIES_GGUF)
    )
    (record,) = bench.benchmark([None], options)
    assert (record["draft"], record["draft_max"], record["acceptance"]) == ("stories260K", 3, 1.0)
    assert record["drafted"] > 0 and record["gbps"] is None
    with pytest.raises(UsageError, match="--draft and --lookup: choose one"):
        bench.BenchOptions.from_flags(
            "0", "16", [], "0", "512", None, 1, "cpu", "auto", False, draft="x", lookup=2
        )

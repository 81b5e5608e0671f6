"""The generation loop on the bundled stories260K: streaming, stops, limits, cache."""

import torch

from llmrun import api
from llmrun.sampling import SamplingParams

ENGINE = api.load(None, device="cpu")
GREEDY = SamplingParams(temperature=0)
PROMPT = ENGINE.tokenizer.encode("Once upon a time")


def collect(responses):
    responses = list(responses)
    tokens = [r.token for r in responses if r.token is not None]
    return "".join(r.text for r in responses), tokens, responses[-1]


def test_streamed_pieces_concatenate_to_the_full_decode():
    tok = ENGINE.tokenizer
    for seed in range(6):
        # Hot sampling reaches byte-fallback tokens, whose characters span several tokens.
        params = SamplingParams(temperature=2.5, top_k=0, top_p=1, min_p=0, seed=seed)
        pieces = list(ENGINE.generate(PROMPT, params, max_tokens=120))
        text = "".join(p.text for p in pieces)
        tokens = [p.token for p in pieces if p.token is not None]
        full = tok.decode(PROMPT + tokens)
        assert full == tok.decode(PROMPT) + text
        if "\ufffd" not in full:
            assert all("\ufffd" not in p.text for p in pieces)


def test_known_greedy_story():
    text, tokens, last = collect(ENGINE.generate(PROMPT, GREEDY, max_tokens=100))
    assert len(tokens) == 100 and last.finish_reason == "length"
    assert text.endswith("Lily was sad and didn't know what to do")
    assert last.stats.prompt_tokens == 5 and last.stats.completion_tokens == 100


def test_stop_string_is_cut_and_never_streamed():
    text, _, last = collect(ENGINE.generate(PROMPT, GREEDY, max_tokens=100, stop=["girl named"]))
    assert text == ", there was a little "
    assert last.finish_reason == "stop"


def test_eos_ends_generation():
    # Make every token an end token: generation stops at once with reason "stop".
    engine = api.Engine(**{**ENGINE.__dict__, "eos_ids": list(range(512))})
    text, tokens, last = collect(engine.generate(PROMPT, GREEDY, max_tokens=10))
    assert text == "" and tokens == [] and last.finish_reason == "stop"


def test_full_context_ends_with_length():
    state = ENGINE.new_state(12)
    text, tokens, last = collect(ENGINE.generate(PROMPT, GREEDY, max_tokens=None, state=state))
    assert last.finish_reason == "length"
    assert len(state.tokens) == 12  # the cache is full: prompt plus the tokens fed back


def test_prefix_reuse_prefills_only_new_tokens_with_identical_logits():
    model = ENGINE.model
    state = ENGINE.new_state(64)
    first = ENGINE.tokenizer.encode("Once upon a time, there was a dog")
    collect(ENGINE.generate(first, GREEDY, max_tokens=5, state=state))
    longer = first + ENGINE.tokenizer.encode(" named Max", add_bos=False)
    _, _, last = collect(ENGINE.generate(longer, GREEDY, max_tokens=1, state=state))
    assert last.stats.prompt_processed == len(longer) - len(first)
    # The cached keys/values equal a fresh prefill of the whole sequence.
    fresh = ENGINE.new_state(64)
    with torch.no_grad():
        ids = torch.tensor([longer])
        model(ids, torch.arange(len(longer))[None], fresh.cache)
    n = len(longer)
    torch.testing.assert_close(
        state.cache.k[:, :, :, :n], fresh.cache.k[:, :, :, :n], atol=1e-5, rtol=0
    )


def test_zero_max_tokens_generates_nothing():
    text, tokens, last = collect(ENGINE.generate(PROMPT, GREEDY, max_tokens=0))
    assert text == "" and tokens == [] and last.finish_reason == "length"

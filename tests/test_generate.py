"""The generation loop on the bundled stories260K: streaming, stops, limits, cache."""

import torch

from llmrun import api
from llmrun.generate import PREFILL_CHUNK, prefill, prefill_chunk
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


def _shaped(*widths: int) -> torch.nn.Module:
    """A module with linear layers of these output widths and a 151,936-token output
    head, on the meta device (no memory)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(8, w, device="meta") for w in widths)
    model.lm_head = torch.nn.Linear(8, 151_936, device="meta")
    return model


def test_a_wide_model_s_prompt_chunks_keep_its_activations_on_the_heap():
    """A chunk's widest activation (float32) stays within glibc's largest heap block, so
    it is not mapped and faulted in anew at every layer: Qwen2.5-7B's 18,944-wide
    feed-forward takes 256 tokens a forward, Llama 3 8B's 14,336 the whole 512; the output
    head (one row a prompt) does not count, nor does the CPU's allocator on a GPU."""
    cpu = torch.device("cpu")
    assert prefill_chunk(_shaped(3584, 18944), cpu) == 256
    assert prefill_chunk(_shaped(4096, 14336), cpu) == 512
    assert prefill_chunk(_shaped(8192, 28672), cpu) == 256
    assert prefill_chunk(_shaped(896, 4864), cpu) == PREFILL_CHUNK
    assert prefill_chunk(_shaped(18944), torch.device("cuda")) == PREFILL_CHUNK


class Wide(torch.nn.Module):
    """stories260K with an unused 70,000-wide layer: what prefill sees of a wide model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.sizes = model, []
        self.unused = torch.nn.Linear(8, 70_000, device="meta")

    def forward(self, ids, positions, cache, **kwargs):
        self.sizes.append(ids.shape[1])
        return self.model(ids, positions, cache, **kwargs)


def test_prefill_feeds_a_wide_model_s_prompt_in_its_chunks_with_the_same_logits():
    wide = Wide(ENGINE.model)
    tokens = (PROMPT * 100)[:300]
    chunked = prefill(wide, ENGINE.new_state(512), tokens)
    assert wide.sizes == [64, 64, 64, 64, 44]  # 64 * 70,000 * 4 bytes: 17.9 MB
    whole = prefill(ENGINE.model, ENGINE.new_state(512), tokens)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)

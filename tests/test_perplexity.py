"""Perplexity as llama-perplexity measures it, held to the method written out with
transformers: the text tokenized whole, whole chunks of ctx tokens (the rest left out),
BOS at each chunk's start, the second half of each scored, exp of the mean NLL and
llama.cpp's standard error; on stories260K (a real model, both formats) and tiny random
models."""

import math

import numpy as np
import pytest
import torch
from helpers import STORIES_GGUF, STORIES_HF, save_hf_dir, tiny_hf_model

from llmrun import api, perplexity
from llmrun.errors import UsageError

transformers = pytest.importorskip("transformers")

# A TinyStories-like text: 532 tokens with stories260K's tokenizer (not a multiple of the
# contexts below, so a tail is left out).
STORY = """Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog, Max. One day, Lily saw a big red ball under a tree. She ran to the ball and picked it up. "Look, Max! A ball!" she said. Max wagged his tail and barked. They played with the ball all day long.
Then the sun went down and it was time to go home. Lily was sad, but her mom said, "You can come back tomorrow." Lily smiled and hugged her mom. At home, Lily ate her dinner and went to bed. She dreamed about the big red ball and her happy dog.
The next day, Lily and Max went back to the park. They saw a boy named Tim. Tim was crying because he lost his toy car. Lily wanted to help him. She looked under the bench and behind the slide. At last she found the little car in the sand. Tim was very happy. "Thank you, Lily!" he said. They became good friends and played together every day.
One morning, a bird flew down from the sky. It was a small blue bird with a hurt wing. Lily and Tim took care of the bird. They gave it water and seeds. After a few days, the bird could fly again. It sang a sweet song and flew up to the trees. Lily and Tim waved goodbye. They were proud that they helped the bird."""
BOS = 1


def reference_tokens(text: str = STORY) -> list[int]:
    """transformers' tokenizer of the model folder: BOS, then the text."""
    return transformers.AutoTokenizer.from_pretrained(STORIES_HF)(text).input_ids


def reference_nll(hf_model, tokens: list[int], ctx: int, limit: int | None = None) -> np.ndarray:
    """llama-perplexity's method written out, in float64: chunk i is tokens[i*ctx:(i+1)*ctx]
    with BOS first, whole chunks only; the logits at ctx//2 .. ctx-2 predict the next token."""
    count = len(tokens) // ctx if limit is None else min(limit, len(tokens) // ctx)
    model = hf_model.double()
    out = []
    with torch.no_grad():
        for i in range(count):
            ids = [BOS, *tokens[i * ctx + 1 : (i + 1) * ctx]]
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            for p in range(ctx // 2, ctx - 1):
                out.append(-float(logprobs[p, ids[p + 1]]))
    hf_model.float()
    return np.array(out)


def reference_ppl(nll: np.ndarray) -> tuple[float, float]:
    """exp(mean) and llama.cpp's error: sqrt((mean(x^2) - mean^2) / (N - 1)) * PPL."""
    ppl = math.exp(nll.mean())
    return ppl, math.sqrt((np.mean(nll**2) - nll.mean() ** 2) / (len(nll) - 1)) * ppl


@pytest.fixture(scope="module")
def stories_hf():
    return transformers.AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)


def measured(engine, text: str, ctx: int, limit=None, batch_size=perplexity.DEFAULT_BATCH):
    chunks = perplexity.text_chunks(engine.tokenizer, text, ctx, limit)
    return chunks, list(perplexity.measure(engine.model, engine.new_cache, chunks, batch_size))


@pytest.mark.parametrize("path", [STORIES_HF, STORIES_GGUF], ids=["hf", "gguf"])
def test_stories260k_equals_the_method_written_out_with_transformers(stories_hf, path):
    ctx = 64
    tokens = reference_tokens()
    assert len(tokens) % ctx != 0  # a tail that fills no chunk
    engine = api.load(str(path), device="cpu", ctx_size=ctx)
    assert perplexity.tokenize(engine.tokenizer, STORY) == tokens
    chunks, estimates = measured(engine, STORY, ctx)
    assert chunks.shape == (len(tokens) // ctx, ctx)
    nll = reference_nll(stories_hf, tokens, ctx)
    scored = ctx - 1 - ctx // 2
    assert [e.tokens for e in estimates] == [scored * (i + 1) for i in range(len(chunks))]
    for estimate in estimates:  # the running estimate after each chunk
        ppl, _ = reference_ppl(nll[: estimate.tokens])
        assert estimate.ppl == pytest.approx(ppl, rel=1e-4)
    ppl, error = reference_ppl(nll)
    final = estimates[-1]
    assert (final.chunks, final.total) == (len(chunks), len(chunks))
    assert final.ppl == pytest.approx(ppl, rel=1e-4)
    assert final.error == pytest.approx(error, rel=1e-3)
    assert 2 < final.ppl < 10  # a trained model on text like its training data


def test_batch_size_splits_or_stacks_chunks_without_changing_the_result():
    engine = api.load(str(STORIES_GGUF), device="cpu", ctx_size=32)
    # 5 chunks: in pieces of 10 tokens; one a forward; 2 and then 3 together; 2, 2, then 1
    results = [measured(engine, STORY, 32, 5, b)[1][-1] for b in (10, 32, 96, 64)]
    for other in results[1:]:
        assert other.tokens == results[0].tokens == 5 * 15
        assert other.ppl == pytest.approx(results[0].ppl, rel=1e-6)


def test_chunks_limits_the_evaluated_chunks(stories_hf):
    engine = api.load(str(STORIES_HF), device="cpu", ctx_size=48)
    chunks, estimates = measured(engine, STORY, 48, limit=3)
    assert len(chunks) == len(estimates) == 3 and estimates[-1].total == 3
    ppl, _ = reference_ppl(reference_nll(stories_hf, reference_tokens(), 48, limit=3))
    assert estimates[-1].ppl == pytest.approx(ppl, rel=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_tiny_random_models_equal_transformers(tmp_path, family):
    """Qwen2 (tied embeddings), Gemma 2 (windows of 5, soft-capped logits)."""
    hf, _ = tiny_hf_model(family)
    folder = save_hf_dir(hf, tmp_path / family, tokenizer=True)
    ctx = 24
    engine = api.load(str(folder), device="cpu", ctx_size=ctx)
    _, estimates = measured(engine, STORY, ctx, limit=6, batch_size=16)
    ppl, error = reference_ppl(reference_nll(hf, reference_tokens(), ctx, limit=6))
    assert estimates[-1].ppl == pytest.approx(ppl, rel=1e-4)
    assert estimates[-1].error == pytest.approx(error, rel=1e-3)


def test_special_token_text_is_read_as_plain_text():
    """As llama-perplexity tokenizes (parse_special false): "</s>" in a text is not EOS."""
    tokenizer = api.load(str(STORIES_GGUF), device="cpu").tokenizer
    ids = perplexity.tokenize(tokenizer, "a</s>b")
    assert ids[0] == BOS and 2 not in ids
    assert tokenizer.decode(ids) == "a</s>b"


def test_chunks_keep_their_first_token_without_a_bos():
    tokens = list(range(10, 33))  # 23 tokens: two chunks of 10, 3 left out
    assert perplexity.chunk(tokens, 10).tolist() == [tokens[:10], tokens[10:20]]
    assert perplexity.chunk(tokens, 10, bos_id=1).tolist() == [
        [1, *tokens[1:10]],
        [1, *tokens[11:20]],
    ]
    assert perplexity.chunk(tokens, 5, limit=2).shape == (2, 5)
    assert perplexity.scored_targets(perplexity.chunk(tokens, 10)).tolist() == [
        tokens[6:10],
        tokens[16:20],
    ]


@pytest.mark.parametrize(
    "tokens, ctx, limit, message",
    [
        (
            list(range(19)),
            10,
            None,
            "the text is 19 tokens long; perplexity with a context of 10 needs at least 20 "
            "tokens: give a longer text or a smaller --ctx-size",
        ),
        (list(range(40)), 3, None, "--ctx-size must be at least 4 for perplexity, got 3"),
        (list(range(40)), 10, 0, "--chunks must be positive, got 0"),
    ],
)
def test_short_texts_and_bad_settings_are_refused(tokens, ctx, limit, message):
    with pytest.raises(UsageError) as e:
        perplexity.chunk(tokens, ctx, limit)
    assert str(e.value) == message

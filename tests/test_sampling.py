"""The sampler's filters, penalties and seeding, on hand-made logits."""

import math

import pytest
import torch

from llmrun.errors import UsageError
from llmrun.sampling import Sampler, SamplingParams, argmax, top_k, top_logprobs

LOGITS = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])


def draws(params: SamplingParams, n: int = 400, logits=LOGITS) -> set[int]:
    sampler = Sampler(params)
    return {sampler(logits) for _ in range(n)}


def test_greedy_is_argmax():
    assert draws(SamplingParams(temperature=0), 5) == {0}


def test_top_k_keeps_k_tokens():
    assert draws(SamplingParams(temperature=5, top_k=2, top_p=1, min_p=0)) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, 0)  # 0.64, 0.24, 0.09, ...
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert draws(SamplingParams(temperature=5, top_k=0, top_p=0.7, min_p=0)) == {0, 1}
    assert draws(SamplingParams(temperature=5, top_k=0, top_p=0.5, min_p=0)) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # p1/p0 = e^-1 = 0.37, p2/p0 = e^-2 = 0.14
    assert draws(SamplingParams(temperature=5, top_k=0, top_p=1, min_p=0.2)) == {0, 1}


def test_high_temperature_without_filters_reaches_every_token():
    assert draws(SamplingParams(temperature=5, top_k=0, top_p=1, min_p=0), 2000) == set(range(5))


def test_same_seed_same_draws():
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=42)
    a, b = Sampler(params), Sampler(params)
    assert [a(LOGITS) for _ in range(50)] == [b(LOGITS) for _ in range(50)]


def test_seeds_differing_only_in_their_high_bits_draw_differently():
    def sequence(seed):
        sampler = Sampler(SamplingParams(temperature=5, top_k=0, top_p=1, min_p=0, seed=seed))
        return [sampler(LOGITS) for _ in range(40)]

    assert sequence(1) != sequence(1 + (1 << 32))
    assert sequence(7) != sequence(7 + (1 << 63))
    assert sequence(1 << 40) == sequence(1 << 40)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-39, top_k=0, top_p=1, min_p=0),
        SamplingParams(temperature=1e-45, top_k=2, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.5, repeat_penalty=1e-38, repeat_last_n=4),
    ],
)
def test_values_that_overflow_the_logits_are_greedy(params):
    """A temperature (or penalty) the API accepts can push the logits out of float range:
    only the best token is left, where before softmax made NaNs and the draw failed."""
    logits = torch.tensor([3.0, 2.5, -1.0, 0.5])
    assert {Sampler(params)(logits, history=[1]) for _ in range(20)} == {
        0 if params.repeat_penalty == 1.0 else 1
    }


def test_repeat_penalty_as_llama_cpp():
    sampler = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=2))
    out = sampler.penalize(torch.tensor([4.0, -4.0, 1.0, 1.0]), history=[3, 0, 1])
    # Only the last 2 tokens (0 and 1) count: positive logits are divided, negative multiplied.
    assert out.tolist() == [2.0, -8.0, 1.0, 1.0]


def test_presence_and_frequency_penalties_as_openai():
    sampler = Sampler(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=-1)
    )
    out = sampler.penalize(torch.zeros(3), history=[1, 1, 2])
    assert out.tolist() == [0.0, -1.0, -0.75]


def test_top_logprobs_are_log_softmax():
    value, top = top_logprobs(LOGITS, 2, 2)
    expected = torch.log_softmax(LOGITS, 0)
    assert value == pytest.approx(float(expected[2]))
    assert [i for i, _ in top] == [0, 1]
    assert math.isclose(top[0][1], float(expected[0]), rel_tol=1e-6)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("min_p", 2.0),
        ("top_k", -1),
        ("repeat_penalty", 0),
    ],
)
def test_bad_values_are_usage_errors(field, value):
    with pytest.raises(UsageError):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("k", [1, 40, 1000])
def test_top_k_matches_torch_topk(k):
    torch.manual_seed(0)
    logits = torch.randn(151936) * 3
    logits[:50000] -= 20  # a skewed vocabulary: the strided sample still bounds it
    values, ids = top_k(logits, k)
    expected_values, expected_ids = torch.topk(logits, k)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


def test_top_k_orders_ties_by_id_and_handles_small_and_nan_vocabularies():
    logits = torch.zeros(10000)
    logits[[7, 3, 9000, 42]] = 5.0
    values, ids = top_k(logits, 3)
    assert ids.tolist() == [3, 7, 42] and values.tolist() == [5.0] * 3
    small = torch.tensor([0.5, 2.0, 1.0])
    assert top_k(small, 2)[1].tolist() == [1, 2]
    nan = torch.full((10000,), float("nan"))
    assert torch.equal(top_k(nan, 2)[1], torch.topk(nan, 2)[1])


def test_argmax_takes_the_first_of_equal_maxima():
    logits = torch.zeros(151936)
    logits[[900, 12, 150000]] = 1.0
    assert argmax(logits) == 12 == int(logits.argmax())


def test_top_k_larger_than_the_sample():
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(1))
    values, ids = top_k(logits, 5000)
    expected_values, expected_ids = torch.topk(logits, 5000)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


def test_seed_minus_one_is_a_random_seed_on_the_command_line():
    """As llama.cpp's --seed -1; the API's seeds stay as given."""
    from llmrun import api

    engine = api.load(None, device="cpu")
    flags = {name: None for name in api.SAMPLING_FLAGS}
    assert engine.sampling({**flags, "seed": -1}).seed is None
    assert engine.sampling({**flags, "seed": 5}).seed == 5


def test_distribution_is_what_the_sampler_draws_from():
    """Sampler.distribution (speculative decoding's p and q): by hand for top-p at a
    temperature, one-hot for greedy and for an overflowing temperature, and within 0.03
    total variation of 8000 draws under every filter and penalty (noise: ~0.01)."""
    params = SamplingParams(temperature=2.0, top_k=0, top_p=0.9, min_p=0)
    # softmax(LOGITS): 0.636, 0.234, 0.086, ...: top-p 0.9 keeps three.
    kept = [math.exp(x / 2.0) for x in (3.0, 2.0, 1.0)]
    by_hand = [k / sum(kept) for k in kept] + [0.0, 0.0]
    got = Sampler(params).distribution(LOGITS)
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(by_hand, abs=1e-7)
    assert Sampler(SamplingParams(temperature=0)).distribution(LOGITS).tolist() == [1, 0, 0, 0, 0]
    tiny = SamplingParams(temperature=1e-45, top_k=0, top_p=1, min_p=0)
    assert Sampler(tiny).distribution(LOGITS).tolist() == [1, 0, 0, 0, 0]
    params = SamplingParams(
        temperature=0.7, top_k=4, top_p=0.97, min_p=0.02, repeat_penalty=1.3,
        presence_penalty=0.3, logit_bias=((4, 2.0),), seed=3,
    )  # fmt: skip
    sampler, history = Sampler(params), [0, 0, 2]
    drawn = torch.tensor([sampler(LOGITS, history) for _ in range(8000)])
    expected = sampler.distribution(LOGITS, history)
    assert 0.5 * (torch.bincount(drawn, minlength=5) / 8000 - expected).abs().sum() < 0.03

"""serve's batching on a mixture-of-experts GGUF (quantized experts): batched steps
run each chosen expert once on the union of the rows that chose it, and every request
gets the text it gets alone."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from moe_helpers import (
    hub_state_dict,
    quantized_and_dequantized,
    stacked_gguf_state,
    tiny_moe_model,
    write_moe_gguf,
)
from test_batching import Collector

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.sampling import SamplingParams

pytest.importorskip("transformers")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "The sun was"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf, config = tiny_moe_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256)
    tensors = stacked_gguf_state(hub_state_dict(hf, "qwen3_moe"), config)
    types = {"_exps": T.Q4_K, "attn_": T.Q8_0}
    quantized, _ = quantized_and_dequantized(tensors, types, np.random.default_rng(0))
    path = write_moe_gguf(tmp_path_factory.mktemp("moe") / "m.gguf", config, quantized)
    return api.load(str(path), device="cpu", ctx_size=128)


def test_batched_moe_decode_gives_each_row_its_own_logits(engine):
    model = engine.model
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    slots = [3, 0, 2]
    with torch.inference_mode():
        cache = model.new_cache(4, 64, torch.float32, "cpu")
        for slot, prompt in zip(slots, prompts, strict=True):
            model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache.select([slot]))
        positions = torch.tensor([[len(p)] for p in prompts])
        batched = model(torch.tensor([[7], [8], [9]]), positions, cache.select(slots))[:, -1]
        for row, prompt in enumerate(prompts):
            sequence = prompt + [7 + row]
            own = model.new_cache(1, 64, torch.float32, "cpu")
            single = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], own)
            torch.testing.assert_close(batched[row], single[0, -1], atol=1e-4, rtol=0)


def test_concurrent_moe_requests_equal_single_sequence_runs(engine):
    greedy = SamplingParams(temperature=0)
    cases = [
        (engine.tokenizer.encode(p), greedy if i % 2 else SamplingParams(seed=i, temperature=0.9))
        for i, p in enumerate(PROMPTS)
    ]
    scheduler = Scheduler(engine, parallel=4, queue=8)
    collectors = []
    for prompt, params in cases:
        collectors.append(Collector())
        scheduler.submit(Request(prompt, params, 20), collectors[-1])
    scheduler.start()  # all four prefilled together in one padded forward, then batched
    try:
        for (prompt, params), collector in zip(cases, collectors, strict=True):
            responses = list(engine.generate(prompt, params, 20))
            expected = "".join(r.text for r in responses), responses[-1].finish_reason
            assert len(responses) > 5
            assert collector.result() == expected
    finally:
        scheduler.close()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_a_batched_q8_step_gives_each_row_what_its_step_alone_gives(name, tmp_path):
    """The native decode step with 8-bit activations, four rows at once: an expert
    several rows chose runs once, as one job over those rows (Mixtral's 2 of 8 overlap
    often), and Qwen2-MoE's shared expert, of the experts' type and layout (Q6_K), on
    all the rows. Each row's logits equal its own step's alone: the q8 kernels take
    each row on its own."""
    width = {"mixtral": dict(intermediate_size=256)}.get(
        name, dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)
    )
    hf, config = tiny_moe_model(name, hidden_size=256, **width)
    tensors = stacked_gguf_state(hub_state_dict(hf, name), config)
    experts = T.Q4_K if name == "mixtral" else T.Q6_K
    types = {"_exps": experts, "_shexp": experts, "attn_": T.Q8_0}
    quantized, _ = quantized_and_dequantized(tensors, types, np.random.default_rng(1))
    path = write_moe_gguf(tmp_path / "m.gguf", config, quantized)
    engine = api.load(str(path), device="cpu", ctx_size=128, activations="q8")
    model = engine.model
    assert model.decode_step is not None
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    steps = torch.tensor([[7], [8], [9], [10]])
    positions = torch.tensor([[len(p)] for p in prompts])

    def prefilled(cache, slot, prompt):
        model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache.select([slot]))

    step, taken = model.decode_step, []
    model.decode_step = lambda *args, **kwargs: taken.append(step(*args, **kwargs)) or taken[-1]
    with torch.inference_mode():
        cache = model.new_cache(4, 64, torch.float32, "cpu")
        for slot, prompt in enumerate(prompts):
            prefilled(cache, slot, prompt)
        batched = model(steps, positions, cache.select([0, 1, 2, 3]))[:, -1]
        assert taken[-1] is not None  # the native step ran the batch
        for row, prompt in enumerate(prompts):
            own = model.new_cache(1, 64, torch.float32, "cpu")
            prefilled(own, 0, prompt)
            alone = model(steps[row : row + 1], positions[row : row + 1], own.select([0]))
            torch.testing.assert_close(batched[row], alone[0, -1], atol=1e-5, rtol=0)

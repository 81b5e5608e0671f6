"""The native decode step (llmrun.quant.decode_step, llmrun/native/decode_step.c): a
one-sequence decode step through every decoder layer in one call.

- Against transformers: the tiny random configs of every family it takes, prefilled
  by the layers and then decoded a token at a time by the step, give transformers'
  logits (1e-4, as tests/models/test_parity.py and test_moe.py); Gemma 2/3's and
  gpt-oss's windows of 5 are passed, so their ring layers are read and written by the
  step; every expert of the mixture-of-experts configs is chosen somewhere; routers
  that tie hand their layer to the model's own layers.
- Against the model's own layers (whose kernels and ops are tested against gguf and
  float64 elsewhere): quantized GGUF models, every KV cache type, and 8-bit
  activations decode the same logits through the step as through the layers, which
  run the same kernels on the same rows: equal to 1e-6 of the largest logit.
- Where it cannot go (a batch, a prompt, a mask, LLMRUN_DECODE_STEP=0) the layers run.
"""

import numpy as np
import pytest
import test_quant_models as quant_models
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gpt_oss_helpers import llmrun_state, tiny_gpt_oss
from helpers import BASE, our_model, tiny_hf_model, write_gguf
from moe_helpers import hub_state_dict, tiny_moe_model
from test_q8_kernels import quantized_activations
from test_quant_models import random_block_model

from llmrun.loading.loader import load_model
from llmrun.quant import decode_step, kernels
from llmrun.quant.linear import QuantLinear, set_activations

T = GGMLQuantizationType
CPU = torch.device("cpu")
# Decode steps the step takes of the four below (Mistral's keys beyond its window of 5
# are left out by the step as by the layers' mask: its cache has no rings).
FAMILIES = {
    "llama": 4,
    "llama3-scaled": 4,
    "llama-tied": 4,
    "mistral": 4,
    "qwen2": 4,
    "qwen3": 4,
    "gemma": 4,
    "gemma2": 4,
    "gemma3": 4,
}


class Counting:
    """A model's decode step that counts the steps it takes."""

    def __init__(self, model) -> None:
        self.step, self.taken = model.decode_step, 0
        model.decode_step = self

    def __call__(self, *args, **kwargs):
        out = self.step(*args, **kwargs)
        self.taken += out is not None
        return out


def decode(model, ids: torch.Tensor, split: int, cache_type=torch.float32) -> torch.Tensor:
    """Logits of a prefill of ids[:, :split], then one token at a time."""
    positions = torch.arange(ids.shape[1])[None]
    cache = model.new_cache(1, 64, cache_type, "cpu")
    with torch.no_grad():
        steps = [model(ids[:, :split], positions[:, :split], cache)]
        for t in range(split, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], positions[:, t : t + 1], cache))
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_step_decodes_as_transformers(native_kernels, name):
    hf, config = tiny_hf_model(name)
    ours = our_model(config, hf.state_dict())
    assert decode_step.attach(ours)
    counter = Counting(ours)
    ids = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(decode(ours, ids, 8), expected, atol=1e-4, rtol=0)
    assert counter.taken == FAMILIES[name]


def our_moe_model(config: dict, state: dict):
    from llmrun.models import model_module

    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_config(config))
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model.eval().requires_grad_(False)


MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]


def moe_model(name: str, **overrides):
    """A transformers model of a tiny MoE config and llmrun's of the same weights."""
    if name == "gpt_oss":
        hf, config = tiny_gpt_oss(**overrides)
        return hf, our_moe_model(config, llmrun_state(hf, config))
    hf, config = tiny_moe_model(name, **overrides)
    return hf, our_moe_model(config, hub_state_dict(hf, config["model_type"]))


@pytest.mark.parametrize("name", MOE)
def test_the_step_decodes_mixtures_of_experts_as_transformers(native_kernels, name):
    hf, ours = moe_model(name)
    assert decode_step.attach(ours)
    counter = Counting(ours)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(decode(ours, ids, 12), expected, atol=1e-4, rtol=0)
    assert counter.taken == 12


def test_a_tied_router_hands_its_layer_to_the_layers(native_kernels):
    """Experts 0 and 1 have equal router rows in every layer: where a token's k-th choice
    is one of them, the step stops before that layer and the layers' torch.topk breaks
    the tie, as transformers' does."""
    hf, config = tiny_moe_model("qwen3_moe")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight[1] = layer.mlp.gate.weight[0]
    ours = our_moe_model(config, hub_state_dict(hf, config["model_type"]))
    assert decode_step.attach(ours)
    stops = []
    layers = ours.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, out, i=i: stops.append(i))
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(ids).logits
    positions = torch.arange(24)[None]
    cache = ours.new_cache(1, 64, torch.float32, "cpu")
    with torch.no_grad():
        steps = [ours(ids[:, :1], positions[:, :1], cache)]
        stops.clear()
        steps += [ours(ids[:, t : t + 1], positions[:, t : t + 1], cache) for t in range(1, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)
    assert stops  # some token's layers ran from a tie on, by the model's own layers
    assert len(stops) < 23 * len(layers)  # and the step took the rest


def _logits_both_ways(model, ids, split, cache_type=torch.float32):
    step = model.decode_step
    counter = Counting(model)
    with_step = decode(model, ids, split, cache_type)
    assert counter.taken == ids.shape[1] - split
    model.decode_step = None
    without = decode(model, ids, split, cache_type)
    model.decode_step = step
    return with_step, without


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(expected).all()
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


IDS = torch.tensor([[1, 17, 99, 200, 5, 42, 255, 3, 77, 128]])


@pytest.mark.parametrize(
    "types",
    [[T.Q4_0], [T.Q5_0], [T.Q8_0], [T.Q4_K, T.Q6_K, T.Q5_K], [T.F16], [T.Q4_0, T.Q8_0, T.Q5_0]],
    ids=lambda ts: "+".join(t.name for t in ts),
)
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_the_step_equals_the_layers_on_quantized_weights(
    native_kernels, types, activations, tmp_path
):
    if types == [T.F16]:
        hf, config = quant_models.model("qwen2")
        q = write_gguf(tmp_path / "f16.gguf", config, hf.state_dict(), T.F16, tokenizer=False)
    else:
        q, _ = random_block_model("qwen2", types, tmp_path)  # biases, a tied embedding
    model = load_model(q, CPU, "f32").model
    set_activations(model, activations)
    assert_same(*_logits_both_ways(model, IDS, 4))


@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_a_decoded_tokens_logits_come_out_of_the_step(native_kernels, activations, tmp_path):
    """The step takes the final norm and the output matrix too: the head module runs for
    the prompt only, and the logits equal the layers' and the head's own (above)."""
    q, _ = random_block_model("qwen2", [T.Q4_0, T.Q8_0], tmp_path)
    model = load_model(q, CPU, "f32").model
    set_activations(model, activations)
    heads = []
    hook = model.lm_head.register_forward_hook(lambda m, x, y: heads.append(x[0].shape[1]))
    assert_same(*_logits_both_ways(model, IDS, 4))
    hook.remove()
    decoded = IDS.shape[1] - 4
    assert heads == [4] + [4] + [1] * decoded  # with the step, then without it


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_the_step_writes_and_reads_every_cache_type(native_kernels, cache_type, tmp_path):
    q, _ = random_block_model("gemma3", [T.Q8_0, T.Q4_0], tmp_path)  # rings of 5 as well
    model = load_model(q, CPU, "f32").model
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    assert_same(*_logits_both_ways(model, ids, 3, cache_type))


def test_8_bit_activations_decode_as_reference_quantized_activations(native_kernels, tmp_path):
    """With --activations q8, every quantized linear layer of a decoding model gives,
    for the activations it is given, the float64 product of its gguf-dequantized
    weights and those activations quantized by gguf's Q8_0 code, or for K-quants to
    Q8_K by test_q8_kernels' reference (1e-5 of the largest
    output); the step computes what the layers compute (above). Compared call by call,
    as a whole model's logits would differ wherever float rounding upstream moves an
    activation across a quantization step."""
    q, _ = random_block_model("llama", [T.Q4_0, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q5_K], tmp_path)
    model = load_model(q, CPU, "f32").model
    set_activations(model, "q8")
    model.decode_step = None
    calls = []
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    hooks = [m.register_forward_hook(lambda m, x, y: calls.append((m, x[0], y))) for m in layers]
    decode(model, IDS, 4)
    for hook in hooks:
        hook.remove()
    decoded = [(m, x, y) for m, x, y in calls if x.shape[1] == 1]
    assert {m for m, _, _ in decoded} == set(layers)
    for layer, x, y in decoded:
        raw = kernels.unpack(layer.weight, layer.ggml_type) if layer.packed else layer.weight
        w = gguf_dequantize(raw.numpy(), layer.ggml_type).astype(np.float64)
        expected = quantized_activations(x.reshape(1, -1).numpy(), layer.ggml_type) @ w.T
        np.testing.assert_allclose(
            y.reshape(1, -1).numpy(), expected, rtol=0, atol=1e-5 * np.abs(expected).max()
        )


@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("name,windowed", [("qwen2", False), ("gemma3", False), ("gemma3", True)])
def test_batched_rows_through_a_paged_cache_equal_the_layers(
    native_kernels, name, windowed, activations, tmp_path
):
    """serve's decode step: three sequences at their own positions (one past Gemma's
    window of 5), each through its own block table of a paged pool; `windowed`: the
    sliding-window layers in a pool of their own, where the row past its window has
    let go of its first block (scribbled over before the step)."""
    from llmrun.models.paged import PagedKVCache

    q, _ = random_block_model(name, [T.Q4_0, T.Q8_0], tmp_path)
    model = load_model(q, CPU, "f32").model
    set_activations(model, activations)
    like = model.new_cache(1, 1, torch.float32, "cpu")
    lengths = [3, 9, 6]
    tables = [[0, 5], [2, 1, 7], [4, 3]]  # blocks of 4 positions, shuffled
    window_tables = [[1, 6], [3, 0, 5], [7, 2]]
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(5))

    def run(step) -> torch.Tensor:
        model.decode_step = step
        pool = PagedKVCache(like, 8, 4, 32, window_blocks=8 if windowed else 0)
        windows = window_tables if windowed else None
        with torch.no_grad():
            for b, n in enumerate(lengths):  # each prompt alone
                one = [windows[b]] if windowed else None
                model(ids[b : b + 1, :n], torch.arange(n)[None], pool.view([tables[b]], None, one))
            if windowed:  # position 9 attends to 5 .. 9: row 1 lets go of block 3
                windows = [window_tables[0], [-1, 0, 5], window_tables[2]]
                pool.window_k[:, 3] = pool.window_v[:, 3] = 1e3
            rows = torch.tensor(lengths)[:, None]
            step_ids = ids[torch.arange(3), torch.tensor(lengths)][:, None]
            return model(step_ids, rows, pool.view(tables, None, windows))

    step = model.decode_step
    counter = Counting(model)
    with_step = run(counter)
    assert counter.taken == 1
    assert_same(with_step, run(None))
    model.decode_step = step


PAST_THE_CACHE = """
import sys, torch
from llmrun.loading.loader import load_model
from llmrun.models.paged import PagedKVCache
model = load_model(sys.argv[1], torch.device("cpu"), "f32").model
taken, step = [], model.decode_step


def counted(*args, **kwargs):
    out = step(*args, **kwargs)
    taken.append(out is not None)
    return out


model.decode_step = counted
ids = torch.arange(3, 12)[None]
with torch.no_grad():
    cache = model.new_cache(1, 8, torch.float32, "cpu")
    model(ids[:, :4], torch.arange(4)[None], cache)
    for p in range(4, 9):
        try:
            model(ids[:, p : p + 1], torch.tensor([[p]]), cache)
        except (RuntimeError, IndexError):
            print("refused at", p, taken[:5], any(taken[5:]))
    like = model.new_cache(1, 1, torch.float32, "cpu")
    pool = PagedKVCache(like, 4, 4, 32)
    model(ids[:, :4], torch.arange(4)[None], pool.view([[0]]))
    offered = len(taken)
    try:  # position 4 has no block in a table of one
        model(ids[:, 4:5], torch.tensor([[4]]), pool.view([[0]]))
    except (RuntimeError, IndexError):
        print("refused the table", any(taken[offered:]))
    offered = len(taken)
    try:  # block 9 of a pool of 4
        model(ids[:, 4:5], torch.tensor([[4]]), pool.view([[0, 9]]))
    except (RuntimeError, IndexError):
        print("refused the pool", any(taken[offered:]))
"""


def test_a_position_past_the_cache_is_the_layers_to_refuse(native_kernels, tmp_path):
    """The step writes keys and values where the cache's layout says, so a position past
    a contiguous cache's end, or past a paged row's table, would write outside it (a
    crash, or memory overwritten): it leaves such a token to the layers, which refuse
    it. In a process of its own, for the crash it was."""
    import subprocess
    import sys

    q, _ = random_block_model("llama", [T.Q4_0], tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", PAST_THE_CACHE, str(q)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "refused at 8 [False, True, True, True, True] False",  # the prompt, 4..7; then 8
        "refused the table False",
        "refused the pool False",
    ]


def test_the_layers_run_where_the_step_cannot(native_kernels, monkeypatch, tmp_path):
    q, _ = random_block_model("llama", [T.Q4_0], tmp_path)
    model = load_model(q, CPU, "f32").model
    counter = Counting(model)
    cache = model.new_cache(1, 32, torch.float32, "cpu")
    with torch.no_grad():
        model(IDS[:, :4], torch.arange(4)[None], cache)  # a prompt
        model(IDS[:, 4:6], torch.arange(4, 6)[None], cache)  # two tokens of one row
    assert counter.taken == 0
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    assert not decode_step.attach(model)

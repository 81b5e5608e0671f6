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
- Families of Llama's layers with twists (LLAMA_LIKE: Granite 3.x's multipliers,
  SmolLM3's NoPE layers, OLMo 2's and 3's norms after the sublayers and q/k norms over
  the whole projection, OLMo 3's windows): against transformers (1e-4), each twist
  that is a setting shown to move transformers' logits by far more; against their
  layers (1e-6 of the largest logit) with quantized weights (Q8_0; Q4_K, Q6_K, Q5_K;
  Q4_0, Q5_0), f32 and 8-bit activations, every cache type, serve's paged cache.
- Where it cannot go (a batch, a prompt, a mask, LLMRUN_DECODE_STEP=0) the layers run.
"""

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import test_quant_models as quant_models
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gpt_oss_helpers import llmrun_state, tiny_gpt_oss
from helpers import BASE, our_model, tiny_hf_model, write_gguf
from moe_helpers import hub_state_dict, tiny_moe_model
from test_q8_kernels import quantized_activations
from test_quant_blocks import F16_FIELDS
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


def steps_taken_decoding_as_transformers(hf, config: dict) -> int:
    """Asserts that llmrun's model of hf's weights, prefilled with 8 tokens and then
    decoding 4 with the step, gives hf's logits (1e-4); the steps the step took."""
    ours = our_model(config, hf.state_dict())
    assert decode_step.attach(ours)
    counter = Counting(ours)
    ids = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(decode(ours, ids, 8), expected, atol=1e-4, rtol=0)
    return counter.taken


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_step_decodes_as_transformers(native_kernels, name):
    assert steps_taken_decoding_as_transformers(*tiny_hf_model(name)) == FAMILIES[name]


# Llama's layers with a family's twists, as tiny_hf_model("llama", **these): Granite's
# muP multipliers (attention's 0.4, not head_dim^-0.5 = 0.25; the embedding and logits
# ones are the model's torch code, around the step), SmolLM3 with every second layer
# NoPE, OLMo 2 (norms after the sublayers, none before; q/k norms over the whole
# projection), OLMo 3 (OLMo 2 with three sliding-window layers of 5 to a global one,
# those with plain RoPE, the global one with YaRN).
LLAMA_LIKE = {
    "granite": dict(
        model_type="granite",
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.4,
        logits_scaling=2.0,
    ),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, no_rope_layer_interval=2),
    "olmo2": dict(model_type="olmo2"),
    "olmo3": dict(
        model_type="olmo3",
        num_hidden_layers=4,
        sliding_window=5,
        rope_parameters={
            "full_attention": dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            ),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        },
    ),
}
# A twist of the step's undone in the config.
UNDONE = {
    "granite-residual": ("granite", dict(residual_multiplier=1.0)),
    "granite-attention": ("granite", dict(attention_multiplier=16**-0.5)),
    "smollm3-nope": ("smollm3", dict(no_rope_layer_interval=100)),  # every layer rotates
}


@pytest.mark.parametrize("name", list(LLAMA_LIKE))
def test_the_step_decodes_llama_like_families_as_transformers(native_kernels, name):
    hf, config = tiny_hf_model("llama", **LLAMA_LIKE[name])
    assert steps_taken_decoding_as_transformers(hf, config) == 4


@pytest.mark.parametrize("model_type", ["ministral3", "granite"])
def test_a_sliding_window_in_a_llama_like_config_is_kept(native_kernels, model_type):
    """Llama's ModelArgs read sliding_window, and CausalLM.frame masks by it in every
    layer: the step leaves out the same keys (a window of 5 under 14 positions; without
    the window, logits 6 away). 1e-4: under a mask the layers attend through torch's SDPA."""
    hf, config = tiny_hf_model("llama", model_type=model_type, sliding_window=5)
    model = our_model(config, hf.state_dict()).requires_grad_(False)
    assert decode_step.attach(model)
    ids = torch.randint(0, BASE["vocab_size"], (1, 14), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(*_logits_both_ways(model, ids, 3), atol=1e-4, rtol=0)


@pytest.mark.parametrize("undone", list(UNDONE))
def test_each_twist_moves_transformers_logits(undone):
    """Far more than the tolerance: a step that left one out would fail the test above.
    (OLMo's twists are its layers' shape, not settings.)"""
    name, overrides = UNDONE[undone]
    ids = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = tiny_hf_model("llama", **LLAMA_LIKE[name])[0](ids).logits
        undone_logits = tiny_hf_model("llama", **{**LLAMA_LIKE[name], **overrides})[0](ids).logits
    assert (logits - undone_logits)[:, 8:].abs().max() > 0.1


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


def test_experts_of_a_width_the_kernels_do_not_take_stay_with_the_layers(native_kernels):
    """The AVX-512 kernels take F32 rows in blocks of 16 weights: experts 24 wide (rows of
    24 in their down projections) are the layers' there, and decode as transformers does
    (the step read 8 weights past each row and was off by 5 in the logits)."""
    hf, ours = moe_model("qwen3_moe", moe_intermediate_size=24)
    assert decode_step.attach(ours)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(decode(ours, ids, 12), expected, atol=1e-4, rtol=0)


def test_two_threads_taking_their_first_steps_at_once_share_one_description(
    native_kernels, monkeypatch
):
    """serve's scheduler and a run in another thread may take their first steps at
    once. Both described the layers, into one list of what the layers point into, so
    one description lost the experts' tables it points to while the step read them
    (a crashed test worker); now one thread describes and the other waits. Each decodes
    as transformers does."""
    hf, ours = moe_model("qwen3_moe")
    assert decode_step.attach(ours)
    step, mat = ours.decode_step, decode_step._mat
    described = []
    monkeypatch.setattr(
        step, "_describe", lambda: described.append(1) or type(step)._describe(step)
    )
    monkeypatch.setattr(decode_step, "_mat", lambda module: time.sleep(1e-3) or mat(module))
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(decode, ours, ids, 12) for _ in range(2)]
        for run in runs:
            torch.testing.assert_close(run.result(), expected, atol=1e-4, rtol=0)
    assert described == [1]
    kept = {ctypes.addressof(k) for k in step.layers._kept if isinstance(k, decode_step.Moe)}
    assert {layer.moe for layer in step.layers} <= kept


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


# A K-quant's mean 4- or 5-bit quant: its minimum (dmin) times this offsets it.
MEAN_QUANT = {T.Q4_K: 7.5, T.Q5_K: 15.5}


def model_like_blocks(ggml_type: T, rows: int, cols: int, rng) -> np.ndarray:
    """test_quant_models' random blocks, their f16 scales set so the weights look like a
    model's: mean near 0, standard deviation 0.1. (Its K-quants' weights are near 1 or
    more and biased: queries and keys saturate the softmax, where attention's scale and
    RoPE hardly matter.)"""
    raw = quant_models.blocks(ggml_type, rows, cols, rng)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])
    fields = [slice(o, o + 2) for o in F16_FIELDS[ggml_type]]
    if ggml_type in MEAN_QUANT:  # [d, dmin]
        d = blocks[:, fields[0]].copy().view(np.float16).astype(np.float32)
        blocks[:, fields[1]] = (d * MEAN_QUANT[ggml_type]).astype(np.float16).view(np.uint8)
    factor = 0.1 / gguf_dequantize(raw, ggml_type).std()
    for field in fields:
        scale = blocks[:, field].copy().view(np.float16).astype(np.float32) * factor
        blocks[:, field] = scale.astype(np.float16).view(np.uint8)
    return raw


def quantized_model(name: str, types: list[T]):
    """LLAMA_LIKE[name] at test_quant_models' SHAPE (widths of 256s, head_dim 64), every
    matrix (the output too) model_like_blocks of `types` in turn, in QuantLinear layers as
    the loader makes them; the step attached."""
    hf, config = tiny_hf_model("llama", **{**LLAMA_LIKE[name], **quant_models.SHAPE})
    model = our_model(config, hf.state_dict()).requires_grad_(False)
    rng = np.random.default_rng(0)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    for i, (path, linear) in enumerate(linears):
        ggml_type = types[i % len(types)]
        raw = model_like_blocks(ggml_type, linear.out_features, linear.in_features, rng)
        parent, _, child = path.rpartition(".")
        quantized = QuantLinear(torch.from_numpy(raw), ggml_type, linear.in_features, linear.bias)
        setattr(model.get_submodule(parent), child, quantized)
    assert decode_step.attach(model)
    return model


@pytest.mark.parametrize(
    "types",
    [[T.Q8_0], [T.Q4_K, T.Q6_K, T.Q5_K], [T.Q4_0, T.Q5_0]],
    ids=lambda ts: "+".join(t.name for t in ts),
)
@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("name", list(LLAMA_LIKE))
def test_llama_like_families_step_as_their_layers_on_quantized_weights(
    native_kernels, name, types, activations
):
    model = quantized_model(name, types)
    set_activations(model, activations)
    assert_same(*_logits_both_ways(model, IDS, 4))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("name", list(LLAMA_LIKE))
def test_llama_like_families_step_through_every_cache_type(native_kernels, name, cache_type):
    model = quantized_model(name, [T.Q8_0, T.Q4_K])
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
    q, _ = random_block_model(name, [T.Q4_0, T.Q8_0], tmp_path)
    model = load_model(q, CPU, "f32").model
    set_activations(model, activations)
    assert_paged_rows_step_as_the_layers(model, windowed)


@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize(
    "name,windowed", [(name, False) for name in LLAMA_LIKE] + [("olmo3", True)]
)
def test_llama_like_families_step_batched_rows_through_a_paged_cache(
    native_kernels, name, windowed, activations
):
    model = quantized_model(name, [T.Q4_0, T.Q8_0])
    set_activations(model, activations)
    assert_paged_rows_step_as_the_layers(model, windowed)


def assert_paged_rows_step_as_the_layers(model, windowed: bool) -> None:
    """The rows of the test above decoded by the step and by the layers: the same logits
    (assert_same), the step taking the one step."""
    from llmrun.models.paged import PagedKVCache

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

"""One token's chosen experts in one native call (llmrun_matvec_experts,
llmrun.quant.experts.ExpertList) against each expert's own QuantLinear, for every GGML
type and kernel family (conftest.py): the same kernel rows, so the same bits; the
weighted sum to float rounding. With 8-bit activations (llmrun_matvec_experts_q8), the
same against the modules taking them, themselves checked against gguf's quantized
activations (test_q8_kernels.py)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_q8_kernels import random_blocks as q8_random_blocks
from test_quant_linear import TYPES, finite_blocks
from torch import nn

from llmrun import native
from llmrun.models.base import mix_experts, route
from llmrun.quant import kernels
from llmrun.quant.experts import ExpertList
from llmrun.quant.linear import QuantLinear, set_activations

T = GGMLQuantizationType
HIDDEN, WIDTH, EXPERTS = 512, 256, 6


class Expert(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self.act = nn.functional.silu

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def stacked_experts(
    ggml_type: T, down_type: T | None = None, up_type: T | None = None, blocks=finite_blocks
) -> nn.ModuleList:
    """Experts whose projections are views of three stacked tensors of blocks (from
    blocks(type, rows, cols, seed)), as the loader makes them from a GGUF."""
    types = [ggml_type, up_type or ggml_type, down_type or ggml_type]
    stacks = [
        torch.from_numpy(blocks(t, EXPERTS * rows, cols, seed=s)).view(EXPERTS, rows, -1)
        for s, (t, rows, cols) in enumerate(
            zip(types, (WIDTH, WIDTH, HIDDEN), (HIDDEN, HIDDEN, WIDTH), strict=True)
        )
    ]
    return nn.ModuleList(
        Expert(
            *(
                QuantLinear(nn.Parameter(stack[e], requires_grad=False), t, cols)
                for stack, t, cols in zip(stacks, types, (HIDDEN, HIDDEN, WIDTH), strict=True)
            )
        )
        for e in range(EXPERTS)
    )


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_one_call_gives_each_experts_own_products(ggml_type: T, native_kernels: str):
    experts = stacked_experts(ggml_type)
    assert kernels.supports(ggml_type, HIDDEN)  # as ExpertList asks (the i-quants: tables)
    fn = native.library().llmrun_matvec_experts
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1))
    chosen = [4, 0, 5]
    gates = [experts[e].gate_proj.weight for e in chosen]
    addresses = torch.tensor([w.data_ptr() for w in gates], dtype=torch.int64)
    y = torch.empty(3, WIDTH)
    stride = gates[0].stride(0)
    assert fn(int(ggml_type), addresses.data_ptr(), stride, WIDTH, x.data_ptr(), 0, HIDDEN,
              y.data_ptr(), 3) == 0  # fmt: skip
    for j, e in enumerate(chosen):
        assert torch.equal(y[j], experts[e].gate_proj(x)[0])
    # Each its own activation row (x_step), as for the down projections.
    xs = torch.randn(3, WIDTH)
    downs = torch.tensor([experts[e].down_proj.weight.data_ptr() for e in chosen])
    out = torch.empty(3, HIDDEN)
    fn(int(ggml_type), downs.data_ptr(), experts[0].down_proj.weight.stride(0), HIDDEN,
       xs.data_ptr(), WIDTH, WIDTH, out.data_ptr(), 3)  # fmt: skip
    for j, e in enumerate(chosen):
        assert torch.equal(out[j], experts[e].down_proj(xs[j : j + 1])[0])


@pytest.mark.parametrize(
    "ggml_type,down_type,up_type",
    [
        (T.Q4_K, T.Q6_K, None),
        (T.Q8_0, T.Q8_0, None),
        (T.F16, T.F16, None),
        (T.Q4_0, T.Q5_1, None),
        (T.Q4_K, T.Q6_K, T.Q5_K),  # gate and up of different types: a call each
    ],
)
def test_expert_list_mix_matches_the_modules(ggml_type, down_type, up_type, native_kernels):
    experts = stacked_experts(ggml_type, down_type, up_type)
    fused = ExpertList(experts)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(1, HIDDEN, generator=g)
        weights, indices = route(torch.randn(1, EXPERTS, generator=g), 3, normalize=True)
        got = fused.mix(x, weights, indices)
        assert got is not None
        expected = mix_experts(x, weights, indices, experts)  # the modules, one by one
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (fused._plan[2] is None) == (up_type is not None)  # one gate+up call, or two
    # Not for several tokens (the caller groups them), nor for other dtypes.
    assert fused.mix(torch.randn(2, HIDDEN), *route(torch.randn(2, EXPERTS), 2, True)) is None
    assert fused.mix(x.double(), weights, indices) is None
    # The keys stay the experts' own.
    assert list(fused.state_dict()) == list(experts.state_dict())


def moderate_blocks(ggml_type: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks with small scales: finite_blocks' span up to 2^4 gives hidden
    values past what Q8_0's f16 scale holds (max |h| / 127 > 65504)."""
    if ggml_type in (T.F32, T.F16, T.BF16):
        return finite_blocks(ggml_type, rows, cols, seed)
    return q8_random_blocks(ggml_type, rows, cols, np.random.default_rng(seed))


@pytest.mark.parametrize(
    "ggml_type,down_type,up_type",
    [
        (T.Q4_K, T.Q6_K, None),
        (T.Q5_K, T.Q8_0, None),
        (T.Q4_0, T.Q5_0, None),
        (T.MXFP4, T.MXFP4, None),
        (T.Q4_K, T.Q6_K, T.Q5_K),  # gate and up of different types: a call each
        (T.Q4_K, T.F16, None),  # a down projection without a q8 kernel: exact
    ],
)
def test_expert_list_takes_q8_activations_with_its_modules(
    ggml_type, down_type, up_type, native_kernels
):
    experts = stacked_experts(ggml_type, down_type, up_type, moderate_blocks)
    fused = ExpertList(experts)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, HIDDEN, generator=g)
    weights, indices = route(torch.randn(1, EXPERTS, generator=g), 3, normalize=True)
    exact = fused.mix(x, weights, indices)
    assert fused._plan is not None
    set_activations(fused, "q8")  # the modules and the list: bound again
    got = fused.mix(x, weights, indices)
    gate, up, _, down, _ = fused._plan
    assert (gate.q8, up.q8, down.q8) == (True, True, down_type != T.F16)
    expected = mix_experts(x, weights, indices, experts)  # the q8 modules, one by one
    # the weighted sums in another order: float rounding of the largest terms
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert (got - exact).abs().max() > 1e-5 * exact.abs().max()  # not the exact products
    # Each expert's own products, bit for bit: the modules' kernel rows, the same Q8_0.
    chosen = indices[0]
    both = torch.empty(6, WIDTH)
    gate(gate.addresses[chosen], x, 0, both, 3)
    up(up.addresses[chosen], x, 0, both[3:], 3)
    for j, e in enumerate(chosen.tolist()):
        assert torch.equal(both[j], experts[e].gate_proj(x)[0])
        assert torch.equal(both[3 + j], experts[e].up_proj(x)[0])
    set_activations(fused, "f32")
    torch.testing.assert_close(fused.mix(x, weights, indices), exact, rtol=0, atol=0)
    assert not any(stack.q8 for stack in fused._plan[:2])


def test_expert_list_declines_unlike_experts():
    plain = nn.ModuleList(
        Expert(nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 8)) for _ in range(3)
    )
    x = torch.randn(1, 8)
    weights, indices = route(torch.randn(1, 3), 2, normalize=True)
    assert ExpertList(plain).mix(x, weights, indices) is None

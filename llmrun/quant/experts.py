"""A mixture-of-experts block's experts with a one-token path on the native kernels.

ExpertList is the nn.ModuleList of a block's experts (the same children, so the same
state-dict keys), which the loader gives a block whose experts are QuantLinear
modules. Its `mix`, which llmrun.models.base.mix_experts calls, runs one token's
chosen experts in two native calls where the modules would take three QuantLinear
calls an expert (~10-20 us each, as much as the kernel of a small expert): the gate
and up projections of every chosen expert in one llmrun_matvec_experts (one parallel
region over all their rows), act(gate) * up at once (or the experts' own `glu`, and
their biases where they have them: gpt-oss), the down projections in another, then the
weighted sum as one product. Only the chosen experts' weights are read, in
the layout they are stored in. Each expert's products are the ones its QuantLinear
computes (the same kernel rows, one activation row); the weighted sum adds them in
another order than the modules' path, so the two agree to float rounding. Where the
experts' modules take 8-bit activations (set_activations "q8") and the type has such a
kernel, a projection goes through llmrun_matvec_experts_q8 instead: the token's vector
quantized once (Q8_0, or Q8_K for K-quants) for all gate and up projections, each expert's hidden vector
once for its down projection.
"""

from __future__ import annotations

import torch
from torch import nn

from llmrun import native
from llmrun.quant import kernels
from llmrun.quant.linear import QuantLinear

# The (gate, up, down) projections of an expert, by the names its family gives them.
PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("gate", "up", "down"))


class _Stack:
    """One projection of every expert, bound for llmrun_matvec_experts (or, with 8-bit
    activations, llmrun_matvec_experts_q8: `fn`): the type, the row stride, rows and row
    length they share and each expert's weight address."""

    def __init__(self, layers: list[QuantLinear], lib) -> None:
        first = layers[0]
        self.ggml_type, self.rows, self.n = first.ggml_type, first.out_features, first.in_features
        self.stride = first.weight.stride(0)
        self.q8 = all(q.q8_activations for q in layers) and kernels.supports_q8(
            self.ggml_type, self.n
        )
        self.fn = lib.llmrun_matvec_experts_q8 if self.q8 else lib.llmrun_matvec_experts
        self.addresses = torch.tensor([q.weight.data_ptr() for q in layers], dtype=torch.int64)
        # gpt-oss's experts have biases: [experts, rows], added after the products.
        self.biases = (
            None if first.bias is None else torch.stack([q.bias.detach().float() for q in layers])
        )

    def add_bias(self, y: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """y [k, rows] of the chosen experts, plus their biases (in place)."""
        return y if self.biases is None else y.add_(self.biases[chosen])

    def __call__(
        self, addresses: torch.Tensor, x: torch.Tensor, x_step: int, y: torch.Tensor, count: int
    ) -> None:
        """y [count, rows] = the products of the matrices at `addresses` (int64) with x
        (x_step 0: one row for all; else a row each, x_step apart)."""
        if self.fn(self.ggml_type, addresses.data_ptr(), self.stride, self.rows, x.data_ptr(),
                   x_step, self.n, y.data_ptr(), count):  # fmt: skip
            raise MemoryError("no memory for the quantized activations")

    def matches(self, other: _Stack) -> bool:
        return (self.ggml_type, self.stride, self.rows, self.n, self.q8) == (
            other.ggml_type,
            other.stride,
            other.rows,
            other.n,
            other.q8,
        )


def _bindable(layers: list[nn.Module]) -> bool:
    first = layers[0]
    return all(
        isinstance(q, QuantLinear)
        and (q.bias is None) == (first.bias is None)
        and not q.packed
        and q.weight.device.type == "cpu"
        and q.weight.stride(-1) == 1
        and (q.ggml_type, q.in_features, q.out_features, q.weight.stride(0))
        == (first.ggml_type, first.in_features, first.out_features, first.weight.stride(0))
        for q in layers
    ) and kernels.supports(first.ggml_type, first.in_features)


class ExpertList(nn.ModuleList):
    """The experts of one block, with `mix` for one token (None where it does not apply:
    several tokens, a dtype or device the kernels do not take, experts that are not
    all alike QuantLinear modules; the caller then runs the modules)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__(experts)
        self._plan: tuple | None = None
        self._stale = True

    def _apply(self, fn, recurse=True):
        self._stale = True  # .to() and the like may move the weights: bind again
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._stale = True
        return super()._load_from_state_dict(*args, **kwargs)

    def _bind(self) -> tuple | None:
        self._stale = False
        self._plan = None
        lib = native.library()
        names = next((p for p in PROJECTIONS if hasattr(self[0], p[0])), None)
        if lib is None or names is None:
            return None
        stacks = []
        for name in names:
            layers = [getattr(expert, name) for expert in self]
            if not _bindable(layers):
                return None
            stacks.append(_Stack(layers, lib))
        gate, up, down = stacks
        if (up.rows, up.n) != (gate.rows, gate.n) or (down.n, down.rows) != (gate.rows, gate.n):
            return None
        # Gate then up addresses of each expert, so one index gives a call's list; where
        # the two differ in type or layout (some quantization mixes), a call each.
        gate_up = torch.stack([gate.addresses, up.addresses]) if gate.matches(up) else None
        # act(gate) * up, or the family's own combination (gpt-oss: Expert.glu)
        glu = getattr(self[0], "glu", None) or (lambda g, u, act=self[0].act: act(g) * u)
        self._plan = (gate, up, gate_up, down, glu)
        return self._plan

    def mix(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor | None:
        """sum_k weights[0, k] * experts[indices[0, k]](x[0]) for one token x [1, D]."""
        if indices.shape[0] != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        plan = self._bind() if self._stale else self._plan
        if plan is None:
            return None
        gate, up, gate_up, down, glu = plan
        chosen = indices[0]
        k = chosen.numel()
        x = x.contiguous()
        both = torch.empty(2 * k, gate.rows)
        if gate_up is not None:
            gate(gate_up[:, chosen], x, 0, both, 2 * k)  # [2, k] addresses: gates, then ups
        else:
            gate(gate.addresses[chosen], x, 0, both, k)
            up(up.addresses[chosen], x, 0, both[k:], k)
        hidden = glu(gate.add_bias(both[:k], chosen), up.add_bias(both[k:], chosen))  # [k, width]
        hidden = hidden.contiguous()
        out = torch.empty(k, down.rows)
        down(down.addresses[chosen], hidden, down.n, out, k)
        return weights.to(out.dtype) @ down.add_bias(out, chosen)  # [1, k] @ [k, D]


def fuse_experts(model: nn.Module) -> int:
    """Give every mixture-of-experts block (`experts` and `top_k`) of `model` an
    ExpertList; returns how many blocks there were."""
    blocks = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "experts", None), nn.ModuleList) and hasattr(m, "top_k")
    ]
    for block in blocks:
        if not isinstance(block.experts, ExpertList):
            block.experts = ExpertList(block.experts)
    return len(blocks)

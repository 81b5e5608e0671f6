"""A one-sequence decode step through all of a model's decoder layers in one native call
(llmrun/native/decode_step.c), for the families whose layers it knows: Llama (and
Mistral), Ministral 3, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Granite 3.x dense (its
residual multiplier and query scale; its embedding multiplier and logits_scaling stay
in the model's torch code, before and after the step), SmolLM3 (its NoPE layers),
OLMo 2 and OLMo 3 (norms after the sublayers, q/k norms over the whole projection;
OLMo 3's sliding-window layers as Gemma 3's), and the mixture-of-experts Mixtral,
Qwen2-MoE, Qwen3-MoE and gpt-oss.

`attach` (the loader calls it) describes each layer once, as pointers to the weights
the model already holds (QuantLinear blocks in their layout, or f32 nn.Linear weights),
its norms and its attention's settings, and gives the model a `decode_step`. The
model's forward offers it each step (llmrun.models.base.run_layers); it takes the step
where it can: one token of each of one or more sequences, in f32 on CPU, over a
KVCache (with rings: one sequence) or serve's paged cache, and returns None otherwise
(prefill, GPU, ...), when the model's own layers run. Where a router's choice ties,
the step stops before that layer and the model's layers run the rest (torch.topk
breaks ties its own way). It computes what the layers compute with the same kernels
and ops (tests/quant/test_decode_step.py: against the layers, and against
transformers). LLMRUN_DECODE_STEP=0 leaves every step to the
layers.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from llmrun import native, ops
from llmrun.quant import kernels
from llmrun.quant.linear import QuantLinear

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
FAMILIES += ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "ministral3")
FAMILIES += ("seed_oss",)  # Llama with biases
FAMILIES += ("granite", "smollm3", "olmo2", "olmo3")
FAMILIES += ("ministral",)  # Llama with per-layer sliding windows
FAMILIES += ("internlm2",)  # Llama's layers (InternLM3's too; Baichuan 7B's are llama's)
# A layer's norms by the Layer field they fill (input_norm, post_attn_norm, pre_ffn_norm,
# post_ffn_norm), as each family's decoder layer names them; None: no norm there.
PRE_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
FOUR_NORMS = (  # Gemma 2/3: a norm after attention and after the feed-forward too
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
POST_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo
NORMS = {
    "gemma2": FOUR_NORMS,
    "gemma3": FOUR_NORMS,
    "olmo2": POST_NORMS,
    "olmo3": POST_NORMS,
}
ACTS = {F.silu: 0, ops.gelu_tanh: 1}
CLAMPED_SWIGLU = 2  # gpt-oss's experts' glu
ROUTE_SOFTMAX_TOPK, ROUTE_TOPK_SOFTMAX = 0, 1
MAX_TOP_K = 32
# An expert's (gate, up, down) projections, by the names its family gives them.
PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
ROPES = {"full_attention": 0, "sliding_attention": 1}
MATS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class Mat(ctypes.Structure):
    _fields_ = [
        ("w", _PTR),
        ("bias", _PTR),
        ("stride", _I64),
        ("rows", _I64),
        ("cols", _I64),
        ("type", _I32),
        ("q8", _I32),
    ]


class Moe(ctypes.Structure):
    _fields_ = [
        ("addr", _PTR * 3),
        ("bias", _PTR * 3),
        ("stride", _I64 * 3),
        ("type", _I32 * 3),
        ("q8", _I32 * 3),
        ("router", Mat),
        ("shared_gate", Mat),
        ("width", _I64),
        ("experts", _I32),
        ("top_k", _I32),
        ("route", _I32),
        ("normalize", _I32),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("mat", Mat * len(MATS)),
        ("input_norm", _PTR),
        ("post_attn_norm", _PTR),
        ("pre_ffn_norm", _PTR),
        ("post_ffn_norm", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("sinks", _PTR),
        ("moe", _PTR),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("head_bytes", _I64),
        ("ring", _I64),
        ("window", _I64),
        ("norm_offset", _F32),
        ("eps", _F32),
        ("scale", _F32),
        ("softcap", _F32),
        ("alpha", _F32),
        ("limit", _F32),
        ("heads", _I32),
        ("kv_heads", _I32),
        ("head_dim", _I32),
        ("act", _I32),
        ("rope", _I32),
        ("kv_kind", _I32),
        ("kv_group", _I32),
        ("q_norm_width", _I32),
        ("k_norm_width", _I32),
        ("nope", _I32),
        ("query_scale", _F32),
        ("residual", _F32),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("cos", _PTR * 2),
        ("sin", _PTR * 2),
        ("positions", _PTR),
        ("tables", _PTR * 2),
        ("table_width", _I64 * 2),
        ("block_bytes", _I64 * 2),
        ("pool_blocks", _I64 * 2),
        ("block_rows", _I64),
        ("row_bytes", _I64),
        ("capacity", _I64),
        ("rows", _I64),
        ("rotary_dim", _I64),
        ("hidden", _I64),
        ("layers", _I64),
        ("ring_keys", _I64),
        ("final_norm", _PTR),
        ("final_offset", _F32),
        ("final_eps", _F32),
        ("head", Mat),
        ("logits", _PTR),
    ]


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


def _mat(module: nn.Module) -> Mat | None:
    """A matrix as the step takes it, or None where it cannot."""
    bias = getattr(module, "bias", None)
    if isinstance(module, QuantLinear):
        matvec = module._native() if module._stale else module._matvec
        if matvec is None or module.bias is not None and not _f32(module.bias):
            return None
        raw, packed = module.weight, module.packed
        q8 = module.q8_activations and kernels.supports_q8(
            module.ggml_type, module.in_features, packed
        )
        kind = kernels.PACKED[module.ggml_type] if packed else int(module.ggml_type)
        rows, cols = module.out_features, module.in_features
    elif type(module) is nn.Linear and _f32(module.weight) and _f32(bias):
        raw, q8, kind = module.weight, False, 0  # F32 rows
        rows, cols = module.weight.shape
        if not kernels.supports(GGMLQuantizationType.F32, cols):
            return None  # the kernels take whole blocks of 16 weights (an expert 24 wide)
    else:
        return None
    if bias is not None and bias.shape != (rows,):
        return None
    return Mat(
        raw.data_ptr(),
        None if bias is None else bias.data_ptr(),
        raw.stride(0) * raw.element_size(),
        rows,
        cols,
        kind,
        int(q8),
    )


class DecodeStep:
    """The step for one model (see the module's docstring); `invalidate` after its
    weights or their settings change."""

    def __init__(self, model: nn.Module, family: str) -> None:
        self.model, self.family = model, family
        self.layers: Any = None  # the described Layer array, without cache pointers
        # the final norm and output matrix as the step takes them (_describe_head)
        self.head: tuple[Mat, int, float, float] | None = None
        # Per cache (by _cache_key), a copy of it pointing into that cache: serve's
        # scheduler and a run in another thread decode through different caches at once.
        self.bound: dict[tuple, Any] = {}
        self.fn = native.library().llmrun_decode_layers
        # serve's scheduler and a run in another thread may take their first step at
        # once: one describes the layers and binds each cache, the other waits
        self.lock = threading.Lock()
        model.register_load_state_dict_post_hook(lambda *_: self.invalidate())

    def invalidate(self) -> None:
        self.layers, self.bound, self.head = None, {}, None

    def _describe(self) -> Any:
        """The Layer array, without the cache pointers; None where a layer cannot go.
        What it points into (besides the model's tensors) is held in its `_kept`."""
        layers = self.model.model.layers
        array = (Layer * len(layers))()
        kept: list[Any] = []
        offset = 1.0 if self.family.startswith("gemma") else 0.0
        for i, layer in enumerate(layers):
            attn, d = layer.self_attn, array[i]
            ffn = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
            if attn.head_dim % 16 or ffn is None:  # the C vectors take heads of 16s
                return None
            dense = getattr(ffn, "shared_expert", None) if hasattr(ffn, "experts") else ffn
            if hasattr(ffn, "experts") and not self._describe_moe(ffn, d, kept):
                return None
            if not self._describe_act(ffn, dense, d):
                return None
            projections = [getattr(attn, name) for name in MATS[:4]]
            projections += [getattr(dense, name, None) for name in MATS[4:]]
            for j, module in enumerate(projections):
                mat = _mat(module) if module is not None else Mat()
                if mat is None:
                    return None
                d.mat[j] = mat
            norms = [
                None if name is None else getattr(layer, name)
                for name in NORMS.get(self.family, PRE_NORMS)
            ]
            qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
            if not self._describe_qk_norms(attn, qk, d):
                return None
            eps = {n.eps for n in norms + qk if n is not None}
            if len(eps) != 1 or not all(n is None or _f32(n.weight) for n in norms + qk):
                return None
            for field, norm in zip(
                (
                    "input_norm",
                    "post_attn_norm",
                    "pre_ffn_norm",
                    "post_ffn_norm",
                    "q_norm",
                    "k_norm",
                ),
                norms + qk,
                strict=True,
            ):
                setattr(d, field, None if norm is None else norm.weight.data_ptr())
            sinks = getattr(attn, "sinks", None)
            if sinks is not None and not (_f32(sinks) and sinks.shape == (attn.n_heads,)):
                return None
            d.sinks = None if sinks is None else sinks.data_ptr()
            d.norm_offset, d.eps = offset, eps.pop()
            d.scale = getattr(attn, "scale", attn.head_dim**-0.5)
            d.softcap = getattr(attn, "softcap", None) or 0.0
            d.nope = int(not getattr(attn, "use_rope", True))
            d.query_scale = getattr(attn, "query_scale", 1.0)
            residual = getattr(attn, "residual_multiplier", 1.0)
            if getattr(dense, "residual_multiplier", 1.0) != residual:
                return None
            d.residual = residual
            d.heads, d.kv_heads, d.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
            d.rope = ROPES[getattr(attn, "layer_type", "full_attention")]
            d.window = self._window(attn)
        array._kept = kept
        self.head = self._describe_head(offset)
        return array

    def _describe_qk_norms(self, attn: nn.Module, qk: list[nn.Module | None], d: Layer) -> bool:
        """The values each of the q and k norms spans, by its weight's size: a head's
        (Qwen3, Gemma 3) or the whole projection's (OLMo)."""
        for norm, heads, field in zip(
            qk, (attn.n_heads, attn.n_kv_heads), ("q_norm_width", "k_norm_width"), strict=True
        ):
            if norm is not None:
                width = norm.weight.numel()
                if width not in (attn.head_dim, heads * attn.head_dim):
                    return False
                setattr(d, field, width)
        return True

    def _describe_head(self, offset: float) -> tuple[Mat, int, float, float] | None:
        """The final norm and the output matrix (its Mat, the norm's weight address,
        offset and eps), or None where the step cannot take them."""
        head = _mat(self.model.lm_head) if hasattr(self.model, "lm_head") else None
        norm = getattr(self.model.model, "norm", None)
        if head is None or head.bias or norm is None or not _f32(norm.weight):
            return None
        return head, norm.weight.data_ptr(), offset, norm.eps

    def _window(self, attn: nn.Module) -> int:
        """The layer's sliding window as the family's frames mask it (0: none)."""
        window = getattr(self.model.args, "sliding_window", None) or 0
        if self.family in ("gemma2", "gemma3", "gpt_oss", "olmo3", "ministral"):
            return window if attn.layer_type == "sliding_attention" else 0
        return window  # in every layer, as CausalLM.frame and Mixtral's mask it

    def _describe_act(self, ffn: nn.Module, dense: nn.Module | None, d: Layer) -> bool:
        """The feed-forward's gate/up product (its experts' and its dense part's agree)."""
        experts = getattr(ffn, "experts", None)
        first = experts[0] if experts is not None else None
        if first is not None and hasattr(first, "glu"):  # gpt-oss
            if dense is not None:
                return False
            d.act, d.alpha, d.limit = CLAMPED_SWIGLU, first.alpha, first.limit
            return True
        acts = {ACTS.get(getattr(m, "act", None)) for m in (first, dense) if m is not None}
        if len(acts) != 1 or None in acts:
            return False
        d.act = acts.pop()
        return True

    def _describe_moe(self, ffn: nn.Module, d: Layer, kept: list[Any]) -> bool:
        """A mixture-of-experts block into a Moe that d points to (what it points into
        goes to `kept`)."""
        experts = ffn.experts
        names = next((p for p in PROJECTIONS if hasattr(experts[0], p[0])), None)
        router = getattr(ffn, "gate", None) or getattr(ffn, "router", None)
        if names is None or router is None or not 1 <= ffn.top_k <= MAX_TOP_K:
            return False
        moe = Moe()
        for p, name in enumerate(names):
            mats = [_mat(getattr(e, name)) for e in experts]
            if any(m is None for m in mats):
                return False
            first = mats[0]
            shape = (first.type, first.q8, first.stride, first.rows, first.cols)
            if any((m.type, m.q8, m.stride, m.rows, m.cols) != shape for m in mats):
                return False
            addresses = torch.tensor([m.w for m in mats], dtype=torch.int64)
            biases = [getattr(getattr(e, name), "bias", None) for e in experts]
            if biases[0] is not None:
                bias = torch.stack([b.detach().float() for b in biases]).contiguous()
                kept.append(bias)
                moe.bias[p] = bias.data_ptr()
            kept.append(addresses)
            moe.addr[p] = addresses.data_ptr()
            moe.stride[p], moe.type[p], moe.q8[p] = first.stride, first.type, first.q8
            if p == 0:
                moe.width = first.rows
        router_mat = _mat(router)
        if router_mat is None or router_mat.rows != len(experts):
            return False
        moe.router = router_mat
        shared_gate = getattr(ffn, "shared_expert_gate", None)
        if shared_gate is not None:
            gate = _mat(shared_gate)
            if gate is None or gate.rows != 1:
                return False
            moe.shared_gate = gate
        moe.experts, moe.top_k = len(experts), ffn.top_k
        if self.family == "gpt_oss":
            moe.route = ROUTE_TOPK_SOFTMAX
        else:
            moe.route = ROUTE_SOFTMAX_TOPK
            moe.normalize = int(getattr(ffn, "norm_topk_prob", self.family == "mixtral"))
        kept.append(moe)
        d.moe = ctypes.addressof(moe)
        return True

    def _bind_cache(self, cache: Any) -> Any:
        """A copy of the layers pointing each at its part of the cache: row 0 of a
        KVCache, block 0 of its group's paged pool; None for a storage type it does
        not know."""
        kind = ops._KV_KINDS.get(cache.k.dtype)
        if kind is None:
            return None
        layers = type(self.layers)()
        ctypes.memmove(layers, self.layers, ctypes.sizeof(layers))
        layers._kept = self.layers._kept  # what its pointers point into
        for i, d in enumerate(layers):
            if cache.paged:
                k, v, d.kv_group = cache.layer_pool(i)  # [blocks, Hkv, block_rows, width]
                d.head_bytes, d.ring = k.stride(1) * k.element_size(), 0
            else:
                index, ring = cache.index[i], cache.windowed(i)
                k = (cache.ring_k if ring else cache.k)[index, 0]
                v = (cache.ring_v if ring else cache.v)[index, 0]
                d.head_bytes = k.stride(0) * k.element_size()
                d.ring = cache.window if ring else 0
            d.k_cache, d.v_cache = k.data_ptr(), v.data_ptr()
            d.kv_kind = kind
        return layers

    def _layers_for(self, cache: Any) -> Any:
        """The layers bound to `cache` (described and bound the first time), or None."""
        if self.layers is None:
            self.layers, self.bound = self._describe(), {}
            if self.layers is None:
                self.model.decode_step = None  # a layer it cannot take: never again
                return None
        key = self._cache_key(cache)
        layers = self.bound.get(key)
        if layers is None:
            layers = self._bind_cache(cache)
            if layers is None:
                return None
            if len(self.bound) >= 4:  # caches come and go: keep the latest few
                self.bound.pop(next(iter(self.bound)))
            self.bound[key] = layers
        return layers

    def _cache_key(self, cache: Any) -> tuple:
        """What the layers' cache pointers follow from: a new cache at the same addresses
        with the same shapes needs the same pointers."""
        if cache.paged:
            tensors = (cache.k, cache.pool.v, cache.pool.window_k, cache.pool.window_v)
        else:
            tensors = (cache.k, cache.v, cache.ring_k, cache.ring_v)
        return (cache.paged,) + tuple(
            None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors
        )

    def __call__(self, x: torch.Tensor, frames: Any, cache: Any, head: bool = False) -> Any:
        """x [B, 1, hidden] (one token of each of B sequences) through every layer, or
        None where the step cannot take it. With `head`, (that output, the logits [B, 1,
        vocab] of the model's final norm and output matrix), the logits None where the
        step could not take those (the caller applies them)."""
        rows = x.shape[0]
        if (
            cache is None
            or not cache.uniform  # its layers' pointers assume one shape (self.k's)
            or cache.k.device.type != "cpu"
            or x.shape[1] != 1
            or not _f32(x)
            or x.requires_grad
        ):
            return None
        step = Step()
        if cache.paged:
            if cache.counts is not None or cache.tables.shape[0] != rows:
                return None
            step.block_rows = cache.pool.block_rows
            for g, group in enumerate(cache.groups):
                step.tables[g], step.table_width[g] = group.tables.data_ptr(), group.tables.shape[1]
                step.block_bytes[g] = group.k.stride(1) * group.k.element_size()
                step.pool_blocks[g] = group.k.shape[1]
        elif (
            cache.rows is not None
            or cache.k.shape[1] != rows
            or (rows > 1 and cache.ring_k is not None)
        ):
            return None
        else:
            step.row_bytes = cache.k.stride(1) * cache.k.element_size()
            step.capacity = cache.max_seq_len
        kinds = frames if isinstance(frames, dict) else {"full_attention": frames}
        full, local = kinds.get("full_attention"), kinds.get("sliding_attention", None)
        frame = full or local
        positions = frame.positions
        if positions.shape != (rows, 1) or positions.dtype != torch.int64:
            return None
        limit = getattr(self.model, "step_positions", None)  # positions it may take
        if limit is not None and int(positions.max()) >= limit:
            return None
        for name, f in kinds.items():
            cos, sin = f.cos, f.sin
            if not (_f32(cos) and _f32(sin)) or cos.numel() != rows * cos.shape[-1]:
                return None
            step.cos[ROPES[name]], step.sin[ROPES[name]] = cos.data_ptr(), sin.data_ptr()
        for name in ROPES:  # a family with one kind of layer: both slots the same
            if name not in kinds:
                other = ROPES[next(iter(kinds))]
                step.cos[ROPES[name]], step.sin[ROPES[name]] = step.cos[other], step.sin[other]
        if local is not None and local.plan is not None:  # a KVCache's rings
            if not local.plan.decode or local.plan.mask is not None:
                return None
            step.ring_keys = local.plan.keys
        with self.lock:
            layers = self._layers_for(cache)
        if layers is None:
            return None
        positions = positions.reshape(rows).contiguous()
        step.positions, step.rows = positions.data_ptr(), rows
        step.rotary_dim = frame.cos.shape[-1]
        step.hidden, step.layers = x.shape[-1], len(self.layers)
        logits = None
        if head and self.head is not None and (self.head[0].q8 or rows == 1):
            mat, step.final_norm, step.final_offset, step.final_eps = self.head
            step.head = mat
            logits = torch.empty(rows, 1, mat.rows)
            step.logits = logits.data_ptr()
        out = x.clone()
        done = self.fn(ctypes.addressof(layers), ctypes.addressof(step), out.data_ptr())
        if done < 0:
            return None
        if done < len(self.layers):  # a router's tie: torch.topk's to break
            logits = None
            for layer in self.model.model.layers[done:]:
                out = layer(out, frames, cache)
        return (out, logits) if head else out


def attach(model: nn.Module) -> bool:
    """Give `model` a DecodeStep where its family is one the step knows and the native
    kernels are built; says whether it did."""
    family = type(model).__module__.rpartition(".")[2]
    lib = native.library()
    if (
        family not in FAMILIES
        or lib is None
        or not hasattr(lib, "llmrun_decode_layers")
        or os.environ.get("LLMRUN_DECODE_STEP", "1") == "0"
    ):
        return False
    model.decode_step = DecodeStep(model, family)
    return True

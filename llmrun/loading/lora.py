"""LoRA adapters: read one and add it to a loaded model's linear layers.

An adapter is a GGUF as llama.cpp's convert_lora_to_gguf.py writes it (general.type
"adapter", adapter.type "lora", adapter.lora.alpha, tensors NAME.lora_a [rank, in] and
NAME.lora_b [out, rank] under the model's GGUF names) or a PEFT folder
(adapter_config.json and adapter_model.safetensors under HF names). Each targeted layer
becomes a LoraLinear: base(x) + scale * B(A(x)), the base layer kept as it is (quantized
blocks stay quantized), as llama.cpp applies adapters (llm_graph_context::build_lora_mm).
A GGUF adapter's scale is SCALE * alpha / rank (SCALE alone where alpha is 0,
llama_adapter_lora_weight::get_scale); a PEFT adapter's is SCALE * lora_alpha / r, or
/ sqrt(r) with use_rslora, as PEFT computes it. SCALE is the adapter's in the model's
LoraScales: one per adapter for every forward (run, chat), or one per batch row for the
forward in flight (serve's per-request scales, set with `scaled`).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, Keys
from torch import nn

from llmrun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError, UsageError
from llmrun.loading import gguf_config, gguf_io, safetensors_io
from llmrun.loading.inspect import LORA_ADAPTER
from llmrun.quant import blocks

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = LORA_ADAPTER
PEFT_PREFIX = "base_model.model."
# PEFT settings that change what the adapter computes, which llmrun does not run: a
# setting -> what it is, refused where the config sets it.
PEFT_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "fan_in_fan_out": "Conv1D weights (fan_in_fan_out)",
    "lora_bias": "LoRA biases (lora_bias)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "replicated layers (layer_replication)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
}

# Layers whose model reads their weight directly rather than calling them (DeepSeek's
# MLA absorbs kv_b_proj into its queries and outputs).
DIRECT_WEIGHTS = ("kv_b_proj",)


@dataclass
class LoraWeight:
    """One layer's pair: down [rank, in] and up [out, rank], with the factor the adapter's
    settings put on their product (alpha / rank), which the adapter's scale multiplies."""

    down: torch.Tensor
    up: torch.Tensor
    factor: float


@dataclass
class Adapter:
    """An adapter read from `path` at `scale`: its pairs under the model's module names,
    and a GGUF adapter's task name and prompt prefix (which llama-server lists)."""

    path: Path
    scale: float = 1.0
    weights: dict[str, LoraWeight] = field(default_factory=dict)
    task_name: str = ""
    prompt_prefix: str = ""


class LoraScales:
    """The scales of a model's adapters, by id (their order at load): `scales` apply to
    every forward, unless a forward's batch rows have scales of their own (`scaled`, on
    that forward's thread alone: serve's embeddings run beside its scheduler)."""

    def __init__(self, adapters: Sequence[Adapter]) -> None:
        self.adapters = [replace(a, weights={}) for a in adapters]  # what they are, by id
        self.scales = [a.scale for a in adapters]
        # .rows, per adapter: the scale of this thread's forward in flight, a float where
        # every row has the same, else a tensor [batch].
        self.local = threading.local()

    def __len__(self) -> int:
        return len(self.adapters)

    def current(self) -> list[float | torch.Tensor]:
        rows = getattr(self.local, "rows", None)
        return self.scales if rows is None else rows


@contextmanager
def scaled(
    lora: LoraScales | None, rows: Sequence[Sequence[float]], device: torch.device
) -> Iterator[None]:
    """The forwards inside run batch row i with adapter j at scale rows[i][j] (serve's
    requests, each with its own scales); nothing changes for a model without adapters."""
    if lora is None:
        yield
        return
    columns: list[float | torch.Tensor] = []
    for column in zip(*rows, strict=True):
        same = all(s == column[0] for s in column)
        columns.append(float(column[0]) if same else torch.tensor(column, device=device))
    lora.local.rows = columns
    try:
        yield
    finally:
        lora.local.rows = None


class LoraLinear(nn.Module):
    """A linear layer (nn.Linear, QuantLinear, ...) with LoRA pairs added to its output:
    base(x) + sum of scale * factor * (x A^T) B^T, each pair's scale its adapter's in
    `lora`. The base layer is untouched."""

    def __init__(self, base: nn.Module, lora: LoraScales) -> None:
        super().__init__()
        self.base = base
        self.lora = lora
        self.in_features, self.out_features = base.in_features, base.out_features
        self.downs = nn.ParameterList()
        self.ups = nn.ParameterList()
        self.factors: list[float] = []
        self.ids: list[int] = []  # each pair's adapter

    def add(self, weight: LoraWeight, adapter_id: int) -> None:
        self.downs.append(nn.Parameter(weight.down, requires_grad=False))
        self.ups.append(nn.Parameter(weight.up, requires_grad=False))
        self.factors.append(weight.factor)
        self.ids.append(adapter_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        scales = self.lora.current()
        for down, up, factor, i in zip(self.downs, self.ups, self.factors, self.ids, strict=True):
            scale = scales[i]
            if not isinstance(scale, torch.Tensor):
                if scale != 0:  # a scale of 0 leaves the base's output exactly
                    y = y + scale * factor * F.linear(F.linear(x, down), up)
                continue
            low = F.linear(x, down)  # [batch, ..., rank], or [batch * T, rank] flattened
            per_row = (scale * factor).to(low.dtype)
            if low.shape[0] != per_row.shape[0]:  # rows flattened batch-major by reshape
                per_row = per_row.repeat_interleave(low.shape[0] // per_row.shape[0])
            y = y + F.linear(low * per_row.view(-1, *[1] * (low.dim() - 1)), up)
        return y

    def extra_repr(self) -> str:
        ranks = ", ".join(str(d.shape[0]) for d in self.downs)
        return f"lora ranks={ranks}, adapters={self.ids}, factors={self.factors}"


def parse_spec(spec: str) -> tuple[str, float]:
    """`--lora-scaled PATH:SCALE` -> (PATH, SCALE); the scale follows the last colon."""
    path, sep, scale = spec.rpartition(":")
    try:
        value = float(scale)
    except ValueError:
        value = None
    if not sep or not path or value is None or not math.isfinite(value):
        raise UsageError(
            f"--lora-scaled {spec}: expected PATH:SCALE, a path and a number after its last colon"
        )
    return path, value


def read_adapter(
    path: str | Path,
    scale: float,
    config: dict[str, Any],
    architecture: str | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Adapter:
    """The adapter at `path` (a GGUF file or a PEFT folder) for a model of `config`
    (`architecture`: its GGUF's, None for an HF folder), its tensors in `dtype` on `device`."""
    path = Path(path).expanduser()
    if path.is_dir():
        adapter = _read_peft(path, scale)
    elif path.is_file():
        adapter = _read_gguf(path, scale, config, architecture)
    else:
        raise ModelNotFoundError(f"LoRA adapter {path}: no such file or directory")
    for w in adapter.weights.values():
        w.down = w.down.to(device=device, dtype=dtype, copy=True)
        w.up = w.up.to(device=device, dtype=dtype, copy=True)
    return adapter


def _read_gguf(
    path: Path, scale: float, config: dict[str, Any], architecture: str | None
) -> Adapter:
    """A GGUF adapter, checked as llama.cpp checks it (llama_adapter_lora_init_impl)."""
    gg = gguf_io.read_gguf(path)
    kind, adapter_type = gg.get(Keys.General.TYPE), gg.get(Keys.Adapter.TYPE)
    if kind != "adapter" or adapter_type != "lora":
        raise ModelFormatError(
            f"{path}: not a LoRA adapter ({Keys.General.TYPE} is {kind!r}, "
            f"{Keys.Adapter.TYPE} {adapter_type!r}; expected 'adapter' and 'lora')"
        )
    if gg.get(Keys.Adapter.ALORA_INVOCATION_TOKENS) is not None:
        raise UnsupportedError(f"{path}: activated LoRA (aLoRA) adapters are not supported")
    arch = gg.architecture
    model_type = config["model_type"]
    if architecture is not None:
        matches = arch == architecture
    else:
        matches = gguf_config.MODEL_TYPES.get(arch) == model_type or (
            arch == "llama" and model_type == "mistral"  # llama.cpp converts Mistral as Llama
        )
    if not matches:
        raise UnsupportedError(
            f"{path}: a LoRA adapter for {arch}, but the model is {architecture or model_type}"
        )
    alpha = gg.get(Keys.Adapter.LORA_ALPHA, 0.0)
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ModelFormatError(f"{path}: {Keys.Adapter.LORA_ALPHA} is {alpha!r}, not a number")
    task_name, prompt_prefix = (
        _text(gg, key) for key in (Keys.Adapter.LORA_TASK_NAME, Keys.Adapter.LORA_PROMPT_PREFIX)
    )
    adapter = Adapter(path, scale, task_name=task_name, prompt_prefix=prompt_prefix)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    skipped = []
    for name, info in gg.tensors.items():
        base, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            if name.endswith("_norm.weight"):
                skipped.append(name)  # mergekit's norms: llama.cpp skips them too
                continue
            raise ModelFormatError(f"{path}: tensor {name!r} is not a .lora_a or .lora_b tensor")
        pairs.setdefault(base, {})[part] = _gguf_tensor(gg, info)
    if skipped:
        print(
            f"note: {path}: {len(skipped)} norm weights ({skipped[0]}, ...) are not applied "
            "(llama.cpp skips them too)",
            file=sys.stderr,
        )
    for base, pair in pairs.items():
        if len(pair) != 2:
            raise ModelFormatError(f"{path}: tensor {base!r} has a lora_a or a lora_b, not both")
        hf = gguf_config.hf_name(base, model_type)
        if hf is None or not hf.endswith(".weight"):
            raise UnsupportedError(f"{path}: tensor {base!r} is not part of llmrun's {model_type}")
        if "{expert}" in hf:
            raise UnsupportedError(f"{path}: LoRA on stacked experts ({base}) is not supported")
        module = hf.removesuffix(".weight")
        down, up = pair["lora_a"], pair["lora_b"]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise ModelFormatError(
                f"{path}: {base}: lora_a {list(down.shape)} and lora_b {list(up.shape)} are not "
                "[rank, in] and [out, rank]"
            )
        up = _unpermute(up, module, arch, config, path)
        rank = down.shape[0]
        adapter.weights[module] = LoraWeight(down, up, alpha / rank if alpha else 1.0)
    return adapter


def _text(gg: gguf_io.GGUFFile, key: str) -> str:
    value = gg.get(key, "")
    if not isinstance(value, str):
        raise ModelFormatError(f"{gg.path}: {key} is {value!r}, not a string")
    return value


def _gguf_tensor(gg: gguf_io.GGUFFile, info: gguf_io.GGUFTensorInfo) -> torch.Tensor:
    """A float copy of an adapter tensor (float or quantized blocks)."""
    if info.ggml_type not in FLOAT_TYPES and info.ggml_type not in blocks.SUPPORTED_TYPES:
        raise UnsupportedError(
            f"{gg.path}: tensor {info.name!r} has type {info.ggml_type.name}, which llmrun "
            "does not read"
        )
    tensor = gguf_io.load_tensor(gg, info)
    if info.ggml_type in FLOAT_TYPES:
        return tensor.float()
    return blocks.dequantize(tensor, info.ggml_type).reshape(info.shape)


def _unpermute(
    up: torch.Tensor, module: str, arch: str, config: dict[str, Any], path: Path
) -> torch.Tensor:
    """lora_b of a q or k projection the converter permuted as it permutes the model's
    weights (the product's rows are lora_b's), back in HF's order."""
    if arch not in gguf_config.QK_PERMUTED_ARCHS:
        return up
    if module.endswith("q_proj"):
        heads = config["num_attention_heads"]
    elif module.endswith("k_proj"):
        heads = config["num_key_value_heads"]
    else:
        return up
    try:
        return gguf_io.unpermute_rows(up, heads)
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {module} lora_b: {e}") from None


def _read_peft(path: Path, scale: float) -> Adapter:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)."""
    config_file, weights_file = path / PEFT_CONFIG, path / PEFT_WEIGHTS
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path}: no {PEFT_CONFIG}: not a PEFT adapter folder")
    if not weights_file.is_file():
        pickled = (
            " (adapter_model.bin, a pickle, is not read)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise ModelNotFoundError(f"{path}: no {PEFT_WEIGHTS}{pickled}")
    settings = safetensors_io.read_json(config_file)
    if settings.get("peft_type", "LORA") != "LORA":
        raise UnsupportedError(
            f"{config_file}: a {settings['peft_type']} adapter; only LoRA is supported"
        )
    for key, what in PEFT_UNSUPPORTED.items():
        if settings.get(key):
            raise UnsupportedError(f"{config_file}: {what} is not supported")
    alpha = settings.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ModelFormatError(f"{config_file}: lora_alpha is {alpha!r}, not a number")
    rslora = bool(settings.get("use_rslora"))
    tensors = safetensors_io.load_tensors(weights_file)
    for name in tensors:  # named first: such an adapter also saves its base layers
        if "lora_embedding_" in name:
            raise UnsupportedError(f"{weights_file}: LoRA on embeddings ({name}) is not supported")
        if "lora_magnitude_vector" in name:
            raise UnsupportedError(f"{weights_file}: DoRA ({name}) is not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.endswith(".base_layer.weight"):
            continue  # the base's own weights, saved beside a LoRA on the output head
        module, _, part = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise UnsupportedError(
                f"{weights_file}: tensor {name!r} is not a LoRA pair's lora_A or lora_B weight"
            )
        pairs.setdefault(module, {})[part[0]] = tensor.float()
    adapter = Adapter(path, scale)
    for module, pair in pairs.items():
        if len(pair) != 2:
            raise ModelFormatError(f"{weights_file}: {module} has a lora_A or lora_B, not both")
        down, up = pair["A"], pair["B"]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise ModelFormatError(
                f"{weights_file}: {module}: lora_A {list(down.shape)} and lora_B "
                f"{list(up.shape)} are not [r, in] and [out, r]"
            )
        rank = down.shape[0]
        factor = alpha / math.sqrt(rank) if rslora else alpha / rank
        adapter.weights[module] = LoraWeight(down, up, factor)
    return adapter


def apply_adapters(model: nn.Module, adapters: list[Adapter]) -> LoraScales | None:
    """Wrap each layer the adapters target in a LoraLinear (one per layer, every
    adapter's pair in it); the adapters' scales, which those layers read (None without
    adapters). Refuses a target that is not a decoder layer's linear layer (embeddings,
    the output head, experts, routers) or whose shapes differ."""
    if not adapters:
        return None
    lora = LoraScales(adapters)
    for adapter_id, adapter in enumerate(adapters):
        for name, weight in adapter.weights.items():
            parent_name, _, child = name.rpartition(".")
            try:
                parent = model.get_submodule(parent_name)
                module = getattr(parent, child)
            except AttributeError:
                module = None
            where = f"LoRA adapter {adapter.path}: {name}"
            if module is None:
                family = type(model).__module__.rpartition(".")[2]
                raise UnsupportedError(f"{where}: llmrun's {family} model has no such layer")
            if not name.startswith("model.layers."):
                raise UnsupportedError(
                    f"{where}: not supported (only the decoder layers' linear layers take LoRA)"
                )
            if ".experts." in name or hasattr(parent, "experts"):
                raise UnsupportedError(f"{where}: LoRA on experts and routers is not supported")
            if child in DIRECT_WEIGHTS:
                raise UnsupportedError(f"{where}: LoRA on {child} is not supported")
            if not isinstance(module, LoraLinear):
                if not hasattr(module, "in_features") or not hasattr(module, "out_features"):
                    raise UnsupportedError(f"{where}: {type(module).__name__} is not linear")
                module = LoraLinear(module, lora)
                setattr(parent, child, module)
            shape = (module.out_features, module.in_features)
            if (weight.up.shape[0], weight.down.shape[1]) != shape:
                raise ModelFormatError(
                    f"{where}: the adapter's product is [{weight.up.shape[0]}, "
                    f"{weight.down.shape[1]}], the model's layer {list(shape)}: an adapter "
                    "for another model?"
                )
            module.add(weight, adapter_id)
    # The native decode step reads the layers' weights, not their modules: it would
    # leave the adapters out.
    model.decode_step = None
    return lora

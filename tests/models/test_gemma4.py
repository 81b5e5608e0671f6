"""Gemma 4 against transformers' Gemma4ForCausalLM, from a config.json (text-only, and a
Gemma4ForConditionalGeneration folder with its towers) and from a "gemma4" GGUF written
as llama.cpp's converter writes it (conversion/gemma.py Gemma4Model: Gemma 3's keys with
the norms unshifted; key_length the global heads', key_length_swa the local ones', KV
heads per layer; the window flags, shared KV layers, per-layer width, per-layer
feed-forward widths; rope_freqs of 1 and 1e30; gguf's own tensor name map, the experts
stacked with gate and up fused, the router's and experts' scales as .scale tensors, the
layer scalars as layer_output_scale.weight; the sharing layers' unused keys written).

Two models. "e2b": 7 layers (local, local, global, local, global, then a local and a
global sharing layers 3 and 4's keys, their feed-forwards twice as wide), local heads of
16 with RoPE base 1000, global ones of 32 with proportional RoPE (a quarter of the
frequencies turning, base 10000), per-layer inputs of 32, windows of 5 under prompts of
40, a soft-cap of 10. "moe": 4 layers, experts (4, top 2, 32 wide) beside the dense
feed-forward, global layers with values from the keys and two KV heads (local layers 4):
the cache holds each layer in its own shape (test_the_cache_holds_each_layer_in_its_own_shape).
Every layer scalar is 0.7. Each feature moves transformers' logits by far more than the
tolerance (test_each_feature_moves_the_logits).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous, in rings
or paged. The q and k norms are drawn at half the size randomize() gives (0.5 * (1 +
N(0, 0.1))): Gemma 4 leaves scores unscaled, and at full size the softmax is so sharp
that transformers' own eager and SDPA paths differ by 2e-4. A typed cache: 1e-5 against
an f32 cache storing the values rounded to the type, and DRIFT from f32 (q8_0: the forms
with heads of 32 and 64, its blocks of 32 running along each layer's heads). A Q8_0 GGUF
(matrices of whole blocks; the rest F32) against transformers run on the weights gguf
dequantizes: 1e-4.
"""

import json

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_served_as_alone,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize

from llmrun import api, static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.models.paged import PagedKVCache
from llmrun.quant import decode_step
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
S, F = "sliding_attention", "full_attention"
ROPE = {
    F: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=10000.0),
    S: dict(rope_type="default", rope_theta=1000.0),
}
E2B = dict(
    BASE,
    model_type="gemma4_text",
    head_dim=16,
    global_head_dim=32,
    num_hidden_layers=7,
    layer_types=[S, S, F, S, F, S, F],
    sliding_window=5,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=32,
    vocab_size_per_layer_input=BASE["vocab_size"],
    final_logit_softcapping=10.0,
    rope_parameters=ROPE,
)
MOE = dict(
    BASE,
    model_type="gemma4_text",
    head_dim=16,
    global_head_dim=32,
    num_hidden_layers=4,
    layer_types=[S, F, S, F],
    sliding_window=5,
    num_key_value_heads=4,
    attention_k_eq_v=True,
    num_global_key_value_heads=2,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    final_logit_softcapping=10.0,
    rope_parameters=ROPE,
)
FORMS = {"e2b": E2B, "moe": MOE}
GLOBAL_DIM = 32  # both forms' global_head_dim


def form(config) -> str:
    """Which of FORMS a transformers config is (its global KV heads are not kept)."""
    return "moe" if config.enable_moe_block else "e2b"


SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: e2b f16 1.5e-2, bf16 8.6e-2; moe f16
# 3.8e-3, bf16 2.1, where the rounding flips a router's choice of experts; q8_0 (the
# forms with Q8_0_WIDTHS) e2b 0.19, moe 0.15.
DRIFT = {
    "e2b": {"f16": 5e-2, "bf16": 0.3, "q8_0": 1.0},
    "moe": {"f16": 2e-2, "bf16": 5.0, "q8_0": 1.0},
}
Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q8_0_WIDTHS = dict(head_dim=32, global_head_dim=64)  # a q8_0 cache's heads: blocks of 32
TOWERS = ("model.vision_tower.conv.weight", "model.audio_tower.conv.weight",
          "model.embed_vision.embedding.weight", "model.embed_audio.embedding.weight")  # fmt: skip


def hf_model(config: dict, seed: int = 0):
    """transformers' model of `config` with randomize()'s weights (norms and the router's
    scales near 1; q and k norms at half that, see the module's note), layer scalars 0.7."""
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    # Its per-layer head widths make config.head_dim ambiguous; the local layers' is read.
    model.config.allow_global_per_layer_attribute_access = True
    randomize(model, {"q_norm.weight": 0.5, "k_norm.weight": 0.5})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                p.normal_(1.0, 0.1)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.7)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf, config: dict | None = None) -> torch.nn.Module:
    """llmrun's model of `hf`, its stacked experts split as the loader splits them."""
    state = dict(hf.state_dict())
    for name in [n for n in state if n.endswith("experts.gate_up_proj")]:
        prefix, stack = name.removesuffix("gate_up_proj"), state.pop(name)
        gate, up = stack.chunk(2, dim=1)
        down = state.pop(prefix + "down_proj")
        for e in range(stack.shape[0]):
            state[f"{prefix}{e}.gate_proj.weight"] = gate[e]
            state[f"{prefix}{e}.up_proj.weight"] = up[e]
            state[f"{prefix}{e}.down_proj.weight"] = down[e]
    return our_model(config or hf.config.to_dict(), state)


@pytest.fixture(scope="module", params=list(FORMS))
def family(request):
    hf = hf_model(FORMS[request.param])
    return request.param, hf, reference(hf)


@pytest.fixture(scope="module")
def e2b():
    hf = hf_model(E2B)
    return hf, reference(hf)


def sharing_kv(hf, seed: int = 7) -> dict[str, torch.Tensor]:
    """Key and value weights for the sharing layers, which a checkpoint may hold (and
    transformers ignores): random, so reading them would show."""
    config = hf.config
    first = config.num_hidden_layers - config.num_kv_shared_layers
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(first, config.num_hidden_layers):
        dim = GLOBAL_DIM if config.layer_types[i] == F else config.head_dim
        for proj in ("k_proj", "v_proj"):
            shape = (config.num_key_value_heads * dim, config.hidden_size)
            out[f"model.layers.{i}.self_attn.{proj}.weight"] = torch.randn(
                shape, generator=generator
            )
        out[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.randn(dim, generator=generator)
    return out


def converter_keys(config) -> dict:
    """The metadata Gemma4Model (and the Gemma3Model and TextModel it extends) writes."""
    k, layers = gguf.Keys, config.num_hidden_layers
    first = layers - config.num_kv_shared_layers
    widths = [config.intermediate_size * (2 if i >= first else 1) for i in range(layers)]
    kv = config.num_key_value_heads
    global_kv = FORMS[form(config)].get("num_global_key_value_heads")
    return {
        k.LLM.BLOCK_COUNT: layers,
        k.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        k.LLM.EMBEDDING_LENGTH: config.hidden_size,
        k.LLM.FEED_FORWARD_LENGTH: widths if config.use_double_wide_mlp else widths[0],
        k.Attention.HEAD_COUNT: config.num_attention_heads,
        k.Attention.HEAD_COUNT_KV: kv
        if global_kv is None
        else [kv if t == S else global_kv for t in config.layer_types],
        k.Rope.FREQ_BASE: config.rope_parameters[F]["rope_theta"],
        k.Rope.FREQ_BASE_SWA: config.rope_parameters[S]["rope_theta"],
        k.Attention.LAYERNORM_RMS_EPS: config.rms_norm_eps,
        k.LLM.EXPERT_COUNT: config.num_experts,
        k.LLM.EXPERT_USED_COUNT: config.top_k_experts,
        k.LLM.FINAL_LOGIT_SOFTCAPPING: config.final_logit_softcapping,
        k.Attention.SLIDING_WINDOW: config.sliding_window,
        k.Attention.SHARED_KV_LAYERS: config.num_kv_shared_layers,
        k.LLM.EMBD_LENGTH_PER_LAYER_INP: config.hidden_size_per_layer_input or 0,
        k.Attention.SLIDING_WINDOW_PATTERN: [t == S for t in config.layer_types],
        k.Attention.KEY_LENGTH: GLOBAL_DIM,
        k.Attention.VALUE_LENGTH: GLOBAL_DIM,
        k.Attention.KEY_LENGTH_SWA: config.head_dim,
        k.Attention.VALUE_LENGTH_SWA: config.head_dim,
        k.LLM.EXPERT_FEED_FORWARD_LENGTH: config.moe_intermediate_size,
        k.Rope.DIMENSION_COUNT: GLOBAL_DIM,
        k.Rope.DIMENSION_COUNT_SWA: config.head_dim,
    }


def converter_tensors(hf) -> dict[str, np.ndarray]:
    """The tensors Gemma4Model writes: by gguf's name map, norms as they are, the layer
    scalars, the router's and experts' scales, the experts' stacks (gate_up fused), the
    sharing layers' keys and values, rope_freqs; no lm_head (tied)."""
    config = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers)
    state = {**hf.state_dict(), **sharing_kv(hf)}
    del state["lm_head.weight"]
    out = {}
    for name, tensor in state.items():
        data = np.ascontiguousarray(tensor.float().numpy())
        if name.endswith("router.scale"):
            out[names.get_name(name.removesuffix(".scale") + ".proj") + ".scale"] = data
        elif name.endswith("router.per_expert_scale"):
            layer = name.removesuffix("router.per_expert_scale") + "experts.down_proj"
            out[names.get_name(layer) + ".scale"] = data
        else:
            out[names.get_name(name.removesuffix(".weight")) + ".weight"] = data
    dim = GLOBAL_DIM
    turned = int(config.rope_parameters[F]["partial_rotary_factor"] * dim // 2)
    out["rope_freqs.weight"] = np.array([1.0] * turned + [1e30] * (dim // 2 - turned), np.float32)
    return out


def write_gemma4_gguf(path, hf, qtype=None, keys=None, drop=()):
    """The model as llama.cpp's converter writes it; `keys` overrides converter_keys (None
    leaves one out), `drop` leaves tensors out."""
    tensors = {k: v for k, v in converter_tensors(hf).items() if k not in drop}
    keys = {**converter_keys(hf.config), **(keys or {})}
    return write_keyed_gguf(path, "gemma4", keys, tensors, qtype, whole_blocks=True)


def dequantized(hf, qtype):
    """`hf` with the weights a `qtype` GGUF holds: its matrices (and expert stacks) of
    whole blocks a row rounded, the routers kept (write_keyed_gguf keeps them F32)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and "router" not in name and p.shape[-1] % 32 == 0:
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).view(p.shape))
    return hf


def save_multimodal(hf, path):
    """A Gemma4ForConditionalGeneration folder as the Hub has them: the text config under
    text_config with global_head_dim (not per_layer_config), the language model under
    model.language_model., the towers' tensors, no lm_head (tied)."""
    path.mkdir()
    text = {k: v for k, v in hf.config.to_dict().items() if k != "per_layer_config"}
    text["global_head_dim"] = GLOBAL_DIM
    text["num_global_key_value_heads"] = FORMS[form(hf.config)].get("num_global_key_value_heads")
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "gemma4_vision"}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    state = {**hf.state_dict(), **sharing_kv(hf)}
    del state["lm_head.weight"]
    tensors = {f"model.language_model.{k[len('model.') :]}": v for k, v in state.items()}
    tensors.update({name: torch.randn(4, 4) for name in TOWERS})
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                str(path / "model.safetensors"))  # fmt: skip
    return path


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    """transformers 5.25's saved config (per_layer_config) and the Hub's form
    (global_head_dim, num_global_key_value_heads) read alike."""
    name, hf, expected = family
    assert expected.abs().max() > 3
    saved = hf.config.to_dict()
    assert "per_layer_config" in saved
    for config in (saved, FORMS[name]):
        model = ours(hf, config)
        check_whole_and_cached(model, IDS, expected)


def test_a_gguf_matches_transformers(family, tmp_path):
    name, hf, expected = family
    loaded = load_model(write_gemma4_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "gemma4_text"
    assert config["layer_types"] == hf.config.layer_types
    args = loaded.model.args
    assert args.layer_head_dims == [GLOBAL_DIM if t == F else 16
                                    for t in hf.config.layer_types]  # fmt: skip
    assert args.attention_k_eq_v == (name == "moe")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_fused_and_split_expert_stacks_load_alike(tmp_path):
    """The converter's fused ffn_gate_up_exps, and ffn_gate_exps + ffn_up_exps (which
    llama.cpp also reads)."""
    hf = hf_model(MOE)
    tensors = converter_tensors(hf)
    for name in [n for n in tensors if "ffn_gate_up_exps" in n]:
        gate, up = np.split(tensors.pop(name), 2, axis=1)
        tensors[name.replace("gate_up", "gate")] = np.ascontiguousarray(gate)
        tensors[name.replace("gate_up", "up")] = np.ascontiguousarray(up)
    path = write_keyed_gguf(tmp_path / "s.gguf", "gemma4", converter_keys(hf.config), tensors)
    assert max_diff(cached_logits(load_model(path, CPU, "f32").model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(family, tmp_path):
    name, hf, _ = family
    hf = hf_model(FORMS[name])
    loaded = load_model(write_gemma4_gguf(tmp_path / "q.gguf", hf, Q8_0), CPU, "f32")
    types = loaded.checkpoint.weight_types
    assert types["Q8_0"] > types["F32"]
    quantized = {"e2b": "model.embed_tokens_per_layer.weight",
                 "moe": "model.layers.0.experts.3.down_proj.weight"}[name]  # fmt: skip
    assert loaded.checkpoint.weights[quantized].ggml_type == Q8_0
    expected = reference(dequantized(hf, Q8_0))
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_hf_folders_load_as_transformers_runs_them(family, tmp_path):
    """A text-only folder (save_pretrained: stacked experts, per_layer_config), and a
    multimodal one with its towers and the sharing layers' keys and values, left out."""
    _, hf, expected = family
    hf.save_pretrained(tmp_path / "text")
    for path in (tmp_path / "text", save_multimodal(hf, tmp_path / "multimodal")):
        loaded = load_model(path, CPU, "f32")
        assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def zeroed(config: dict, *suffixes: str) -> torch.Tensor:
    model = hf_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffixes):
                p.zero_()
    return reference(model)


def test_each_feature_moves_the_logits(e2b):
    """In transformers, by far more than the tolerance: the per-layer embeddings and their
    projection, the soft-cap, the window, the local RoPE base, the proportional RoPE's
    share, the global head width (its own RoPE table), the double-wide feed-forwards;
    the experts beside the dense feed-forward, the router's scales and the extra norms;
    keys as values. In llmrun: the layer whose keys a sharing layer reads, the layer
    scalar, the norms being x * w (not 1 + w), the values' norm, unscaled scores."""
    hf, expected = e2b
    for suffixes in (("embed_tokens_per_layer.weight",), ("per_layer_model_projection.weight",)):
        assert max_diff(zeroed(E2B, *suffixes), expected) > 0.1, suffixes
    for change in (
        dict(final_logit_softcapping=None),
        dict(sliding_window=SEQ),
        dict(rope_parameters={F: ROPE[F], S: dict(ROPE[S], rope_theta=10000.0)}),
        dict(rope_parameters={F: dict(ROPE[F], partial_rotary_factor=1.0), S: ROPE[S]}),
        dict(global_head_dim=16),
        dict(use_double_wide_mlp=False),
    ):
        assert max_diff(reference(hf_model(dict(E2B, **change))), expected) > 0.1, change
    moe = reference(hf_model(MOE))
    for suffixes in (("experts.down_proj",), ("mlp.down_proj.weight",),
                     ("router.scale",), ("router.per_expert_scale",),
                     ("post_feedforward_layernorm_1.weight",),
                     ("post_feedforward_layernorm_2.weight",),
                     ("pre_feedforward_layernorm_2.weight",)):  # fmt: skip
        assert max_diff(zeroed(MOE, *suffixes), moe) > 0.1, suffixes
    kv = dict(num_global_key_value_heads=4)  # the shapes without keys as values
    assert max_diff(reference(hf_model(dict(MOE, **kv, attention_k_eq_v=False))), moe) > 0.1
    model = ours(hf)
    model.model.layers[5].self_attn.source = 1  # another local layer's keys
    model.model.layers[1].self_attn.read_later = True
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    for layer in (model := ours(hf)).model.layers:
        layer.layer_scalar.fill_(1.0)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_the_model_fails_without_its_own_math(e2b, monkeypatch):
    """Gemma 3's norms (1 + w), the values left unnormalized, or scores scaled by
    head_dim^-0.5 each move llmrun's logits far from transformers'."""
    from llmrun.models import gemma3n, gemma4

    hf, expected = e2b

    def moved() -> float:
        with torch.no_grad():
            return max_diff(ours(hf)(IDS, torch.arange(SEQ)[None]), expected)

    assert moved() < 1e-4
    norm = gemma4.RMSNorm.forward
    with monkeypatch.context() as m:
        m.setattr(gemma4.RMSNorm, "forward", lambda self, x: norm(self, x) + (
            0 if self.weight is None else x / x.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
        ))  # fmt: skip
        assert moved() > 0.1
    with monkeypatch.context() as m:
        m.setattr(
            gemma4.RMSNorm, "forward", lambda self, x: x if self.weight is None else norm(self, x)
        )
        assert moved() > 0.1
    attention = gemma3n.attention  # Gemma 4's attention is Gemma 3n's (gemma3n.Attention)
    with monkeypatch.context() as m:
        m.setattr(gemma3n, "attention", lambda q, k, v, mask, scale: attention(
            q, k, v, mask, q.shape[-1] ** -0.5))  # fmt: skip
        assert moved() > 0.1


# Each computing layer's (KV heads, head width), by hand from FORMS: e2b's layers 0-4
# (local, local, global, local, global) with 2 KV heads; moe's local layers 4 heads of 16,
# its global ones (keys as values) 2 of 32.
SHAPES = {
    "e2b": [(2, 16), (2, 16), (2, 32), (2, 16), (2, 32)],
    "moe": [(4, 16), (2, 32), (4, 16), (2, 32)],
}


def test_the_cache_holds_each_layer_in_its_own_shape(family):
    """The computing layers' keys and values in their own shapes, as llama.cpp holds them
    (no padding to the widest head, no repeated KV heads): local layers in rings of the
    window (5) at a capacity of 64, in full buffers of their own at a capacity of 4; f32
    bytes by hand, counted alike by `llmrun show`'s torch-free count, the registry's and
    the allocated cache; serve's paged pools per layer shape."""
    name, hf, _ = family
    model, shapes = ours(hf), SHAPES[name]
    for capacity in (64, 4):
        cache = model.new_cache(1, capacity, torch.float32, "cpu")
        lengths = [min(5, capacity) if d == 16 else capacity for _, d in shapes]
        for layer, ((heads, dim), length) in enumerate(zip(shapes, lengths, strict=True)):
            group, index = cache.where[layer]
            k, v = cache.buffers[group]
            assert k[index].shape == v[index].shape == (1, heads, length, dim)
        by_hand = sum(2 * h * d * 4 * n for (h, d), n in zip(shapes, lengths, strict=True))
        assert cache.nbytes == by_hand
        assert len(cache.buffers) == 2 and not cache.uniform
    config = hf.config.to_dict()
    assert inspect.kv_cache_bytes(config, 64) == kv_cache_bytes(config, 64) == cache_bytes_64(name)
    hub = FORMS[name]
    assert inspect.kv_cache_bytes(hub, 64) == kv_cache_bytes(hub, 64) == cache_bytes_64(name)
    like = model.new_cache(1, 1, "f16", "cpu")
    position = sum(2 * h * d * 2 for h, d in shapes)
    assert PagedKVCache.block_bytes(like, 16) == 16 * position
    assert PagedKVCache(like, 8, 16, 256).nbytes == 8 * 16 * position
    pool = PagedKVCache(like, 8, 16, 256, window_blocks=3)
    local = sum(2 * h * d * 2 for h, d in shapes if d == 16)
    assert pool.nbytes == 8 * 16 * (position - local) + 3 * 16 * local
    with pytest.raises(UnsupportedError, match="multiple of 32"):
        model.new_cache(1, 8, "q8_0", "cpu")


def cache_bytes_64(name: str) -> int:
    """f32 bytes of a cache of 64 positions: local layers in their window of 5."""
    return sum(2 * h * d * 4 * (5 if d == 16 else 64) for h, d in SHAPES[name])


def test_a_cache_without_rings_holds_two_shapes_and_matches_transformers():
    """A window of 64 (no shorter than the cache): every computing layer in a full
    buffer, local and global layers in buffers of their own shapes; the logits through
    it (chunks, then decode steps) as transformers' (1e-4)."""
    hf = hf_model(dict(MOE, sliding_window=64))
    model = ours(hf)
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    assert cache.ring_k is None and [k.shape[2:] for k, _ in cache.buffers] == [
        (4, 64, 16),
        (2, 64, 32),
    ]
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


# A Gemma 4 31B config.json's text model (google/gemma-4-31B-it: 60 layers, every sixth
# global; a window of 1024; local layers 16 KV heads of 256, global ones keys as values
# with 4 KV heads of 512).
GEMMA4_31B = {
    "model_type": "gemma4",
    "architectures": ["Gemma4ForConditionalGeneration"],
    "text_config": {
        "model_type": "gemma4_text",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 4,
        "sliding_window": 1024,
        "vocab_size": 262144,
        "hidden_size_per_layer_input": 0,
        "max_position_embeddings": 262144,
    },
}


def test_show_counts_the_31b_cache_in_each_layers_shape(tmp_path):
    """`llmrun show` of a 31B-shaped folder: 8192 positions of f32 keys and values in
    its 10 global layers (4 x 512 each), and 1024 (the window) in its 50 local ones
    (16 x 256 each): 1.5 GB in f16, where the widest shape for all would take 4.4 GB."""
    folder = tmp_path / "31b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA4_31B))
    safetensors_torch.save_file({"lm_head.weight": torch.zeros(2, 2)},
                                str(folder / "model.safetensors"))  # fmt: skip
    by_hand = 10 * 8192 * 2 * 4 * 512 * 4 + 50 * 1024 * 2 * 16 * 256 * 4
    assert inspect.describe(folder)["kv_cache_bytes_8k"] == by_hand
    assert kv_cache_bytes(GEMMA4_31B, 8192) == by_hand
    assert kv_cache_bytes(GEMMA4_31B, 8192, 2) == by_hand // 2 == 1_509_949_440


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks: one sequence on shuffled blocks (f32, f16), rows of a
    batch sharing prefix blocks, the windowed layers in a pool of their own; the sharing
    layers read their source layers' blocks."""
    _, hf, expected = family
    check_paged(ours(hf), IDS, expected, "gemma3", monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """q8_0's blocks of 32 run along each layer's own heads: the forms with heads twice
    as wide (32 local, 64 global)."""
    name, hf, expected = family
    if cache_type == "q8_0":
        hf = hf_model(dict(FORMS[name], **Q8_0_WIDTHS))
        expected = reference(hf)
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[name][cache_type])


def test_the_native_and_static_decode_steps_are_not_attached(e2b, tmp_path):
    """Neither knows per-layer head shapes, per-layer inputs or shared keys."""
    loaded = load_model(write_gemma4_gguf(tmp_path / "m.gguf", e2b[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(loaded.model)
    cache = loaded.model.new_cache(1, 32, torch.float32, "cpu")
    assert not static_decode.supported(loaded.model, cache)


def test_gguf_defaults_and_refusals(e2b, tmp_path):
    """Without the soft-cap key, llama.cpp's 30; without the shared-layers key, none;
    without the local RoPE base, 10000. Refused: no window, no window flags, no
    rope_freqs, rope_freqs of another kind, RoPE scaling, sharing that llama.cpp would
    read from other layers."""
    hf, _ = e2b
    k = gguf.Keys
    path = write_gemma4_gguf(tmp_path / "d.gguf", hf, keys={
        k.LLM.FINAL_LOGIT_SOFTCAPPING: None, k.Rope.FREQ_BASE_SWA: None})  # fmt: skip
    config = config_from_gguf(read_gguf(path))
    assert config["final_logit_softcapping"] == 30.0
    assert config["rope_parameters"][S]["rope_theta"] == 10000.0
    assert config["rope_parameters"][F]["partial_rotary_factor"] == 0.25
    path = write_gemma4_gguf(tmp_path / "n.gguf", hf, keys={k.Attention.SHARED_KV_LAYERS: None})
    assert config_from_gguf(read_gguf(path))["num_kv_shared_layers"] == 0
    refusals = [
        (dict(keys={k.Attention.SLIDING_WINDOW: None}), ModelFormatError, "sliding_window"),
        (dict(keys={k.Attention.SLIDING_WINDOW_PATTERN: None}), ModelFormatError, "pattern"),
        (dict(drop=["rope_freqs.weight"]), ModelFormatError, "rope_freqs"),
        (dict(keys={k.Rope.SCALING_TYPE: "linear"}), UnsupportedError, "scaling"),
        (dict(keys={k.Attention.SHARED_KV_LAYERS: 3}), UnsupportedError, "sharing"),
    ]
    for i, (args, error, match) in enumerate(refusals):
        with pytest.raises(error, match=match):
            load_model(write_gemma4_gguf(tmp_path / f"r{i}.gguf", hf, **args), CPU, "f32")
    tensors = converter_tensors(hf)
    tensors["rope_freqs.weight"] = np.linspace(1, 4, 16, dtype=np.float32)
    path = write_keyed_gguf(tmp_path / "f.gguf", "gemma4", converter_keys(hf.config), tensors)
    with pytest.raises(UnsupportedError, match="proportional"):
        load_model(path, CPU, "f32")


def test_unsupported_configs_are_refused():
    from llmrun.models import gemma4

    for change, match in (
        (dict(use_bidirectional_attention="all"), "bidirectional"),
        (dict(rope_parameters={F: dict(rope_type="yarn", factor=2.0), S: ROPE[S]}), "yarn"),
        (dict(per_layer_config={"0": {"intermediate_size": 8}}), "per_layer_config"),
        (dict(enable_moe_block=True), "num_experts"),
    ):
        with pytest.raises((UnsupportedError, ModelFormatError), match=match):
            gemma4.ModelArgs.from_config(dict(E2B, **change))


def test_run_prints_transformers_greedy_text_and_show_names_it(e2b, tmp_path):
    hf, _ = e2b
    path = write_gemma4_gguf(tmp_path / "tiny.gguf", hf)
    check_run_and_show(hf, path, "gemma4")
    info = inspect.describe(path)
    assert info["architecture"] == "gemma4"
    assert info["kv_cache_bytes_8k"] == kv_cache_bytes(hf.config.to_dict(), 8192)


def test_serves_concurrent_requests_as_it_runs_them_alone(family, tmp_path):
    """serve's scheduler (a paged pool, the local layers in window blocks, the sharing
    layers reading their sources' blocks) decodes four requests together, each getting
    the text it gets alone."""
    _, hf, _ = family
    engine = api.load(str(write_gemma4_gguf(tmp_path / "m.gguf", hf)), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "The sun was"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 20, parallel=4)


def test_serve_sizes_its_pools_by_each_layers_shape(e2b, tmp_path):
    """The scheduler's --kv-memory accounting: a block of 16 positions takes, in the
    global layers' pool, 16 x 2 x (2 x 32) x 4 bytes per global layer (two of them), and
    in the local layers' pool 16 x 2 x (2 x 16) x 4 per local layer (three): 7 global
    blocks fit in 7 such blocks and the window pool, not 8."""
    from llmrun.batching import Scheduler

    engine = api.load(str(write_gemma4_gguf(tmp_path / "m.gguf", e2b[0])), "cpu", ctx_size=128)
    full, local = 2 * 16 * 2 * 2 * 32 * 4, 3 * 16 * 2 * 2 * 16 * 4
    probe = Scheduler(engine, parallel=2, kv_memory=10**7)
    windows = probe.blocks.window_manager.n_blocks * local
    scheduler = Scheduler(engine, parallel=2, kv_memory=windows + 8 * full - 1)
    assert scheduler.blocks.n_blocks == 7
    assert scheduler.cache.nbytes == windows + 7 * full

"""Nemotron-NAS (DeciLMForCausalLM, model_type "nemotron-nas"; GGUF arch "deci") against a
reference assembled from transformers' Llama modules as the checkpoints' remote code
(modeling_decilm.py) wires them, since transformers has no class of its own for it: per
layer a LlamaAttention with the layer's KV heads, a bias-free nn.Linear
(self_attn.linear_attn) or nothing, then a LlamaMLP of the layer's width, an nn.Linear
(mlp.linear_mlp) or nothing, each with its LlamaRMSNorm unless it is nothing, inside a
LlamaForCausalLM (so generate() runs it) with llama3 RoPE scaling. From a config.json
with block_configs, and from a "deci" GGUF written as llama.cpp's converter writes it
(conversion/deci.py: per-layer head counts and widths, per-layer q/k permutation, the
linear attention as attn_output, llama3 scaling as rope_freqs; F32 and Q8_0).

Each feature moves the logits by far more than the tolerance (test_each_feature_moves_
the_logits): each kind of block against its plain-Llama counterpart, the per-layer KV
heads and widths, and the llama3 scaling.

Tolerances: f32 logits (within about ±10) 1e-4 max abs against the reference, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or paged.
Typed caches: 1e-5 against an f32 cache holding the rounded values, drifting from f32 by
less than DRIFT. A Q8_0 GGUF against the reference on the weights gguf dequantizes: 1e-4.
"""

import json
import math

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_served_as_alone,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, gguf_name, our_model, randomize
from torch import nn

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import deci, kv_cache_bytes
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from transformers.models.llama import modeling_llama  # noqa: E402

CPU = torch.device("cpu")
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits (within ±8.5), measured: f16 2.2e-2, bf16 1.5e-1,
# q8_0 6.2e-1; allowed about twice that.
DRIFT = {"f16": 5e-2, "bf16": 3e-1, "q8_0": 1.2}
HEADS = 4


def attention(group: int | None = None, linear: bool = False) -> dict:
    """An attention block config as the released config.json files spell them."""
    return {"no_op": group is None and not linear, "replace_with_linear": linear,
            "n_heads_in_group": group, "sparsify": None, "window_length": None,
            "num_sink_tokens": None, "use_prefill_window_in_sink_attention": False,
            "unshifted_sink": False}  # fmt: skip


def ffn(mult: float | None = None, linear: bool = False) -> dict:
    return {"no_op": mult is None and not linear, "replace_with_linear": linear,
            "ffn_mult": mult, "sparsify": None}  # fmt: skip


# What the converter can write: attention with 2, 1 and 4 KV heads (widths 256 and 512
# from ffn_mult 1.5, 4.0, 1.0), a linear attention, a no_op attention before a
# feed-forward, and a dummy layer (both no_op), as Nemotron Ultra's.
GGUF_BLOCKS = [
    {"attention": attention(2), "ffn": ffn(1.5)},
    {"attention": attention(4), "ffn": ffn(4.0)},
    {"attention": attention(linear=True), "ffn": ffn(1.0)},
    {"attention": attention(), "ffn": ffn(4.0)},
    {"attention": attention(), "ffn": ffn()},
    {"attention": attention(1), "ffn": ffn(1.5)},
]
# And what only the remote code runs: a linear feed-forward, attention without one.
HF_BLOCKS = [
    *GGUF_BLOCKS[:4],
    {"attention": attention(2), "ffn": ffn(linear=True)},
    {"attention": attention(1), "ffn": ffn()},
]
# RoPE wavelengths under 1024 / 4 positions kept, over 1024 scaled by 8, between smoothed.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip
CONFIG = dict(
    hidden_size=128,
    num_attention_heads=HEADS,
    num_hidden_layers=len(GGUF_BLOCKS),
    vocab_size=512,  # stories260K's tokenizer, so the models can also be run end to end
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=LLAMA3,
    block_configs=GGUF_BLOCKS,
    bos_token_id=1,
    eos_token_id=2,
)


def remote_width(ffn_mult: float, hidden_size: int) -> int:
    """_ffn_mult_to_intermediate_size of the remote code (and of llama.cpp's converter):
    2/3 of ffn_mult * hidden_size, truncated, rounded up to a multiple of 256."""
    return math.ceil(int(2 * ffn_mult * hidden_size / 3) / 256) * 256


class LinearAttention(nn.Module):
    """DeciLMLinearAttention: a bias-free linear map in place of attention."""

    def __init__(self, config) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, **kwargs):
        return self.linear_attn(hidden_states), None


class LinearMLP(nn.Module):
    """DeciLMLinearMLP: a bias-free linear map in place of the feed-forward."""

    def __init__(self, config) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.linear_mlp(x)


class DeciBlock(nn.Module):
    """DeciLMDecoderLayer of transformers' Llama modules: each sublayer and its norm
    only where its block is not a no_op."""

    def __init__(self, config, layer: int) -> None:
        super().__init__()
        block = config.block_configs[layer]
        self.attention, self.ffn = block["attention"], block["ffn"]
        if not self.attention["no_op"]:
            self.input_layernorm = modeling_llama.LlamaRMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )
            if self.attention["replace_with_linear"]:
                self.self_attn = LinearAttention(config)
            else:
                heads = config.num_attention_heads // self.attention["n_heads_in_group"]
                layer_config = transformers.LlamaConfig(
                    **{**config.to_dict(), "num_key_value_heads": heads}
                )
                layer_config._attn_implementation = config._attn_implementation
                self.self_attn = modeling_llama.LlamaAttention(layer_config, layer)
        if not self.ffn["no_op"]:
            self.post_attention_layernorm = modeling_llama.LlamaRMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )
            if self.ffn["replace_with_linear"]:
                self.mlp = LinearMLP(config)
            else:
                width = remote_width(self.ffn["ffn_mult"], config.hidden_size)
                mlp_config = transformers.LlamaConfig(
                    **{**config.to_dict(), "intermediate_size": width}
                )
                self.mlp = modeling_llama.LlamaMLP(mlp_config)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        if not self.attention["no_op"]:
            out, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states),
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            hidden_states = hidden_states + out
        if not self.ffn["no_op"]:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


def hf_model(**overrides):
    """The reference (f32, eval, randomize()'s weights from seed 0): a LlamaForCausalLM
    whose decoder layers are DeciBlocks of CONFIG's (and `overrides`') block_configs.
    Layer 0 must have attention: transformers' cache counts its length there."""
    config = transformers.LlamaConfig(**{**CONFIG, **overrides})
    config.num_hidden_layers = len(config.block_configs)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    layers = range(config.num_hidden_layers)
    model.model.layers = nn.ModuleList(DeciBlock(config, i) for i in layers)
    model = model.float().eval()
    randomize(model)
    return model


def config_json(hf) -> dict:
    """The reference's config.json as the released checkpoints write it."""
    c = hf.config
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": None,
        "intermediate_size": None,
        "block_configs": c.block_configs,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "tie_word_embeddings": c.tie_word_embeddings,
        "rope_theta": c.rope_parameters["rope_theta"],
        "rope_scaling": {k: v for k, v in c.rope_parameters.items() if k != "rope_theta"},
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def reference(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(IDS).logits


def ours(hf) -> torch.nn.Module:
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    return our_model(config_json(hf), state)


def rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The converter's rope_freqs tensor of llama3 scaling: each frequency's divisor."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * np.pi / freq
        if wavelength < old / high:
            divisors.append(1.0)
        elif wavelength > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for its adjacent-pair RoPE."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_deci_gguf(path, hf, qtype=None, **metadata):
    """The reference as llama.cpp's converter writes Nemotron-NAS (DeciModel with
    block_configs): head counts, KV head counts and feed-forward widths per layer (0 for
    a no_op attention, KV 0 for a linear one, width 0 for a no_op feed-forward), key and
    value length hidden / heads, the rope dimension count, rope_freqs for llama3, q/k
    rows permuted with each layer's heads, the linear attention as attn_output; 2-D
    weights in `qtype` (default F32). `metadata`: keys ("{arch}.…") to add or, with
    None, leave out."""
    config = hf.config
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_counts, kv_counts, widths = [], [], []
    for block in config.block_configs:
        attn, mlp = block["attention"], block["ffn"]
        group = attn["n_heads_in_group"]
        head_counts.append(0 if group is None and not attn["replace_with_linear"] else heads)
        kv_counts.append(0 if group is None else heads // group)
        mult = mlp["ffn_mult"]
        widths.append(0 if mult is None else remote_width(mult, hidden))
    keys = {
        gguf.Keys.Rope.FREQ_BASE: float(config.rope_parameters["rope_theta"]),
        gguf.Keys.Attention.HEAD_COUNT_KV: kv_counts,
        gguf.Keys.Attention.HEAD_COUNT: head_counts,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: widths,
        gguf.Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        gguf.Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        gguf.Keys.LLM.EMBEDDING_LENGTH: hidden,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: float(config.rms_norm_eps),
        gguf.Keys.Attention.KEY_LENGTH: hidden // heads,
        gguf.Keys.Attention.VALUE_LENGTH: hidden // heads,
        gguf.Keys.LLM.VOCAB_SIZE: config.vocab_size,
        gguf.Keys.Rope.DIMENSION_COUNT: hidden // heads,
        **metadata,
    }
    tensors = {}
    for name, tensor in hf.state_dict().items():
        if "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        data = tensor.float().numpy()
        if ".self_attn.linear_attn." in name:
            name = name.replace("linear_attn", "o_proj")
        elif ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            block = config.block_configs[int(name.split(".")[2])]["attention"]
            kv = heads // block["n_heads_in_group"]
            data = _permuted(data, heads if ".q_proj." in name else kv)
        tensors[gguf_name(name)] = data
    if config.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = rope_freqs(config.rope_parameters, hidden // heads)
    return write_keyed_gguf(path, "deci", keys, tensors, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


@pytest.fixture(scope="module")
def hf_only():
    hf = hf_model(block_configs=HF_BLOCKS)
    return hf, reference(hf)


def test_config_json_matches_the_reference_whole_chunked_and_decoded(family, hf_only):
    for hf, expected in (family, hf_only):
        assert expected.abs().max() > 3
        check_whole_and_cached(ours(hf), IDS, expected)


@pytest.mark.parametrize("mult, width", [(5.25, 28672), (2.625, 14336), (1.0, 5632)])
def test_ffn_mult_gives_the_released_widths(mult, width):
    """Widths of hidden size 8192 (Nemotron Super): 5.25 is Llama 3 70B's 28672."""
    assert deci.deci_config.ffn_mult_to_intermediate_size(mult, 8192) == width


def test_each_layer_caches_its_own_kv_heads_and_no_other_layer_does(hf_only):
    model = ours(hf_only[0])
    cache = model.new_cache(1, 8, torch.float32, "cpu")
    assert cache.shapes == [(2, 32), (1, 32), (2, 32), (4, 32)]
    assert model.args.attention_layers == [0, 1, 4, 5]
    config = config_json(hf_only[0])
    per_position = 2 * 4 * 32 * (2 + 1 + 2 + 4)
    assert kv_cache_bytes(config, 8192) == inspect.kv_cache_bytes(config, 8192)
    assert inspect.kv_cache_bytes(config, 8192) == 8192 * per_position


@pytest.mark.parametrize(
    "layer, block",
    [
        (1, {"attention": attention(1), "ffn": ffn(4.0)}),  # its KV heads (1, not 4)
        (1, {"attention": attention(4), "ffn": ffn(1.0)}),  # its width (256, not 512)
        (2, {"attention": attention(4), "ffn": ffn(1.0)}),  # a linear attention
        (3, {"attention": attention(4), "ffn": ffn(4.0)}),  # a no_op attention
        (4, {"attention": attention(4), "ffn": ffn(1.0)}),  # a dummy layer
    ],
)
def test_each_feature_moves_the_logits(family, layer, block):
    """Each block kind, KV head count and width against another: the reference moves by
    far more than the tolerance, and llmrun follows it."""
    blocks = list(GGUF_BLOCKS)
    blocks[layer] = block
    hf = hf_model(block_configs=blocks)
    assert max_diff(reference(hf), family[1]) > 0.1
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_the_llama3_scaling_moves_the_logits(family):
    hf = hf_model(rope_scaling=None)
    assert max_diff(reference(hf), family[1]) > 0.1
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_a_gguf_matches_the_reference(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_deci_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "nemotron-nas"
    assert "freq_factors" in config["rope_parameters"]
    assert loaded.model.decode_step is None  # the native step knows no deci layers
    assert max_diff(loaded.model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_with_one_head_count_and_width_for_all_layers_reads_them_for_each(tmp_path):
    """DeciLM-7B's files (the converter's other branch): head_count and
    feed_forward_length one value, head_count_kv one per layer."""
    blocks = [{"attention": attention(g), "ffn": ffn(1.0)} for g in (2, 4, 1, 2)]
    hf = hf_model(block_configs=blocks)
    keys = {gguf.Keys.Attention.HEAD_COUNT: HEADS, gguf.Keys.LLM.FEED_FORWARD_LENGTH: 256}
    loaded = load_model(write_deci_gguf(tmp_path / "m.gguf", hf, **keys), CPU, "f32")
    assert loaded.model.new_cache(1, 8, torch.float32, "cpu").shapes == [
        (2, 32), (1, 32), (4, 32), (2, 32)
    ]  # fmt: skip
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_deci_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_the_reference_runs_it(hf_only, tmp_path):
    from safetensors.torch import save_file

    hf, expected = hf_only
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json(hf)))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    save_file(state, folder / "model.safetensors")
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(hf_only):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = hf_only
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_holds_its_rounded_values(hf_only, cache_type):
    hf, expected = hf_only
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(monkeypatch):
    """CUDA graphs' static step (run eager on CPU) where every attention layer has the
    same KV heads; layers of several shapes are not its kind of cache."""
    blocks = [{**b, "attention": attention(2)} if b["attention"]["n_heads_in_group"] else b
              for b in GGUF_BLOCKS]  # fmt: skip
    check_static_decode(ours(hf_model(block_configs=blocks)), monkeypatch)


def test_llmrun_run_prints_the_reference_greedy_text(tmp_path):
    hf = hf_model()
    path = write_deci_gguf(tmp_path / "deci.gguf", hf)
    check_run_and_show(hf, path, "deci")
    assert inspect.describe(path)["kv_cache_bytes_8k"] == 8192 * 2 * 4 * 32 * (2 + 1 + 4)


def test_serves_concurrent_requests_as_it_runs_them_alone(tmp_path):
    """serve's scheduler (a paged pool of the attention layers alone) decodes four
    requests together, each getting the text it gets alone."""
    engine = api.load(str(write_deci_gguf(tmp_path / "m.gguf", hf_model())), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "The sun was"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 20, parallel=4)


@pytest.mark.parametrize(
    "block, error, message",
    [
        ({"attention": {**attention(2), "window_length": 64}, "ffn": ffn(1.0)},
         UnsupportedError, "sliding-window"),
        ({"attention": attention(2), "ffn": {**ffn(1.0), "gated": False}},
         UnsupportedError, "gated SiLU"),
        ({"attention": {**attention(2), "moe": {"experts": 8}}, "ffn": ffn(1.0)},
         UnsupportedError, "sets moe"),
        ({"attention": attention(3), "ffn": ffn(1.0)}, ModelFormatError, "n_heads_in_group"),
        ({"attention": attention(2), "ffn": {"no_op": False}}, ModelFormatError, "ffn_mult"),
        ({"ffn": ffn(1.0)}, ModelFormatError, "no attention object"),
    ],
)  # fmt: skip
def test_block_configs_llmrun_does_not_compute_are_refused(family, block, error, message):
    config = config_json(family[0])
    config["block_configs"] = [block, *config["block_configs"][1:]]
    with pytest.raises(error, match=message):
        deci.ModelArgs.from_config(config)


def test_a_gguf_layer_with_attention_and_no_feed_forward_is_refused(tmp_path):
    """llama.cpp's graph drops such a layer's attention, the remote code keeps it."""
    hf = hf_model(block_configs=[*GGUF_BLOCKS[:5], {"attention": attention(1), "ffn": ffn()}])
    path = write_deci_gguf(tmp_path / "m.gguf", hf)
    with pytest.raises(UnsupportedError, match="llmrun does not guess"):
        load_model(path, CPU, "f32")


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({gguf.Keys.Attention.HEAD_COUNT: [4, 4, 2, 0, 0, 4]}, "one head count"),
        ({gguf.Keys.Attention.HEAD_COUNT_KV: [2, 1, 0, 0, 0, 3]}, "cannot share"),
        ({gguf.Keys.Attention.HEAD_COUNT_KV: [2, 1, 0, 1, 0, 4]}, "no attention heads"),
        ({gguf.Keys.LLM.FEED_FORWARD_LENGTH: [256, 512]}, "a list of 6 counts"),
        ({gguf.Keys.Rope.DIMENSION_COUNT: 16}, "rotates whole heads"),
    ],
)
def test_gguf_metadata_llmrun_cannot_read_is_refused(family, tmp_path, metadata, message):
    path = write_deci_gguf(tmp_path / "m.gguf", family[0], **metadata)
    with pytest.raises((ModelFormatError, UnsupportedError), match=message):
        load_model(path, CPU, "f32")

"""Llama 4 (text) against transformers' Llama4ForCausalLM, from a config.json (a
Llama4ForCausalLM folder and a multimodal Llama4ForConditionalGeneration one) and from a
"llama4" GGUF written as llama.cpp's converter writes it (conversion/llama.py
Llama4Model: TextModel's keys with feed_forward_length the dense layers' width,
expert_feed_forward_length and interleave_moe_layer_step, q/k rows as they are, the
fused experts split and stacked, Llama 3 RoPE scaling as a rope_freqs tensor).

The config.json model has chunks of 8 positions (the 44 tokens cross five chunk
boundaries, in prefill chunks and in decode steps), a NoPE layer with a temperature
that changes every 4 positions (floor_scale 4, attn_scale 0.5), Llama 3 RoPE scaling,
dense and MoE layers alternating, q/k L2 norms. Each of these moves the logits by far
more than the tolerance (test_each_feature_moves_the_logits). A GGUF holds none of
the chunk and temperature settings: llama.cpp fixes them (chunks of 8192 and so on),
so the GGUF models are compared with transformers run with those values.

Tolerances: f32 logits (within about ±8) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF (every matrix, the experts' stacks too)
against transformers run on the weights gguf dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_served_as_alone,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, randomize, save_hf_dir
from llama4_helpers import write_llama4_gguf

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading import llama4 as llama4_loading
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes, llama4

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
# llama.cpp's reading of any llama4 GGUF: what the GGUF models are built with.
GGUF_SETTINGS = dict(
    model_type="llama4_text",
    intermediate_size=64,  # the experts' (Q8_0 blocks of 32 along it)
    intermediate_size_mlp=96,
    num_hidden_layers=4,  # three RoPE layers, then a NoPE one
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    rope_parameters=LLAMA3_ROPE,
)
LLAMA4 = dict(
    BASE,
    **GGUF_SETTINGS,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.5,
)
SEQ = 44
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 6.8e-3 (Scout's shape), 1.5e-2
# (Maverick's, without the q/k norms), bf16 6.1e-2 and 9.5e-2.
DRIFT = {"f16": 3e-2, "bf16": 2e-1}


def hf_model(base=LLAMA4, **overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**base, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def gguf_hf_model(**overrides):
    return hf_model(dict(BASE, **GGUF_SETTINGS), **overrides)


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


class Plain:
    """A tensor as the loader's Weight holds one."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def ours(hf) -> torch.nn.Module:
    config = hf.config.to_dict()
    weights = {name: Plain(tensor) for name, tensor in hf.state_dict().items()}
    state = {
        name: w.tensor for name, w in llama4_loading.hf_weights(weights, config, Plain).items()
    }
    return our_model(config, state)


def dequantize_weights(hf, qtype) -> None:
    """Round `hf`'s matrices in place as a GGUF of `qtype` holds them: blocks along each
    row of the matrices as llama.cpp stores them (the experts' [in, out] transposed)."""

    def rounded(x: torch.Tensor) -> torch.Tensor:
        data = x.contiguous().numpy()
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype))

    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(rounded(p))
            elif p.dim() == 3:
                p.copy_(rounded(p.transpose(1, 2)).transpose(1, 2))


@pytest.fixture(scope="module", params=["scout", "maverick"])
def family(request):
    """Scout's shape (q/k norms) and Maverick's (none), with llmrun's model."""
    hf = hf_model(use_qk_norm=request.param == "scout")
    return hf, reference(hf), ours(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected, model = family
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)
    # A short prefill, then decode steps across every chunk boundary from 8 on.
    assert max_diff(cached_logits(model, IDS, chunks=(5,)), expected) < 1e-4


def test_each_feature_moves_the_logits():
    """Without chunks, the temperature, the q/k norms, a NoPE layer, the dense layers,
    the RoPE scaling, or with top-2 routing: each changes the logits by far more than
    the tolerance, and llmrun follows each variant."""
    expected = reference(hf_model())
    for variant in (
        dict(attention_chunk_size=None),
        dict(attn_temperature_tuning=False),
        dict(use_qk_norm=False),
        dict(no_rope_layers=[1, 1, 1, 1]),
        dict(interleave_moe_layer_step=1),
        dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
        dict(num_experts_per_tok=2),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1, variant
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4, variant


@pytest.mark.parametrize("shape", ["scout", "maverick"])
def test_a_gguf_matches_transformers_with_llama_cpp_settings(shape, tmp_path):
    """Maverick's shape: 128 experts (llama.cpp then skips the q/k norms), MoE layers
    alternating with dense ones; Scout's: 16 experts in every layer (4 here)."""
    if shape == "scout":
        hf = gguf_hf_model(interleave_moe_layer_step=1)
    else:
        hf = gguf_hf_model(num_local_experts=128, use_qk_norm=False)
    loaded = load_model(write_llama4_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "llama4_text"
    assert config["attention_chunk_size"] == 8192 and config["use_qk_norm"] == (shape == "scout")
    assert config["layer_types"] == ["chunked_attention"] * 3 + ["full_attention"]
    assert config["no_rope_layers"] == [1, 1, 1, 0]
    assert loaded.model.decode_step is None  # the native step computes no Llama 4 layer
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = gguf_hf_model()
    loaded = load_model(write_llama4_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected, _ = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_multimodal_folder_runs_its_language_model(tmp_path, capsys):
    """A Llama4ForConditionalGeneration checkpoint: its language model, the vision
    tower and projector left out."""
    text = {k: v for k, v in LLAMA4.items() if k not in ("bos_token_id", "eos_token_id")}
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    multimodal = transformers.Llama4ForConditionalGeneration(config).eval()
    randomize(multimodal)
    multimodal.save_pretrained(tmp_path / "mm")
    with torch.no_grad():
        expected = multimodal(input_ids=IDS).logits
    loaded = load_model(tmp_path / "mm", CPU, "f32")
    assert "a multimodal Llama 4" in capsys.readouterr().err
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    info = inspect.describe(tmp_path / "mm")
    assert info["architecture"] == "llama4"
    assert 0 < info["active_parameters"] < info["parameters"]
    assert info["kv_cache_bytes_8k"] == kv_cache_bytes(config.to_dict(), 8192)


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks, across chunk boundaries."""
    _, expected, model = family
    check_paged(model, IDS, expected)


def test_serve_gives_concurrent_requests_their_text_alone(tmp_path):
    """serve's scheduler (paged KV blocks, rows prefilled and decoded together, across
    chunks of 8) on a folder: each request gets the text it gets alone."""
    from llmrun import api
    from llmrun.sampling import SamplingParams

    path = save_hf_dir(hf_model(), tmp_path / "hf", tokenizer=True)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (engine.tokenizer.encode(p), SamplingParams(seed=i, temperature=0.8))
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    _, expected, model = family
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_decode_step(family):
    """CUDA graphs' static step takes one mask for every layer: not offered."""
    model = family[2]
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))


@pytest.mark.parametrize(
    ("keys", "error", "message"),
    [
        (dict(sliding_window=0), UnsupportedError, "without chunked attention"),
        (dict(rope_dims=8), ModelFormatError, "Llama 4 rotates whole heads"),
        (dict(swa_base=10000.0), UnsupportedError, "Llama 4 has one RoPE base"),
        (dict(experts=0), ModelFormatError, "a llama4 model has experts"),
    ],
)
def test_what_llama_cpp_runs_otherwise_is_refused(keys, error, message, tmp_path):
    path = write_llama4_gguf(tmp_path / "m.gguf", gguf_hf_model(), **keys)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_a_config_with_an_unknown_layer_type_is_refused():
    config = {**LLAMA4, "layer_types": ["sliding_attention"] * 4}
    with pytest.raises(UnsupportedError, match="layer type 'sliding_attention'"):
        llama4.ModelArgs.from_config(config)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    # Unscaled RoPE: `llmrun show` reads no tensor, so no rope_freqs, and gives no KV
    # cache size for a file with one.
    hf = gguf_hf_model(rope_parameters=dict(rope_type="default", rope_theta=500000.0))
    path = write_llama4_gguf(tmp_path / "llama4.gguf", hf)
    check_run_and_show(hf, path, "llama4")
    kv_bytes = 4 * 2 * 2 * 16 * 4 * 8192  # layers, keys and values, KV heads, head_dim, f32
    check_show(path, "llama4", kv_bytes, moe=True)

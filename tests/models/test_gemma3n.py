"""Gemma 3n against transformers' Gemma3nForCausalLM, from a config.json (text-only, and
a Gemma3nForConditionalGeneration folder with its towers) and from a "gemma3n" GGUF
written as llama.cpp's converter writes it (conversion/gemma.py Gemma3NModel: Gemma 3's
keys with both RoPE bases, the norms unshifted, the AltUp, per-layer, shared-KV and
sparsity keys, the window flags; gguf's own tensor name map; the AltUp projections
stacked; the embeddings padded with zero rows to vocab_size; the sharing layers' unused
keys and values written as a real checkpoint has them).

The model: 8 layers (local, local, global twice, then local, global) whose last two
share the keys and values of layers 4 (local) and 5 (global), per-layer feed-forward
widths, three sparse layers, 4 AltUp streams, a LAuReL rank of 8, per-layer inputs of
16, windows of 5 under prompts of 40, RoPE bases of 100000 and 1000, a soft-cap of 10.
A second form takes stream 1 as the active one, no output scale, no KV sharing, the
default layer pattern and an older config's RoPE keys. Each feature moves transformers'
logits by far more than the tolerance (test_each_feature_moves_the_logits).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous, in
rings or paged. A typed cache: 1e-5 against an f32 cache storing the values rounded to
the type, and DRIFT from f32. A Q8_0 GGUF (the matrices whose rows are whole blocks;
the rest F32) against transformers run on the weights gguf dequantizes: 1e-4.
"""

import math

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_served_as_alone,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, randomize

from llmrun import api, static_decode
from llmrun.errors import ModelFormatError
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.quant import decode_step
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
S, F = "sliding_attention", "full_attention"
E2B = dict(
    BASE,
    model_type="gemma3n_text",
    head_dim=32,
    num_hidden_layers=8,
    intermediate_size=[96, 64, 96, 80, 96, 96, 64, 96],
    layer_types=[S, S, F, S, S, F, S, F],
    sliding_window=5,
    num_kv_shared_layers=2,
    activation_sparsity_pattern=[0.95, 0.8, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0],
    laurel_rank=8,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=BASE["vocab_size"],
    final_logit_softcapping=10.0,
    rope_parameters={
        F: dict(rope_type="default", rope_theta=100000.0),
        S: dict(rope_type="default", rope_theta=1000.0),
    },
)
# Stream 1 active, no output scale, no sharing, every fifth layer global, one width,
# an older config's RoPE keys (read here; transformers converts them).
OTHER = dict(
    BASE,
    model_type="gemma3n_text",
    head_dim=32,
    num_hidden_layers=6,
    sliding_window=5,
    num_kv_shared_layers=0,
    altup_active_idx=1,
    altup_correct_scale=False,
    activation_sparsity_pattern=[0.0, 0.9, 0.0, 0.0, 0.0, 0.0],
    laurel_rank=8,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=BASE["vocab_size"],
    final_logit_softcapping=10.0,
    rope_theta=100000.0,
    rope_local_base_freq=1000.0,
)
FORMS = {"e2b": E2B, "other": OTHER}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.6e-2, bf16 8.2e-2, q8_0 0.37
# (eight layers of four streams each carry the rounding on).
DRIFT = {"f16": 5e-2, "bf16": 0.3, "q8_0": 1.0}
Q8_0 = gguf.GGMLQuantizationType.Q8_0
# The towers and embedders of a Gemma3nForConditionalGeneration, which llmrun leaves out.
TOWERS = ("model.vision_tower.conv.weight", "model.audio_tower.conv.weight",
          "model.embed_vision.embedding.weight", "model.embed_audio.embedding.weight")  # fmt: skip


def hf_model(config: dict, seed: int = 0):
    """transformers' model of `config` with randomize()'s weights: norms near 1 (Gemma
    3n's are x * w)."""
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf, config: dict | None = None) -> torch.nn.Module:
    return our_model(config or hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module", params=list(FORMS))
def family(request):
    hf = hf_model(FORMS[request.param])
    return request.param, hf, reference(hf)


@pytest.fixture(scope="module")
def e2b():
    hf = hf_model(E2B)
    return hf, reference(hf)


def quantizable(name: str, shape) -> bool:
    """Whether the converter's Q8_0 takes the tensor: a matrix of whole blocks a row."""
    return len(shape) >= 2 and shape[-1] % 32 == 0


def sharing_kv(hf, seed: int = 7) -> dict[str, torch.Tensor]:
    """Key and value weights for the sharing layers, which a real checkpoint holds (and
    transformers ignores): random, so reading them would show."""
    config = hf.config
    first = config.num_hidden_layers - config.num_kv_shared_layers
    width = config.num_key_value_heads * config.head_dim
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(first, config.num_hidden_layers):
        for proj in ("k_proj", "v_proj"):
            w = torch.randn(width, config.hidden_size, generator=generator)
            out[f"model.layers.{i}.self_attn.{proj}.weight"] = w
        out[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.randn(config.head_dim)
    return out


def write_gemma3n_gguf(path, hf, qtype=None, keys=True, window=True, stack=True):
    """The model as llama.cpp's converter writes Gemma 3n: Gemma 3's keys (key length,
    context, both RoPE bases, the soft-cap, the window), Gemma3NModel's (AltUp streams
    and active stream, per-layer width, shared KV layers, each layer's std multiplier
    icdf(sparsity), the window flags), tensors by gguf's name map for gemma3n with the
    norms unshifted, the AltUp projections stacked, both embeddings padded with zero
    rows to vocab_size, the sharing layers' unused keys and values; matrices of whole
    blocks in `qtype`. For the defaults and refusals: no gemma3n keys, no window, no
    stack."""
    config = hf.config
    layers = config.num_hidden_layers
    writer = gguf_writer(path, "gemma3n", config)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope[F]["rope_theta"])
    writer.add_rope_freq_base_swa(rope[S]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if window:
        writer.add_sliding_window(config.sliding_window)
    if keys:
        writer.add_altup_active_idx(config.altup_active_idx)
        writer.add_altup_num_inputs(config.altup_num_inputs)
        writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
        writer.add_shared_kv_layers(config.num_kv_shared_layers)
        normal = torch.distributions.normal.Normal(0, 1)
        writer.add_activation_sparsity_scale(
            [normal.icdf(torch.tensor(s, dtype=torch.float32)).item()
             for s in config.activation_sparsity_pattern]
        )  # fmt: skip
        writer.add_sliding_window_pattern([t == S for t in config.layer_types])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3N, layers)
    state = {**hf.state_dict(), **sharing_kv(hf)}
    del state["lm_head.weight"]  # tied: the checkpoint has none
    for name in ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight"):
        rows = state[name]
        state[name] = torch.cat(
            [rows, rows.new_zeros(config.vocab_size - len(rows), rows.shape[1])]
        )
    for module in ("model.altup_projections", "model.altup_unembed_projections"):
        parts = [state.pop(f"{module}.{i}.weight") for i in range(config.altup_num_inputs - 1)]
        if stack:
            state[f"{module}.weight"] = torch.stack(parts)
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        gguf_name = names.get_name(module) + ".weight"
        data = np.ascontiguousarray(tensor.float().numpy())
        if qtype is not None and quantizable(module, data.shape):
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    return finish_stories_gguf(writer, path, {}, str)


def dequantized(hf, qtype):
    """`hf` with the weights a `qtype` GGUF holds: its quantizable matrices rounded."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if quantizable(name.removesuffix(".weight"), p.shape):
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    return hf


def save_multimodal(hf, path):
    """A Gemma3nForConditionalGeneration folder as the Hub has them: the text config
    under text_config, the language model under model.language_model., every layer's
    keys and values, the towers' tensors, no lm_head (tied)."""
    import json

    path.mkdir()
    text = hf.config.to_dict()
    config = {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "gemma3n_vision"}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    state = {**hf.state_dict(), **sharing_kv(hf)}
    del state["lm_head.weight"]
    tensors = {f"model.language_model.{k[len('model.') :]}": v for k, v in state.items()}
    tensors.update({name: torch.randn(4, 4) for name in TOWERS})
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                str(path / "model.safetensors"))  # fmt: skip
    return path


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    name, hf, expected = family
    assert expected.abs().max() > 3
    configs = [hf.config.to_dict()] + ([FORMS[name]] if name == "other" else [])
    for config in configs:  # the older RoPE keys read as transformers reads them
        model = ours(hf, config)
        check_whole_and_cached(model, IDS, expected)


def test_bf16_computes_as_transformers_does_in_bf16():
    """Every rounding where transformers rounds (norms in f32, constants in the compute
    dtype): bf16 logits within 0.05 of transformers' bf16 (they drift 0.6 from f32)."""
    hf = hf_model(E2B)
    model = ours(hf).to(torch.bfloat16)
    with torch.no_grad():
        got = model(IDS, torch.arange(SEQ)[None])
        expected = hf.to(torch.bfloat16)(IDS).logits.float()
    assert max_diff(got, expected) < 0.05


def test_ids_past_the_per_layer_table_take_row_0_as_transformers_does():
    """vocab_size_per_layer_input below vocab_size: those ids read the per-layer row of
    id 0 (transformers); a GGUF pads the table with zero rows, which llama.cpp reads."""
    hf = hf_model(dict(E2B, vocab_size_per_layer_input=400))
    assert (IDS >= 400).any()
    expected = reference(hf)
    assert max_diff(cached_logits(ours(hf), IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(e2b, tmp_path):
    hf, expected = e2b
    loaded = load_model(write_gemma3n_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "gemma3n_text"
    assert config["layer_types"] == hf.config.layer_types
    assert config["num_kv_shared_layers"] == 2
    assert config["intermediate_size"] == hf.config.intermediate_size
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_padded_per_layer_table_reads_as_llama_cpp_reads_it(tmp_path):
    """The converter pads a 400-row per-layer table to the 512 of vocab_size with zero
    rows; ids below 400 read what transformers reads."""
    hf = hf_model(dict(E2B, vocab_size_per_layer_input=400))
    loaded = load_model(write_gemma3n_gguf(tmp_path / "p.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["vocab_size_per_layer_input"] == 512
    assert not loaded.model.model.embed_tokens_per_layer.weight[400:].any()
    low = IDS % 400
    assert max_diff(cached_logits(loaded.model, low), reference(hf, low)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    hf = hf_model(E2B)
    loaded = load_model(write_gemma3n_gguf(tmp_path / "q.gguf", hf, Q8_0), CPU, "f32")
    types = loaded.checkpoint.weight_types
    assert types["Q8_0"] > types["F32"]
    for name in ("model.altup_projections.1.weight", "model.embed_tokens_per_layer.weight"):
        assert loaded.checkpoint.weights[name].ggml_type == Q8_0
    assert max_diff(cached_logits(loaded.model, IDS), reference(dequantized(hf, Q8_0))) < 1e-4


def test_hf_folders_load_as_transformers_runs_them(e2b, tmp_path):
    """A text-only folder (save_pretrained), and a multimodal one with its towers and the
    sharing layers' keys and values, which are left out."""
    hf, expected = e2b
    hf.save_pretrained(tmp_path / "text")
    for path in (tmp_path / "text", save_multimodal(hf, tmp_path / "multimodal")):
        loaded = load_model(path, CPU, "f32")
        assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_each_feature_moves_the_logits(e2b):
    """In transformers, by far more than the tolerance: AltUp's prediction and correction
    coefficients and output scale, the active stream, LAuReL, the per-layer embeddings
    and their projection, the sparsity, the soft-cap, the window, the local RoPE base,
    embedding scaling (via the per-layer width), and in llmrun the layer whose keys a
    sharing layer reads. altup_coef_clip clamps only in training: a clipped coefficient
    would move the logits, and transformers' eval and llmrun leave it."""
    hf, expected = e2b

    def zeroed(*suffixes):
        model = hf_model(E2B)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(suffixes):
                    p.zero_()
        return reference(model)

    for suffixes in (
        ("altup.prediction_coefs.weight",),
        ("altup.correction_coefs.weight",),
        ("altup.correct_output_scale",),
        ("laurel.linear_right.weight",),
        ("embed_tokens_per_layer.weight",),
        ("per_layer_model_projection.weight",),
    ):
        assert max_diff(zeroed(*suffixes), expected) > 0.1, suffixes
    dense = [0.0] * 8
    for change in (
        dict(activation_sparsity_pattern=dense),
        dict(final_logit_softcapping=1e6),  # as good as none
        dict(sliding_window=SEQ),
        dict(rope_parameters={F: E2B["rope_parameters"][F], S: E2B["rope_parameters"][F]}),
        dict(altup_active_idx=2),
        dict(altup_correct_scale=False),
    ):
        assert max_diff(reference(hf_model(dict(E2B, **change))), expected) > 0.1, change
    model = ours(hf)
    model.model.layers[6].self_attn.source = 3  # another local layer's keys
    model.model.layers[3].self_attn.read_later = True
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    clipped = hf_model(dict(E2B, altup_coef_clip=0.05))
    assert max_diff(reference(clipped), expected) < 1e-6  # eval: no clipping
    with torch.no_grad():
        for layer in clipped.model.layers:
            layer.altup.prediction_coefs.weight.clamp_(-0.05, 0.05)
    assert max_diff(reference(clipped), expected) > 0.1


def test_the_cache_holds_only_the_layers_that_compute_keys(e2b):
    """Six layers of eight (four local in rings of 5, two global), counted alike by
    `llmrun show`'s torch-free count, the registry's and the allocated cache."""
    hf, _ = e2b
    cache = ours(hf).new_cache(1, 64, torch.float32, "cpu")
    assert len(cache.windows) == 6
    config = hf.config.to_dict()
    assert inspect.kv_cache_bytes(config, 64) == kv_cache_bytes(config, 64) == cache.nbytes
    assert cache.nbytes == 2 * 2 * 32 * 4 * (4 * 5 + 2 * 64)


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks: one sequence on shuffled blocks (f32, f16), rows of a
    batch sharing prefix blocks, the windowed layers in a pool of their own; the sharing
    layers read their source layers' blocks."""
    _, hf, expected = family
    check_paged(ours(hf), IDS, expected, "gemma3n", monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_holds_its_rounded_values(e2b, cache_type):
    hf, expected = e2b
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_native_and_static_decode_steps_are_not_attached(e2b, tmp_path):
    """Neither knows AltUp, per-layer inputs or shared keys."""
    loaded = load_model(write_gemma3n_gguf(tmp_path / "m.gguf", e2b[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(loaded.model)
    cache = loaded.model.new_cache(1, 32, torch.float32, "cpu")
    assert not static_decode.supported(loaded.model, cache)


def test_gguf_defaults_and_refusals(e2b, tmp_path):
    """Without Gemma3NModel's keys, llama.cpp's values: 4 streams, stream 0, 256 wide,
    the first 20 layers with keys (all 8 here), the first 10 sparse at 0.95, every
    fifth layer global. No window, or no stacked projections: refused."""
    hf, _ = e2b
    path = write_gemma3n_gguf(tmp_path / "d.gguf", hf, keys=False)
    config = config_from_gguf(read_gguf(path, with_tensors=False))
    assert config["altup_num_inputs"] == 4 and config["altup_active_idx"] == 0
    assert config["hidden_size_per_layer_input"] == 256
    assert config["num_kv_shared_layers"] == 0
    assert config["activation_sparsity_std_multipliers"] == [1.6448533535003662] * 8
    assert config["layer_types"] == [S, S, S, S, F, S, S, S]
    assert config["laurel_rank"] == 8
    with pytest.raises(ModelFormatError, match="sliding_window"):
        load_model(write_gemma3n_gguf(tmp_path / "w.gguf", hf, window=False), CPU, "f32")
    with pytest.raises(ModelFormatError, match="altup_projections"):
        load_model(write_gemma3n_gguf(tmp_path / "s.gguf", hf, stack=False), CPU, "f32")


def test_the_sparsity_scales_are_transformers_cutoffs(e2b, tmp_path):
    """The GGUF's std multipliers (icdf, -inf for dense layers) give the cutoffs
    transformers computes from the sparsities."""
    hf, _ = e2b
    path = write_gemma3n_gguf(tmp_path / "m.gguf", hf)
    config = config_from_gguf(read_gguf(path, with_tensors=False))
    scales = config["activation_sparsity_std_multipliers"]
    assert [math.isinf(s) for s in scales] == [s == 0 for s in E2B["activation_sparsity_pattern"]]
    assert ours(hf).args.std_multipliers == [None if math.isinf(s) else s for s in scales]


def test_llmrun_run_and_show(e2b, tmp_path):
    hf, _ = e2b
    path = write_gemma3n_gguf(tmp_path / "gemma3n.gguf", hf)
    check_run_and_show(hf, path, "gemma3n")
    check_show(path, "gemma3n", 2 * 2 * 32 * 4 * (4 * 5 + 2 * 8192))


def test_serves_concurrent_requests_as_it_runs_them_alone(e2b, tmp_path):
    """serve's scheduler (a paged pool, the local layers in window blocks, the sharing
    layers reading their sources' blocks) decodes four requests together, each getting
    the text it gets alone."""
    engine = api.load(str(write_gemma3n_gguf(tmp_path / "m.gguf", e2b[0])), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "The sun was"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 20, parallel=4)

"""MiniCPM 1/2/4 (MiniCPMForCausalLM, the Hub's remote code, not in transformers) against
transformers' GraniteForCausalLM, which computes MiniCPM's math with
    embedding_multiplier = scale_emb,
    residual_multiplier  = scale_depth / sqrt(num_hidden_layers),
    logits_scaling       = hidden_size / dim_model_base,
    attention_multiplier = head_dim^-0.5 (MiniCPM's scores are Llama's),
and with MiniCPM4's LongRoPE as its rope_parameters: the short and long factors, or
the long ones for both where max_position_embeddings exceeds the original context (what
MiniCPMLongRoPE takes at every position then, where transformers' choice goes by the
sequence's length); from the config.json MiniCPM has (minicpm_config) and from a
"minicpm" GGUF written as llama.cpp's
converter writes it (conversion/minicpm.py MiniCPMModel: TextModel's keys, q/k rows
permuted as Llama's, embedding_scale, residual_scale and logit_scale, LongRoPE as
rope.scaling.type "longrope" with rope_factors_long/short).

Its features each move the logits by far more than the tolerance: each of the three
scalars (set to 1 instead), LongRoPE's short factors (plain RoPE instead) and its
attention factor (a context four times the original: sqrt(1 + ln 4 / ln 64)).

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time, the native decode step included, which
runs MiniCPM as Granite), contiguous or paged. An f16 or bf16 cache: 1e-5 against an f32
cache that stores the values rounded to the type, and DRIFT from f32. A Q8_0 GGUF
against transformers run on the weights gguf dequantizes: 1e-4.
"""

import json
import math

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from family_checks import hf_model_of as hf_model_from
from helpers import BASE, _permute, cached_logits, gguf_name, our_model, save_hf_dir

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models.minicpm import ModelArgs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
# MiniCPM's scalars: scale_emb 12 and scale_depth 1.4 as released; dim_model_base 16
# (released: 256 of hidden sizes 1024 to 4096) so the logits are divided by 4.
SCALE_EMB, SCALE_DEPTH, DIM_MODEL_BASE = 12.0, 1.4, 16
MINICPM = dict(
    BASE, model_type="minicpm", rope_theta=10000.0, tie_word_embeddings=True, rope_scaling=None
)
SHORT = [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.1e-3, bf16 8.3e-3 (plain RoPE).
DRIFT = {"f16": 1e-2, "bf16": 5e-2}


def longrope(original: int) -> dict:
    """MiniCPM4's rope_scaling, with an original context of `original` positions."""
    return dict(
        rope_type="longrope",
        short_factor=SHORT,
        long_factor=LONG,
        original_max_position_embeddings=original,
    )


def hf_model(scale_emb=SCALE_EMB, scale_depth=SCALE_DEPTH, dim_model_base=DIM_MODEL_BASE, **over):
    """The tiny random MiniCPM as transformers' GraniteForCausalLM (f32, eval; vocabulary
    of 512): MiniCPM's scalars (and `over`: its other config fields, rope_scaling
    included) mapped as the module docstring says. The MiniCPM config.json it stands
    for is its `minicpm_config`."""
    minicpm = dict(
        MINICPM, scale_emb=scale_emb, scale_depth=scale_depth, dim_model_base=dim_model_base
    )
    minicpm.update(over)
    config = {k: v for k, v in minicpm.items() if k not in ("scale_emb", "scale_depth")}
    del config["dim_model_base"], config["rope_scaling"]
    rope = minicpm.get("rope_scaling")
    if rope is not None:
        factors = dict(rope)
        if config["max_position_embeddings"] > rope["original_max_position_embeddings"]:
            factors["short_factor"] = rope["long_factor"]  # MiniCPMLongRoPE's choice
        config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), **factors}
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    model = hf_model_from(
        dict(
            config,
            model_type="granite",
            embedding_multiplier=scale_emb,
            residual_multiplier=scale_depth / math.sqrt(config["num_hidden_layers"]),
            logits_scaling=config["hidden_size"] / dim_model_base,
            attention_multiplier=head_dim**-0.5,
        )
    )
    model.minicpm_config = minicpm
    return model


def minicpm_config(hf) -> dict:
    """The config.json MiniCPM has for the Granite model `hf` (made by hf_model)."""
    return dict(hf.minicpm_config)


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(minicpm_config(hf), hf.state_dict())


def write_minicpm_gguf(
    path, hf, qtype=None, scales: bool = True, rope_factors: bool = True, extra=None
):
    """The model as llama.cpp's converter writes MiniCPM: TextModel's keys (no key
    length: MiniCPM's config has no head_dim), the three scalars (without `scales`, as
    older converters wrote none), LongRoPE's type and factor tensors where the model has
    it (without `rope_factors`, the tensors left out), q/k rows permuted as Llama's, the
    tied output not written, 2-D weights in `qtype` (default F32). `extra`: uint32 keys
    ("{arch}." templates) to add, for the refusals."""
    config = hf.config
    writer = gguf_writer(path, "minicpm", config, key_length=False)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if scales:
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    for template, number in (extra or {}).items():
        writer.add_uint32(template.format(arch="minicpm"), number)
    state = dict(hf.state_dict())
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    rope = minicpm_config(hf)["rope_scaling"]
    if rope is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        if rope_factors:
            state["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
            state["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in state.items():
        part = name.split(".")[-2]
        if part in heads:
            state[name] = torch.from_numpy(_permute(tensor.numpy(), heads[part]))

    def name_of(name: str) -> str:
        return name if name.startswith("rope_factors") else gguf_name(name)

    return finish_stories_gguf(writer, path, state, name_of, qtype)


@pytest.fixture(scope="module", params=["default", "longrope"])
def family(request):
    """MiniCPM 1/2 (plain RoPE) and MiniCPM4 with its context extended (LongRoPE of an
    original context of 64 in a maximum of 256: the long factors, scaled)."""
    over = {} if request.param == "default" else dict(rope_scaling=longrope(64))
    hf = hf_model(**over)
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 1
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits():
    """Each scalar at 1, plain RoPE instead of LongRoPE, and LongRoPE's short factors
    unscaled instead of its long ones scaled (an original context of 256, not of 64, in
    256): each changes the logits by far more than the tolerance, and llmrun follows
    each variant."""
    expected = reference(hf_model(rope_scaling=longrope(64)))
    for variant in (
        dict(scale_emb=1.0, rope_scaling=longrope(64)),
        dict(scale_depth=1.0, rope_scaling=longrope(64)),
        dict(dim_model_base=64, rope_scaling=longrope(64)),
        dict(),
        dict(rope_scaling=longrope(256)),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.05
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_a_config_without_scalars_takes_minicpm_configs_defaults():
    args = ModelArgs.from_config(dict(BASE, model_type="minicpm"))
    assert args.embedding_multiplier == 1.0
    assert args.residual_multiplier == pytest.approx(2**-0.5)
    assert args.logits_scaling == 64 and args.attention_multiplier == 0.25


def test_experts_and_other_head_sizes_are_refused():
    with pytest.raises(UnsupportedError, match="MiniCPM-MoE"):
        ModelArgs.from_config(dict(BASE, model_type="minicpm", num_experts=8))
    with pytest.raises(UnsupportedError, match="kv_channels 32"):
        ModelArgs.from_config(dict(BASE, model_type="minicpm", kv_channels=32))
    assert ModelArgs.from_config(dict(BASE, model_type="minicpm", kv_channels=16)).head_dim == 16


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    path = save_hf_dir(hf, tmp_path / "hf")
    config = minicpm_config(hf)
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


# The GGUF's models: MiniCPM 1/2, and MiniCPM4 with LongRoPE's original context the
# whole context, as the released MiniCPM4's (the converter writes no original context,
# so llama.cpp takes the context length for it).
VARIANTS = {"default": {}, "longrope": dict(rope_scaling=longrope(256))}


@pytest.fixture(scope="module", params=list(VARIANTS))
def gguf_family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


def test_a_gguf_matches_transformers(gguf_family, tmp_path):
    hf, expected = gguf_family
    path = write_minicpm_gguf(tmp_path / "m.gguf", hf)
    config = config_from_gguf(read_gguf(path))
    assert config["model_type"] == "minicpm" and config["scale_emb"] == SCALE_EMB
    assert config["scale_depth"] == pytest.approx(SCALE_DEPTH, rel=1e-6)
    assert config["dim_model_base"] == pytest.approx(DIM_MODEL_BASE, rel=1e-6)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_the_gguf_longrope_factors_matter(tmp_path):
    """The factor tensors move the logits; a longrope file without them is refused."""
    hf = hf_model(rope_scaling=longrope(256))
    plain = hf_model()
    assert max_diff(reference(hf), reference(plain)) > 0.05
    path = write_minicpm_gguf(tmp_path / "m.gguf", hf, rope_factors=False)
    with pytest.raises(ModelFormatError, match="'longrope' without its rope_factors"):
        load_model(path, CPU, "f32")


@pytest.mark.parametrize(
    "extra,error,message",
    [
        ({gguf.Keys.LLM.EXPERT_COUNT: 8}, UnsupportedError, "experts \\(MiniCPM-MoE\\)"),
        ({gguf.Keys.Rope.DIMENSION_COUNT: 8}, ModelFormatError, "rotates whole heads"),
    ],
)
def test_experts_and_partial_rope_in_a_gguf_are_refused(tmp_path, extra, error, message):
    path = write_minicpm_gguf(tmp_path / "m.gguf", hf_model(), extra=extra)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(rope_scaling=longrope(256))
    loaded = load_model(write_minicpm_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_scalars_takes_the_released_models(tmp_path):
    """Older converters wrote no scalars: scale_emb 12, scale_depth 1.4, dim_model_base
    256 (a hidden size of 64: the logits multiplied by 4)."""
    hf = hf_model(dim_model_base=256)
    loaded = load_model(write_minicpm_gguf(tmp_path / "m.gguf", hf, scales=False), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_gives_the_torch_logits(gguf_family, tmp_path, monkeypatch):
    """The loader attaches the native step (MiniCPM is Granite's model); its decoded
    logits are those of the torch layers."""
    hf, _ = gguf_family
    path = write_minicpm_gguf(tmp_path / "m.gguf", hf)
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model(rope_scaling=longrope(256))
    path = write_minicpm_gguf(tmp_path / "minicpm.gguf", hf)
    check_run_and_show(hf, path, "minicpm")
    assert inspect.describe(path)["architecture"] == "minicpm"

"""Ministral (Ministral-8B-Instruct-2410) against transformers' MinistralForCausalLM, from
a config.json: Mistral whose layers are each sliding (a window of 5 under 40 tokens here)
or full, as `layer_types` says. llama.cpp has no converter for MinistralForCausalLM (the
Hub's Ministral-8B-2410 files say MistralForCausalLM, which it writes as "llama" with no
window), so there is no GGUF of it to read.

Its feature moves the logits by far more than the tolerance: the window (every layer
full instead), and which layers have it (every layer sliding instead).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous, paged,
or with the sliding layers in a pool of their own. An f16 or bf16 cache: 1e-5 against an
f32 cache that stores the values rounded to the type, and DRIFT from f32.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
)
from family_checks import hf_model_of as hf_model_from
from helpers import BASE, cached_logits, our_model, save_hf_dir

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.models.ministral import ModelArgs

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
MINISTRAL = dict(
    BASE,
    model_type="ministral",
    num_hidden_layers=3,
    head_dim=32,
    sliding_window=5,
    layer_types=LAYERS,
    rope_theta=10000.0,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 7.3e-3, bf16 6.4e-2.
DRIFT = {"f16": 2e-2, "bf16": 0.15}


def hf_model(**overrides):
    """The tiny random MinistralForCausalLM (f32, eval; vocabulary of 512)."""
    return hf_model_from({**MINISTRAL, **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits():
    """Every layer full (no window), or every layer sliding: each changes the logits by
    far more than the tolerance, and llmrun follows each variant."""
    expected = reference(hf_model())
    for variant in (
        dict(layer_types=["full_attention"] * 3),
        dict(layer_types=["sliding_attention"] * 3),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_without_layer_types_every_layer_takes_the_window():
    """As MinistralConfig: no layer_types means every layer sliding where a window is
    set, every layer full where none is."""
    config = {k: v for k, v in MINISTRAL.items() if k != "layer_types"}
    assert ModelArgs.from_config(config).layer_windows() == [5, 5, 5]
    assert ModelArgs.from_config({**config, "sliding_window": None}).layer_windows() == [None] * 3


def test_bad_layer_types_are_refused():
    with pytest.raises(UnsupportedError, match="layer type 'linear_attention'"):
        ModelArgs.from_config({**MINISTRAL, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ModelFormatError, match="need a sliding_window"):
        ModelArgs.from_config({**MINISTRAL, "sliding_window": None})


def test_the_kv_cache_keeps_only_the_window_of_sliding_layers(family, tmp_path):
    """The model's cache and `llmrun show`'s count alike."""
    hf, _ = family
    full = kv_cache_bytes({**MINISTRAL, "layer_types": ["full_attention"] * 3}, 1000)
    assert kv_cache_bytes(MINISTRAL, 1000) < full / 2
    path = save_hf_dir(hf, tmp_path / "hf")
    assert inspect.describe(path)["kv_cache_bytes_8k"] == kv_cache_bytes(MINISTRAL, 8192)


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_the_native_decode_step_gives_the_torch_logits(family, tmp_path, monkeypatch):
    """The loader attaches the native step (each layer's window its own); its decoded
    logits are those of the torch layers, the sliding layers' cache keeping only their
    window or every position."""
    hf, _ = family
    path = save_hf_dir(hf, tmp_path / "hf")
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5
    native.args.layer_windows, plain.args.layer_windows = (lambda: [None] * 3,) * 2
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks of serve's paged KV cache, the sliding layers also in a
    pool of their own whose blocks are let go and reused."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected, windowed="ministral", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, save_hf_dir(hf, tmp_path / "hf", tokenizer=True), "ministral")

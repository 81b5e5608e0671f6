"""Code World Model (llmrun/models/cwm.py) against transformers' CwmForCausalLM: its Hub
folder on one tiny random model (3 layers, hidden 64, window 5 under 40 tokens), its
config.json without layer_types or RoPE settings, so that CwmConfig's defaults apply
(layer 0 full, layers 1 and 2 sliding; Llama 3's scaled RoPE of base 1e6), and with a
stray attention_bias that CWM ignores. llama.cpp has no converter for
CwmForCausalLM: folders only.

Each default, read otherwise, moves the logits by far more than the tolerance
(test_each_default_moves_the_logits): a model that read no layer types as all sliding
(Ministral's default) or all full, or that took RoPE's base 10000 where the config gives
none, fails.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole,
through the KV cache (prefills in chunks, then one token at a time, through the native
decode step) and the paged cache (the sliding layers also in a pool of their own).
`llmrun run` picks transformers' 8 greedy token ids.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import cwm

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.cwm")

CPU = torch.device("cpu")
CONFIG = dict(BASE, model_type="cwm", num_hidden_layers=3, head_dim=16, sliding_window=5)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    return hf_model_of(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    """The Hub folder (stories260K's tokenizer), its config.json leaving the layer types
    and RoPE to CwmConfig's defaults."""
    path = save_hf_dir(hf, tmp_path_factory.mktemp("cwm") / "cwm", tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config["rope_parameters"]["rope_type"] == "llama3"
    for key in ("layer_types", "rope_parameters"):
        del config[key]
    config.update(rope_theta=10000.0, attention_bias=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(
    hf, expected, folder, monkeypatch
):
    # transformers reads the folder's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "cwm"
    assert loaded.model.args.layer_windows() == [None, 5, 5]
    assert loaded.model.decode_step is not None  # the native step: Ministral's
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected, windowed="ministral", monkeypatch=monkeypatch)
    check_run_token_ids(hf, folder, tokens=8)
    # One full layer's keys and values of 2 heads of 16 over 8192 positions, two sliding
    # layers' over their window of 5; f32.
    check_show(folder, "cwm", 2 * 2 * 16 * 4 * (8192 + 2 * 5))


DEFAULTS_MISREAD = {
    "every layer sliding": dict(layer_types=["sliding_attention"] * 3),
    "every layer full": dict(layer_types=["full_attention"] * 3),
    "RoPE base 10000": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


@pytest.mark.parametrize("case", list(DEFAULTS_MISREAD))
def test_each_default_moves_the_logits(expected, case):
    """The model with one default read otherwise (same weights) is far from transformers'
    logits; llmrun follows that config too."""
    variant = hf_model_of({**CONFIG, **DEFAULTS_MISREAD[case]})
    logits = reference(variant)
    assert max_diff(logits, expected) > 0.1
    ours = our_model(variant.config.to_dict(), variant.state_dict())
    assert max_diff(cached_logits(ours, IDS), logits) < 1e-4


def test_a_bare_config_takes_cwmconfigs_defaults():
    """A config.json giving only the sizes reads as transformers' CwmConfig() (facebook/cwm's
    shape), and `llmrun show` counts the KV cache the model allocates."""
    from llmrun.loading import inspect
    from llmrun.models import kv_cache_bytes

    hf = transformers.CwmConfig()
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    sizes += ("num_key_value_heads", "vocab_size")
    bare = {"model_type": "cwm", **{k: getattr(hf, k) for k in sizes}}
    args = cwm.ModelArgs.from_config(bare)
    windows = [
        hf.sliding_window if kind == "sliding_attention" else None for kind in hf.layer_types
    ]
    assert args.layer_windows() == windows
    assert (args.head_dim, args.rms_norm_eps) == (hf.head_dim, hf.rms_norm_eps)
    assert args.rope_parameters == hf.rope_parameters
    assert inspect.kv_cache_bytes(bare, 8192) == kv_cache_bytes(hf.to_dict(), 8192)


def test_a_null_window_is_refused():
    """CwmConfig refuses `sliding_window: null`; llmrun does not run it as full attention."""
    with pytest.raises(ModelFormatError, match="need a sliding_window"):
        cwm.ModelArgs.from_config({**CONFIG, "sliding_window": None})

"""Helium against transformers' HeliumForCausalLM, from a config.json and a state dict,
and from an HF folder as save_pretrained writes it. llama.cpp has no converter for it
(nothing in its conversion/ names Helium): a "helium" GGUF is refused.

Its features each move the logits by far more than the tolerance (asserted below): RoPE
on adjacent pairs (llmrun turning halves instead leaves transformers' logits), the
q/k/v biases of attention_bias (with no bias on the output projection, whose weight
alone llmrun then takes: a bias there would be a weight the folder lacks) and the
feed-forward's biases of mlp_bias.

The tiny model: 2 layers, hidden 64, 4 query heads and 2 KV heads of 16, a feed-forward
of 96, a 512-token vocabulary (stories260K's tokenizer, for `llmrun run`).

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged. An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize, save_hf_dir

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import helium
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
HELIUM = dict(BASE, model_type="helium", head_dim=16, rope_theta=10000.0)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits: f16 about 1e-3, bf16 about 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random HeliumForCausalLM (f32, eval), HELIUM with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**HELIUM, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module")
def family():
    hf = hf_model(attention_bias=True)
    return hf, reference(hf)


VARIANTS = {
    "default": {},
    "attention-bias": dict(attention_bias=True),
    "mlp-bias-mha": dict(mlp_bias=True, num_key_value_heads=4),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_is_followed(family, monkeypatch):
    """Turning halves instead of pairs leaves transformers' logits; so does dropping the
    q/k/v biases or the feed-forward's: each is the model's, not an accident."""
    hf, expected = family
    monkeypatch.setattr(helium.Attention, "rotate", lambda self, x, frame: frame.rotate(x))
    assert max_diff(cached_logits(ours(hf), IDS), expected) > 0.1
    monkeypatch.undo()
    assert max_diff(reference(hf_model()), expected) > 0.1
    assert max_diff(reference(hf_model(attention_bias=True, mlp_bias=True)), expected) > 0.1
    assert max_diff(cached_logits(ours(hf), IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "helium"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family):
    """The native step turns halves, not Helium's pairs."""
    assert not decode_step.attach(ours(family[0]))


def test_the_defaults_are_heliums():
    config = {k: v for k, v in HELIUM.items() if k not in ("rms_norm_eps", "head_dim")}
    args = helium.ModelArgs.from_config({**config, "hidden_size": 512})
    assert args.rms_norm_eps == 1e-8 and args.head_dim == 128


def test_heads_that_do_not_fill_the_hidden_size_are_refused():
    with pytest.raises(ModelFormatError, match="4 heads of 32 do not make the hidden size 64"):
        helium.ModelArgs.from_config({**HELIUM, "head_dim": 32})


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(attention_bias=True)
    path = save_hf_dir(hf, tmp_path / "helium", tokenizer=True)
    check_run_and_show(hf, path, "helium")


def test_a_helium_gguf_is_refused(tmp_path):
    """llama.cpp neither converts nor loads Helium: llmrun refuses such a file rather
    than guess its layout."""
    import numpy as np

    embd = {"token_embd.weight": np.zeros((512, 64), np.float32)}
    path = write_keyed_gguf(tmp_path / "h.gguf", "helium", {"{arch}.block_count": 2}, embd)
    with pytest.raises(UnsupportedError, match="architecture 'helium' is not supported"):
        load_model(path, CPU, "f32")

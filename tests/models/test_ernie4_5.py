"""ERNIE 4.5 dense against transformers' Ernie4_5ForCausalLM: Llama with RoPE on
adjacent pairs of each head, one use_bias for every projection, tied embeddings and
a head size of its own, from a config.json and from an "ernie4_5" GGUF written as
llama.cpp's converter writes it (F32 and Q8_0). Logits span about ±7; llmrun matches
to 1e-4 (measured 1e-5). The pairing and the biases each move the logits by units
(asserted below)."""

import pytest
import test_cache_types
import test_paged
import torch
from family_checks import check_rounded_cache, check_run_token_ids, check_static_decode
from gguf import GGMLQuantizationType
from glm_ernie_helpers import (
    IDS,
    decoded,
    dequantized,
    full,
    hf_model,
    reference,
    write_gguf,
)
from helpers import cached_logits, our_model, save_hf_dir
from in_process import llmrun

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model, open_checkpoint
from llmrun.models import ernie4_5

transformers = pytest.importorskip("transformers")

# head_dim 32, not hidden / heads = 16, as ERNIE-4.5-0.3B's 128 is not 1024 / 16.
SIZES = dict(head_dim=32, tie_word_embeddings=True)
TOLERANCE = 1e-4
# Drift from an f32 cache over test_cache_types' 40 positions (logits of ±7), measured
# f16 8.5e-3, bf16 5.9e-2, q8_0 1.7e-1: allowed about twice that.
CACHE_DRIFT = {"f16": 2e-2, "bf16": 1.2e-1, "q8_0": 4e-1}


@pytest.fixture(scope="module")
def hf():
    return hf_model("ernie4_5", **SIZES)


@pytest.fixture(scope="module")
def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


def test_matches_transformers_whole_decoding_and_in_chunks(hf, ours):
    expected = reference(hf)
    assert expected.abs().max() > 3
    assert (full(ours) - expected).abs().max() < TOLERANCE
    assert (decoded(ours) - expected).abs().max() < TOLERANCE
    assert (cached_logits(ours, IDS) - expected).abs().max() < TOLERANCE


def test_the_rope_pairing_matters(hf, ours, monkeypatch):
    monkeypatch.setattr(ernie4_5.Attention, "rotate", lambda self, x, frame: frame.rotate(x))
    assert (full(ours) - reference(hf)).abs().max() > 0.5


def test_use_bias_puts_biases_on_every_projection():
    hf = hf_model("ernie4_5", **SIZES, use_bias=True)
    ours = our_model(hf.config.to_dict(), hf.state_dict())
    layer = ours.model.layers[0]
    for module in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        assert module.bias is not None
    expected = reference(hf)
    assert (decoded(ours) - expected).abs().max() < TOLERANCE
    with torch.no_grad():
        layer.mlp.down_proj.bias.zero_()
        layer.self_attn.o_proj.bias.zero_()
    assert (full(ours) - expected).abs().max() > 0.5


def test_ernies_defaults_where_a_config_is_silent(hf):
    config = hf.config.to_dict()
    for name in ("head_dim", "rope_parameters", "rope_theta", "tie_word_embeddings"):
        config.pop(name, None)
    args = ernie4_5.ModelArgs.from_config(config)
    assert args.head_dim == 128 and args.tie_word_embeddings
    assert args.rope_parameters["rope_theta"] == 500000.0
    assert ernie4_5.ModelArgs.from_config({**config, "head_dim": None}).head_dim == 16


def test_hf_folder(hf, tmp_path):
    loaded = load_model(save_hf_dir(hf, tmp_path / "ernie"), torch.device("cpu"))
    assert (decoded(loaded.model) - reference(hf)).abs().max() < TOLERANCE


def test_gguf_as_llama_cpp_writes_it(hf, tmp_path):
    loaded = load_model(write_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"))
    assert loaded.checkpoint.config["model_type"] == "ernie4_5"
    assert "lm_head.weight" not in loaded.checkpoint.weights  # tied
    expected = reference(hf)
    assert (full(loaded.model) - expected).abs().max() < TOLERANCE
    assert (decoded(loaded.model) - expected).abs().max() < TOLERANCE
    # No native decode step: it rotates half-split pairs only.
    assert loaded.model.decode_step is None


def test_q8_0_gguf_matches_its_dequantized_weights(hf, tmp_path):
    qtype = GGMLQuantizationType.Q8_0
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf, qtype), torch.device("cpu"))
    rounded = hf_model("ernie4_5", **SIZES)
    rounded.load_state_dict(dequantized(hf, qtype))
    expected = reference(rounded)
    assert (full(loaded.model) - expected).abs().max() < TOLERANCE
    assert (decoded(loaded.model) - expected).abs().max() < TOLERANCE
    assert (decoded(loaded.model) - reference(hf)).abs().mean() < 0.1


def test_what_is_refused(hf, tmp_path):
    path = write_gguf(tmp_path / "rot.gguf", hf, add_rope_dimension_count=16)
    with pytest.raises(ModelFormatError, match="rotates whole heads of 32"):
        open_checkpoint(path)
    biased = hf_model("ernie4_5", **SIZES, use_bias=True)
    with pytest.raises(UnsupportedError, match="an ernie4_5 file with biases"):
        open_checkpoint(write_gguf(tmp_path / "bias.gguf", biased))


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_paged_cache_gives_the_contiguous_logits(ours, cache_type):
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(ours, cache_type)


def test_paged_batched_rows_give_their_own_logits(ours):
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(ours)


@pytest.mark.parametrize("cache_type", test_cache_types.TYPES)
def test_cache_types_give_an_f32_cache_of_their_rounded_values(ours, cache_type):
    check_rounded_cache(ours, cache_type, CACHE_DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(ours, monkeypatch):
    """The step CUDA graphs capture (llmrun.static_decode), run eagerly on CPU."""
    check_static_decode(ours, monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(hf, tmp_path):
    check_run_token_ids(hf, write_gguf(tmp_path / "ernie.gguf", hf))


def test_show(hf, tmp_path):
    result = llmrun("show", str(write_gguf(tmp_path / "ernie.gguf", hf)))
    assert result.returncode == 0, result.stderr
    assert "ernie4_5" in result.stdout

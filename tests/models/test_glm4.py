"""GLM-4 0414 against transformers' Glm4ForCausalLM: RoPE on adjacent pairs of the first
half of each head, q/k/v biases, the fused gate_up MLP and four norms a layer, from a
config.json and from a "glm4" GGUF written as llama.cpp's converter writes it (F32 and
Q8_0). Logits span about ±8; llmrun matches to 1e-4 (measured 1e-5). The features each
move the logits by units (asserted below for the RoPE pairing and the rotated share,
checked by hand for the others: the tests fail without each)."""

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

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model, open_checkpoint
from llmrun.models import base, glm4

transformers = pytest.importorskip("transformers")

# head_dim 32, of which the first 16 rotate; GQA 4:2.
SIZES = dict(head_dim=32, partial_rotary_factor=0.5)
TOLERANCE = 1e-4
# Drift from an f32 cache over test_cache_types' 40 positions (logits of ±6), measured
# f16 7.3e-3, bf16 5.5e-2, q8_0 1.9e-1: allowed about twice that.
CACHE_DRIFT = {"f16": 1.5e-2, "bf16": 1e-1, "q8_0": 4e-1}


@pytest.fixture(scope="module")
def hf():
    return hf_model("glm4", **SIZES)


@pytest.fixture(scope="module")
def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


def test_matches_transformers_whole_decoding_and_in_chunks(hf, ours):
    expected = reference(hf)
    assert expected.abs().max() > 3
    assert (full(ours) - expected).abs().max() < TOLERANCE
    assert (decoded(ours) - expected).abs().max() < TOLERANCE
    assert (cached_logits(ours, IDS) - expected).abs().max() < TOLERANCE


def test_the_rope_pairing_and_the_rotated_share_matter(hf, ours, monkeypatch):
    expected = reference(hf)
    whole_heads = hf_model("glm4", **{**SIZES, "partial_rotary_factor": 1.0})
    assert (reference(whole_heads) - expected).abs().max() > 0.5
    monkeypatch.setattr(glm4.Attention, "rotate", lambda self, x, frame: frame.rotate(x))
    assert (full(ours) - expected).abs().max() > 0.5  # half-split pairs: another model


def test_a_config_without_partial_rotary_factor_rotates_half_of_each_head(hf):
    config = {k: v for k, v in hf.config.to_dict().items() if k != "partial_rotary_factor"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    args = glm4.ModelArgs.from_config(config)
    assert args.rope_parameters["partial_rotary_factor"] == 0.5
    assert base.RotaryEmbedding(args.rope_parameters, 32, 256).rotary_dim == 16


def test_a_config_of_the_older_style_reads_the_same(hf):
    """rope_theta and partial_rotary_factor at the top level, as the 0414 releases have them."""
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    config.update(rope_theta=10000.0, partial_rotary_factor=0.25)
    args = glm4.ModelArgs.from_config(config)
    assert args.rope_parameters["partial_rotary_factor"] == 0.25
    assert args.rope_parameters["rope_theta"] == 10000.0


def test_hf_folder(hf, tmp_path):
    loaded = load_model(save_hf_dir(hf, tmp_path / "glm4"), torch.device("cpu"))
    assert (decoded(loaded.model) - reference(hf)).abs().max() < TOLERANCE


def test_gguf_as_llama_cpp_writes_it(hf, tmp_path):
    loaded = load_model(write_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"))
    assert loaded.checkpoint.config["model_type"] == "glm4"
    assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == 0.5
    expected = reference(hf)
    assert (full(loaded.model) - expected).abs().max() < TOLERANCE
    assert (decoded(loaded.model) - expected).abs().max() < TOLERANCE
    # No native decode step: it has neither pair RoPE nor the fused gate_up.
    assert loaded.model.decode_step is None


def test_q8_0_gguf_matches_its_dequantized_weights(hf, tmp_path):
    qtype = GGMLQuantizationType.Q8_0
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf, qtype), torch.device("cpu"))
    rounded = hf_model("glm4", **SIZES)
    rounded.load_state_dict(dequantized(hf, qtype))
    expected = reference(rounded)
    assert (full(loaded.model) - expected).abs().max() < TOLERANCE
    assert (decoded(loaded.model) - expected).abs().max() < TOLERANCE
    # 8-bit blocks move logits of ±8 by about 0.02 on average.
    assert (decoded(loaded.model) - reference(hf)).abs().mean() < 0.1


def test_gguf_without_rope_dimension_count_rotates_whole_heads(tmp_path):
    """llama.cpp's n_rot defaults to the head size, not to Glm4Config's half."""
    whole = hf_model("glm4", **{**SIZES, "partial_rotary_factor": 1.0})
    path = write_gguf(tmp_path / "m.gguf", whole, add_rope_dimension_count=None)
    loaded = load_model(path, torch.device("cpu"))
    assert (decoded(loaded.model) - reference(whole)).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    "arch,metadata,message",
    [
        # GLM-4.1V's M-RoPE is read (tests/models/test_vl_text.py), not a fourth section's.
        ("glm4", {"add_rope_dimension_sections": [2, 2, 2, 2]}, "by position 0"),
    ],
)
def test_what_is_refused(hf, tmp_path, arch, metadata, message):
    path = write_gguf(tmp_path / "m.gguf", hf, arch=arch, **metadata)
    with pytest.raises(UnsupportedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        open_checkpoint(path)


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
    check_run_token_ids(hf, write_gguf(tmp_path / "glm4.gguf", hf))


def test_show(hf, tmp_path):
    path = write_gguf(tmp_path / "glm4.gguf", hf)
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "glm4" in result.stdout

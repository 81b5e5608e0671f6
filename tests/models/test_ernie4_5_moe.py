"""ERNIE 4.5 with experts against transformers' Ernie4_5_MoeForCausalLM: a leading dense
layer, then mixtures of 8 experts (top 3) whose choice adds a per-expert bias, with two
shared experts, from the Hub's checkpoint keys (one per expert, the bias under
mlp.moe_statics, multi-token-prediction layers to skip) and from an "ernie4_5-moe" GGUF
written as llama.cpp's converter writes it (stacked experts, F32 and Q8_0). Logits span
about ±7; llmrun matches to 1e-4 (measured 2e-5). The selection bias and the shared
experts each move the logits by units (asserted below)."""

import pytest
import test_cache_types
import test_paged
import torch
from family_checks import check_rounded_cache, check_run_token_ids
from gguf import GGMLQuantizationType
from glm_ernie_helpers import (
    IDS,
    decoded,
    dequantized,
    full,
    hf_model,
    hub_state,
    reference,
    write_gguf,
)
from helpers import cached_logits
from in_process import llmrun
from moe_helpers import save_hub_dir

from llmrun import static_decode
from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model, open_checkpoint
from llmrun.models import model_module
from llmrun.models.base import GatedMLP
from llmrun.models.ernie4_5_moe import SparseMoeBlock

transformers = pytest.importorskip("transformers")

# The shared experts are 2 x 32 wide: the intermediate_size // num_key_value_heads that
# llama.cpp's converter writes as their width (128 // 2).
SIZES = dict(
    head_dim=32,
    num_hidden_layers=3,
    intermediate_size=128,
    moe_num_experts=8,
    moe_k=3,
    moe_intermediate_size=32,
    moe_num_shared_experts=2,
    moe_layer_start_index=1,
    tie_word_embeddings=True,
)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf():
    return hf_model("ernie4_5_moe", **SIZES)


def ours_of(hf):
    module = model_module("ernie4_5_moe")
    model = module.Model(module.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(hub_state(hf), strict=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@pytest.fixture(scope="module")
def ours(hf):
    return ours_of(hf)


def test_matches_transformers_whole_decoding_and_in_chunks(hf, ours):
    expected = reference(hf)
    assert expected.abs().max() > 3
    assert (full(ours) - expected).abs().max() < TOLERANCE
    assert (decoded(ours) - expected).abs().max() < TOLERANCE
    assert (cached_logits(ours, IDS) - expected).abs().max() < TOLERANCE


def test_use_bias_leaves_the_experts_without_biases():
    hf = hf_model("ernie4_5_moe", **SIZES, use_bias=True)
    ours = ours_of(hf)  # loads strictly: the same parameters
    assert ours.model.layers[1].mlp.experts[0].down_proj.bias is None
    assert ours.model.layers[1].mlp.shared_experts.down_proj.bias is not None
    assert (decoded(ours) - reference(hf)).abs().max() < TOLERANCE


def test_a_leading_dense_layer_then_experts(ours):
    mlps = [type(layer.mlp) for layer in ours.model.layers]
    assert mlps == [GatedMLP, SparseMoeBlock, SparseMoeBlock]


def test_the_selection_bias_and_the_shared_experts_matter(hf):
    expected = reference(hf)
    for part in ("moe_statics", "shared_experts"):
        model = ours_of(hf)
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                for p in getattr(layer.mlp, part).parameters():
                    p.zero_()
        assert (full(model) - expected).abs().max() > 0.5, part


def test_hub_folder_with_its_mtp_layers(hf, tmp_path):
    state = hub_state(hf)
    state["model.mtp_block.0.input_layernorm.weight"] = torch.ones(64)  # skipped
    path = save_hub_dir(tmp_path / "ernie", hf.config.to_dict(), state)
    loaded = load_model(path, torch.device("cpu"))
    assert (decoded(loaded.model) - reference(hf)).abs().max() < TOLERANCE


def test_gguf_as_llama_cpp_writes_it(hf, tmp_path):
    loaded = load_model(write_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"))
    config = loaded.checkpoint.config
    assert config["model_type"] == "ernie4_5_moe"
    assert (config["moe_num_experts"], config["moe_k"], config["moe_num_shared_experts"]) == (
        8,
        3,
        2,
    )
    expected = reference(hf)
    assert (full(loaded.model) - expected).abs().max() < TOLERANCE
    assert (decoded(loaded.model) - expected).abs().max() < TOLERANCE
    assert loaded.model.decode_step is None  # no native step: pair RoPE, biased routing


def test_q8_0_gguf_matches_its_dequantized_weights(hf, tmp_path):
    qtype = GGMLQuantizationType.Q8_0
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf, qtype), torch.device("cpu"))
    rounded = hf_model("ernie4_5_moe", **SIZES)
    rounded.load_state_dict(dequantized(hf, qtype))
    assert (decoded(loaded.model) - reference(rounded)).abs().max() < TOLERANCE


def test_what_is_refused(hf, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf, add_interleave_moe_layer_step=2)
    with pytest.raises(UnsupportedError, match="interleave_moe_layer_step is 2"):
        open_checkpoint(path)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_paged_cache_gives_the_contiguous_logits(ours, cache_type):
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(ours, cache_type)


def test_paged_batched_rows_give_their_own_logits(ours):
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(ours)


@pytest.mark.parametrize("cache_type", test_cache_types.TYPES)
def test_cache_types_give_an_f32_cache_of_their_rounded_values(ours, cache_type):
    # The storage rounds. How far that moves the logits is no bound to test: a rounding
    # can send a token to other experts (q8_0 does here: 0.9, as with gpt-oss).
    check_rounded_cache(ours, cache_type)


def test_no_static_decode_step(ours):
    """Its routers read their choices back to the host: no CUDA graph can hold them."""
    assert not static_decode.supported(ours, ours.new_cache(1, 32, torch.float32, "cpu"))


def test_llmrun_run_prints_transformers_greedy_text(hf, tmp_path):
    check_run_token_ids(hf, write_gguf(tmp_path / "ernie-moe.gguf", hf), text=False)


def test_show(hf, tmp_path):
    """The architecture, and the parameters a token uses: 3 of 8 experts."""
    folder = save_hub_dir(tmp_path / "ernie", hf.config.to_dict(), hub_state(hf))
    gguf_path = write_gguf(tmp_path / "m.gguf", hf)
    for path, arch in ((gguf_path, "ernie4_5-moe"), (folder, "ernie4_5_moe")):
        result = llmrun("show", str(path))
        assert result.returncode == 0, result.stderr
        assert arch in result.stdout
        assert "active a token" in result.stdout

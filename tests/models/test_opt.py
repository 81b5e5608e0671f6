"""OPT against transformers' OPTForCausalLM, from a config.json and a state dict, and from
an HF folder as save_pretrained writes it (model.decoder.*) or as facebook/opt-* hold it
(OPTModel's decoder.*, no lm_head). llama.cpp has no converter for OPT: no GGUF to read.

Its features each move the logits by far more than the tolerance (asserted below): the
position offset of 2, post-LN layers without a final norm (do_layer_norm_before false, as
opt-350m), project_in/out (word_embed_proj_dim), the ReLU (against GELU), the biases
(enable_bias false drops them), LayerNorms without weights.

The tiny model: 2 layers, hidden 64, 4 heads of 16, a feed-forward of 128, a 512-token
vocabulary (stories260K's, so `llmrun run` decodes it).

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged. An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import cached_logits, our_model, save_hf_dir
from in_process import llmrun

from llmrun.loading import inspect
from llmrun.loading import opt as loading
from llmrun.loading.loader import load_model
from llmrun.models import opt
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
OPT = dict(
    model_type="opt",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=128,
    vocab_size=512,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits: f16 about 1e-3, bf16 about 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}
VARIANTS = {
    "default": {},
    "post-ln": dict(do_layer_norm_before=False),  # opt-350m
    "projected": dict(word_embed_proj_dim=32),  # opt-350m's 512 in a 1024 model
    "post-ln-projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
    "no-bias": dict(enable_bias=False),
    "no-affine": dict(layer_norm_elementwise_affine=False),
    "gelu": dict(activation_function="gelu"),
    "untied": dict(tie_word_embeddings=False),
}


def hf_model(**overrides):
    """A tiny random OPTForCausalLM (f32, eval), OPT with `overrides`."""
    return hf_model_of({**OPT, **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), loading.hf_weights(hf.state_dict()))


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(3, 11, 9)), expected) < 1e-4


def test_each_variant_moves_transformers_logits(family):
    """Each variant llmrun follows above is a different model, not the same one again."""
    _, expected = family
    for name, overrides in VARIANTS.items():
        if name not in ("default", "untied"):
            assert max_diff(reference(hf_model(**overrides)), expected) > 0.1, name


def test_the_position_offset_is_followed(family, monkeypatch):
    """Positions read the table two rows on: llmrun without the offset leaves
    transformers' logits."""
    hf, expected = family
    model = ours(hf)
    monkeypatch.setattr(opt, "POSITION_OFFSET", 0)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_the_biases_matter(family):
    """The attention's, the feed-forward's and the LayerNorms' biases, which llmrun takes."""
    _, expected = family
    for suffix in ("self_attn.q_proj.bias", "fc1.bias", "layer_norm.bias"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        assert max_diff(reference(changed), expected) > 0.1, suffix


@pytest.mark.parametrize("saved_as", ["OPTForCausalLM", "OPTModel"])
def test_an_hf_folder_loads_as_transformers_runs_it(tmp_path, saved_as):
    """save_pretrained writes model.decoder.*; facebook/opt-*'s files hold OPTModel's
    decoder.* and no lm_head (tied)."""
    from safetensors.torch import load_file, save_file

    hf = hf_model(word_embed_proj_dim=32, do_layer_norm_before=False)
    hf.save_pretrained(tmp_path / "hf")
    if saved_as == "OPTModel":
        file = tmp_path / "hf" / "model.safetensors"
        tensors = load_file(file)
        save_file({k.removeprefix("model."): v for k, v in tensors.items()}, file)
        assert "decoder.embed_tokens.weight" in load_file(file)
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "opt"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_hubs_names_are_llmruns():
    assert loading.hf_name("decoder.layers.3.fc1.weight") == "model.layers.3.mlp.fc1.weight"
    assert loading.hf_name("model.decoder.embed_positions.weight") == (
        "model.embed_positions.weight"
    )
    assert loading.hf_name("decoder.final_layer_norm.bias") == "model.norm.final_layer_norm.bias"
    assert loading.hf_name("model.decoder.project_out.weight") == "model.norm.project_out.weight"
    assert loading.hf_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("variant", ["default", "post-ln-projected"])
def test_serves_from_paged_blocks_as_every_family_does(variant):
    hf = hf_model(**VARIANTS[variant])
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family):
    """The native step knows no LayerNorm, post-LN layer or learned positions."""
    assert not decode_step.attach(ours(family[0]))


def test_a_position_past_the_table_is_a_full_context(family):
    from llmrun.errors import ContextOverflowError

    model = ours(family[0])
    with pytest.raises(ContextOverflowError, match="128 learned positions"):
        model(IDS[:, :1], torch.tensor([[128]]))


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    path = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    check_run_prints_greedy_tokens(hf, path)


def test_show_describes_an_opt_folder(family, tmp_path):
    path = save_hf_dir(family[0], tmp_path / "hf", tokenizer=True)
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "opt" in result.stdout
    # Two layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    assert inspect.describe(path)["kv_cache_bytes_8k"] == 2 * 2 * 4 * 16 * 4 * 8192

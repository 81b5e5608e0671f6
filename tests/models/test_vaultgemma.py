"""VaultGemma against transformers' VaultGemmaForCausalLM, from a config.json and a
state dict, and from an HF folder as save_pretrained writes it. llama.cpp has no
converter for it (nothing in its conversion/ names VaultGemma): a "vaultgemma" GGUF is
refused.

Its feature, Gemma 2's layer without the norms after attention and after the
feed-forward, moves the logits by far more than the tolerance: transformers' Gemma 2 on
the same weights (its post-norms at scale 1) is far from them. What it keeps of Gemma 2
is followed too: sliding layers (window 5, so the window hides keys at 40 tokens)
against all-global ones, the attention's soft-capping and the final one (caps of 2 and 10), each
moving the logits (asserted below, llmrun following each variant).

The tiny model: 2 layers (sliding, then global), hidden 64, 4 query heads and 2 KV heads
of 16, a feed-forward of 96, a 512-token vocabulary (stories260K's tokenizer, for
`llmrun run`), tied embeddings as VaultGemma's.

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time; the sliding layers in their ring),
contiguous or paged (the windowed layers in a pool of their own too). An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize, save_hf_dir

from llmrun import static_decode
from llmrun.errors import UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VAULTGEMMA = dict(
    BASE,
    model_type="vaultgemma",
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=5,
    # Caps low enough to bite at these weights' scores and logits (VaultGemma's 50 and
    # 30 move them by less than 0.1).
    attn_logit_softcapping=2.0,
    final_logit_softcapping=10.0,
    rope_theta=10000.0,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits: f16 about 1e-3, bf16 about 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random VaultGemmaForCausalLM (f32, eval), VAULTGEMMA with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**VAULTGEMMA, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    # Gemma's norms store the w of x * (1 + w): near 0, as randomize() gives Gemma's.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


VARIANTS = {
    "default": {},
    "all-global": dict(layer_types=["full_attention", "full_attention"]),
    "no-softcaps": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
    "untied-bias": dict(tie_word_embeddings=False, attention_bias=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family):
    """Gemma 2's post-norms on the same weights, all-global layers, and no soft-capping of
    the scores or of the logits: each leaves VaultGemma's logits far behind."""
    hf, expected = family
    config = dict(VAULTGEMMA, model_type="gemma2")
    gemma2 = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32
    ).eval()
    load_matching_weights(hf, gemma2)
    with torch.no_grad():
        for name, p in gemma2.named_parameters():
            if "post_" in name:
                p.zero_()  # scale 1: the norm alone
    assert max_diff(reference(gemma2), expected) > 0.1
    assert max_diff(reference(hf_model(**VARIANTS["all-global"])), expected) > 0.1
    assert max_diff(reference(hf_model(attn_logit_softcapping=None)), expected) > 0.1
    assert max_diff(reference(hf_model(final_logit_softcapping=None)), expected) > 0.1


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "vaultgemma"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks, the sliding layers in a pool of their own included."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected, windowed="vaultgemma", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_neither_decode_step_is_attached(family):
    """The native step knows Gemma 2's four norms, not VaultGemma's two; the static step
    takes CausalLM's families alone (Gemma 2's is not one)."""
    model = ours(family[0])
    assert not decode_step.attach(model)
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = save_hf_dir(hf, tmp_path / "vaultgemma", tokenizer=True)
    check_run_and_show(hf, path, "vaultgemma")


def test_show_counts_the_sliding_layers_cache(tmp_path):
    """`llmrun show`'s KV cache at 8192 positions: one global layer, one sliding layer
    holding its window of 5 (Gemma2Config's alternation), 2 KV heads of 16 keys and
    values of 4 bytes each."""
    hf = hf_model()
    path = save_hf_dir(hf, tmp_path / "vaultgemma")
    info = inspect.describe(path)
    assert info["architecture"] == "vaultgemma"
    assert info["kv_cache_bytes_8k"] == 2 * 2 * 16 * 4 * (8192 + 5)


def test_a_vaultgemma_gguf_is_refused(tmp_path):
    """llama.cpp neither converts nor loads VaultGemma: llmrun refuses such a file rather
    than guess its layout."""
    import numpy as np

    embd = {"token_embd.weight": np.zeros((512, 64), np.float32)}
    path = write_keyed_gguf(tmp_path / "v.gguf", "vaultgemma", {"{arch}.block_count": 2}, embd)
    with pytest.raises(UnsupportedError, match="architecture 'vaultgemma' is not supported"):
        load_model(path, CPU, "f32")

"""Google RecurrentGemma against transformers' RecurrentGemmaForCausalLM, from a
save_pretrained folder (llama.cpp has no converter for it: folders only).

The tiny model: 4 layers (recurrent, recurrent, attention, recurrent: block_types taken
in turn), hidden 48 in 4 heads of 12 (RoPE on the first 6 of each), 2 KV heads, an RG-LRU
64 wide (lru_width, not the hidden size), attention biases, a window of 5 under prompts
of 40, logits soft-capped at 4 (they span about ±4 uncapped).

Its features each move the logits by far more than the tolerance (planted below): the
attention's window, the soft cap, the RG-LRU's fresh start at position 0 (its input not
scaled there), and the embedding scale rounded to bfloat16 (sqrt(48) = 6.928 as 6.9375).

Tolerances: f32 logits 1e-4 max abs against transformers: whole, through the cache
(prefills in chunks, then one token at a time), padded rows in scattered cache rows,
serve's paged blocks with a state row; `llmrun run` and serve's scheduler print
transformers' greedy text.
"""

import pytest
import torch
from family_checks import PROMPT, check_run_and_show, check_whole_and_cached, max_diff
from family_checks import hf_model_of as hf_model_from
from helpers import BASE, cached_logits, our_model, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes, recurrent_gemma
from llmrun.models.recurrent_gemma import ModelArgs

pytest.importorskip("transformers")

CPU = torch.device("cpu")
RECURRENT_GEMMA = dict(
    BASE,
    model_type="recurrent_gemma",
    hidden_size=48,
    num_hidden_layers=4,
    lru_width=64,
    attention_bias=True,
    attention_window_size=5,
    logits_soft_cap=4.0,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module")
def family():
    hf = hf_model_from(RECURRENT_GEMMA)
    return hf, reference(hf)


def test_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """No window, no soft cap, sqrt(hidden) unrounded, no fresh start at position 0 (the
    first token's input scaled down, whose trace fades): each is off by 100 times the
    tolerance or more."""
    hf, expected = family
    model = ours(hf)
    model.args.attention_window_size = SEQ
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    model = ours(hf)
    model.args.logits_soft_cap = 1e6
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    model = ours(hf)
    model.normalizer = 48**0.5
    assert max_diff(cached_logits(model, IDS), expected) > 0.02

    def never(positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(positions, dtype=torch.bool)[..., None]

    monkeypatch.setattr(recurrent_gemma, "starts", never)
    assert max_diff(cached_logits(ours(hf), IDS), expected) > 0.01


def test_the_config_is_read_as_recurrentgemmaconfig_reads_it():
    args = ModelArgs.from_config(RECURRENT_GEMMA)
    assert args.layer_types == ["recurrent", "recurrent", "attention", "recurrent"]
    assert args.attention_layers == [2] and args.head_dim == 12
    assert args.rope_parameters["partial_rotary_factor"] == 0.5
    assert args.recurrent_shapes()[3] == [(64, 3), (64,)]
    with pytest.raises(UnsupportedError, match="'mlp'"):
        ModelArgs.from_config({**RECURRENT_GEMMA, "block_types": ["recurrent", "mlp"]})


def test_padded_rows_paged_blocks_and_no_static_step(family):
    hf, expected = family
    model = ours(hf)
    check_padded_rows_in_scattered_slots(
        model, lambda ids: reference(hf, ids), IDS, padding_repeats=True
    )
    states = model.new_cache(3, 1, "f32", "cpu").recurrent
    check_paged_with_a_state_row(model, IDS, expected, states)
    check_no_static_decode(model)


def test_run_show_and_serve_print_transformers_greedy_text(family, tmp_path):
    hf, expected = family
    path = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    loaded = load_model(path, CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_and_show(hf, path, "recurrent_gemma")
    # Only the attention layer caches keys and values, at full length (what show counts).
    per_position = 2 * 2 * 12 * 4
    assert kv_cache_bytes(hf.config.to_dict(), 10) == per_position * 10
    assert inspect.describe(path)["kv_cache_bytes_8k"] == per_position * 8192
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)

"""xLSTM (llmrun/models/xlstm.py) against transformers' xLSTMForCausalLM, from a config.json
and a state dict and from the folder save_pretrained writes. llama.cpp has no converter
for it (nothing in its conversion/ names xLSTM): folders only.

The tiny model: 2 blocks, hidden 64, 4 heads of 16 (queries, keys) and 32 (values), a
feed-forward of 192, biases (use_bias), logits soft-capped at 5 so the cap bites,
stories260K's 512-token vocabulary for `llmrun run`. Weights are randomize()'s, but the
forget gates' biases N(3, 0.5), as trained xLSTMs keep them high: a state remembers
tens of tokens, so a state lost or mis-carried moves the logits. transformers runs its
chunkwise kernel in float32 over chunks of 16 (autocast_kernel_dtype, chunk_size), then
its recurrent steps: its float32 precision, which llmrun's parallel form keeps.

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers, whole,
through the recurrent state (prefills in chunks, then one token at a time; the parallel
form in chunks of 16 too), on serve's paged view with a state row, and for rows padded
as serve pads them; serve's scheduler gives each of four prompts transformers' greedy
text. `llmrun run` picks transformers' 8 greedy token ids from the folder;
`show` names it, with no KV cache.
"""

import pytest
import torch
from family_checks import (
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import cached_logits, our_model, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import xlstm

pytest.importorskip("transformers.models.xlstm")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="xlstm",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=4,
    # transformers sizes the layers by hidden x factor and the state by those rounded up
    # to 64: they agree where hidden x factor is a multiple of 64.
    qk_dim_factor=1.0,
    v_dim_factor=2.0,
    use_bias=True,
    output_logit_soft_cap=5.0,
    autocast_kernel_dtype="float32",
    chunk_size=16,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def xlstm_model(config: dict):
    """transformers' model of `config`, randomize()'s weights but the forget gates'
    biases N(3, 0.5)."""
    hf = hf_model_of(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("fgate_preact.bias"):
                p.normal_(3.0, 0.5)
    return hf


def reference(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


@pytest.fixture(scope="module")
def hf():
    return xlstm_model(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf, IDS)


@pytest.fixture(scope="module")
def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


def test_matches_transformers_whole_and_through_its_state(ours, expected, monkeypatch):
    check_whole_and_cached(ours, IDS, expected)
    monkeypatch.setattr(xlstm, "CHUNK", 16)
    with torch.no_grad():
        assert max_diff(ours(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    check_no_static_decode(ours)


def test_padded_rows_and_serves_paged_view_keep_each_rows_state(hf, ours, expected):
    check_padded_rows_in_scattered_slots(ours, lambda ids: reference(hf, ids), IDS)
    check_padded_rows_decoded_together(ours, lambda ids: reference(hf, ids), IDS)
    check_paged_with_a_state_row(ours, IDS, expected)


def test_the_folder_runs_and_shows(hf, expected, tmp_path):
    folder = save_hf_dir(hf, tmp_path / "xLSTM", tokenizer=True)
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "xlstm"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8, text=False)
    check_show(folder, "xlstm", 0)  # no attention: no keys or values


def test_serves_concurrent_requests_with_transformers_greedy_text(hf, tmp_path):
    """serve's scheduler decodes prompts of different lengths together (padded prefills,
    a state row each), more prompts than rows: each gets transformers' greedy text."""
    folder = save_hf_dir(hf, tmp_path / "xLSTM", tokenizer=True)
    engine = api.load(str(folder), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One"]
    check_served_greedy_text(engine, hf, folder, prompts, parallel=3)


# Each of xLSTM's soft caps undone in the reference (same weights otherwise): the logits
# move by far more than the tolerance, so the parity tests check both.
FEATURES = {
    "the output soft cap": dict(output_logit_soft_cap=1e4),
    "the gates' soft cap": dict(gate_soft_cap=1.0),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(expected, feature):
    assert max_diff(reference(xlstm_model({**CONFIG, **FEATURES[feature]}), IDS), expected) > 0.1


def test_the_recurrence_needs_its_carried_state(ours, expected):
    """A forward from zeros at each chunk (the state not carried) is not the model."""
    cache = ours.new_cache(1, 64, torch.float32, "cpu")
    with torch.no_grad():
        ours(IDS[:, :20], torch.arange(20)[None], cache)
        cache.recurrent.tensors = {
            layer: [torch.zeros_like(t) for t in parts]
            for layer, parts in cache.recurrent.tensors.items()
        }
        rest = ours(IDS[:, 20:], torch.arange(20, 40)[None], cache)
    assert max_diff(rest, expected[:, 20:]) > 0.1


def test_fused_weights_are_refused():
    with pytest.raises(UnsupportedError, match="weight_mode 'fused'"):
        xlstm.ModelArgs.from_config({**CONFIG, "weight_mode": "fused"})

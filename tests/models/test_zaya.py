"""ZAYA1 (Zyphra, llmrun/models/zaya.py) against transformers' ZayaForCausalLM, on one tiny
random model: 3 layers, a sliding-window one (window 5) between global ones, each with
its RoPE base on half of each head; CCA's convolutions (2 + 2 taps) and delayed values,
learned key temperatures, 4 experts and the skip class (balancing biases drawn so that
tokens go to several experts and some to none), the router state carried from layer to
layer, tied embeddings. From config.json-style dicts (transformers' names, experts
split), and from a folder transformers saves (stacked experts), run and shown.

The state a sequence carries (the convolutions' last inputs, the previous token's
delayed values) is held to transformers' whole forward: through the KV cache (prefills
in chunks, then one token at a time), serve's paged blocks with a state row, and the
scheduler's concurrent greedy text (rows padded as serve pads them).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers. `llmrun run`
picks transformers' 8 greedy token ids from the folder.
"""

import pytest
import torch
from family_checks import check_run_token_ids, check_show, max_diff
from helpers import BASE, cached_logits, our_model, randomize, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)
from test_deepseek import hub_state_dict

from llmrun import api
from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import model_module

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.zaya")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="zaya",
    num_hidden_layers=3,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=4,
    router_hidden_size=16,
    layer_types=["hybrid", "hybrid_sliding", "hybrid"],
    sliding_window=5,
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """randomize()'s weights, key temperatures near 1 (ZayaConfig's zeros would leave
    the keys out) and balancing biases that let the skip class be chosen."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"o_proj.weight": 0.3})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.balancing_biases.normal_(0, 0.05)
            layer.self_attn.qk_norm.temp.normal_(1.0, 0.3)
    return model


def reference(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf):
    return our_model(hf.config.to_dict(), hub_state_dict(hf))


@pytest.fixture(scope="module")
def hf():
    return hf_model()


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


def routing(hf) -> tuple[set[int], int]:
    """The experts transformers' routers choose for IDS, and how many tokens skip."""
    outputs = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        for layer in hf.model.layers
    ]
    try:
        reference(hf)
    finally:
        for hook in hooks:
            hook.remove()
    chosen = {e for _, weights, indices, _ in outputs for e in indices[weights > 0].tolist()}
    return chosen, sum(int((weights == 0).sum()) for _, weights, _, _ in outputs)


def test_matches_transformers_whole_cached_and_paged(hf, expected):
    assert 3 < expected.abs().max() < 10
    chosen, skipped = routing(hf)
    assert len(chosen) > 2 and skipped > 0
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    check_paged_with_a_state_row(model, IDS, expected)
    check_no_static_decode(model)


def test_padded_rows_keep_the_state_of_their_real_tokens():
    """Rows padded on the right as serve pads them, prefilled and decoded together: each
    row's state is taken after its last real token (a padded token has a state of its
    own). All layers global: the contiguous cache's sliding-window rings take a padded
    row's repeated positions as keys (serve's paged blocks do not)."""
    hf = hf_model(layer_types=["hybrid"] * 3)
    check_padded_rows_decoded_together(ours(hf), lambda ids: reference(hf, ids), IDS)


VARIANTS = {
    "three depthwise taps": dict(cca_time0=3),
    "all global": dict(layer_types=["hybrid"] * 3),
    "one RoPE base": dict(
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
            for kind in ("hybrid", "hybrid_sliding")
        }
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_setting_moves_the_logits_and_is_followed(hf, expected, name):
    other = hf_model(**VARIANTS[name])
    own = other.state_dict()
    other.load_state_dict(
        {k: v for k, v in hf.state_dict().items() if own[k].shape == v.shape}, strict=False
    )
    moved = reference(other)
    assert max_diff(moved, expected) > 0.1
    assert max_diff(cached_logits(ours(other), IDS), moved) < 1e-4


def test_the_folder_runs_serves_and_shows(hf, expected, tmp_path):
    folder = save_hf_dir(hf, tmp_path / "ZAYA1", tokenizer=True)
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 3 layers of 2 KV heads of 16, keys and values, f32: the global ones 8192 positions,
    # the sliding one its window of 5.
    check_show(folder, "zaya", 2 * 2 * 16 * 4 * (2 * 8192 + 5), moe=True)
    engine = api.load(str(folder), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    check_served_greedy_text(engine, hf, folder, prompts, parallel=2)


def test_refuses_more_than_one_expert_a_token():
    module = model_module("zaya")
    with pytest.raises(UnsupportedError, match="num_experts_per_tok"):
        module.ModelArgs.from_config({**CONFIG, "num_experts_per_tok": 2})

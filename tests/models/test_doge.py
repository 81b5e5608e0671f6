"""Doge (llmrun/models/doge.py) against transformers' DogeForCausalLM, from a config.json
and a state dict and from the folder save_pretrained writes (its config.json scaling RoPE
"dynamic" as the Hub's do, plain within max_position_embeddings). llama.cpp has no
converter for it (nothing in its conversion/ names Doge): folders only.

Two tiny models (2 layers, hidden 64, 4 query heads and 2 KV heads of 16, biases on
attention, dt_proj and the MLP, 8 keys kept by the dynamic mask, stories260K's 512-token
vocabulary for `llmrun run`): a dense one with sliding windows of 12 and a CDMoE one (64
experts, 8 a token) without. Their weights are randomize()'s, but the residual scales
near 1 and A of N(0, 1), so that the dynamic mask's biases spread over orders of
magnitude, as biases that matter do.

What Doge computes otherwise than Llama each moves the logits by far more than the
tolerance (test_each_feature_changes_the_logits). The CDMoE model's prompt is routed by
its tokens' neighbours' router logits, as transformers routes it (its logits through
prefill chunks differ from a whole forward's by more than 0.1), a decoded token by its
own; in a batch, each row by its own tokens, padding left out (serve's scheduler gives
each of four requests the text it gets alone).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers: the dense
model whole, through the KV cache (prefills in chunks, then one token at a time) and the
paged cache, the static decode step 1e-5 against the ordinary forward, an f16 cache 1e-5
against an f32 cache holding the values rounded to f16 (drifting less than 0.1); the
CDMoE model whole, and prefilled in one forward then decoded a token at a time, against
transformers doing so with its cache. `llmrun run` picks transformers' 8 greedy token ids from both
folders.
"""

import json

import pytest
import torch
from family_checks import (
    cache_logits,
    check_paged,
    check_run_token_ids,
    check_served_as_alone,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import BASE, cached_logits, our_model, save_hf_dir

from llmrun import api
from llmrun.errors import ContextOverflowError
from llmrun.loading.loader import load_model
from llmrun.sampling import SamplingParams

pytest.importorskip("transformers.models.doge")

CPU = torch.device("cpu")
DENSE = dict(
    BASE,
    model_type="doge",
    sliding_window=12,
    keep_window_size=8,
    attention_bias=True,
    mlp_bias=True,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0),
)
# No window: a decode step sees every key, the dynamic mask keeping 8 of them.
MOE = dict(DENSE, is_moe=True, num_experts=64, num_experts_per_tok=8, sliding_window=None)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
PREFILL = 30


def doge_model(config: dict):
    """transformers' model of `config`, randomize()'s weights but the residual scales
    1 + N(0, 0.1) and A N(0, 1)."""
    hf = hf_model_of(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("residual"):
                p.normal_(1.0, 0.1)
            elif name.endswith("self_attn.A"):
                p.normal_(0.0, 1.0)
    return hf


def reference(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def dense():
    hf = doge_model(DENSE)
    return hf, reference(hf)


@pytest.fixture(scope="module")
def moe():
    hf = doge_model(MOE)
    return hf, reference(hf)


def save_hub_folder(hf, path):
    """The model's folder (stories260K's tokenizer), its config.json scaling RoPE
    "dynamic" by 4 over max_position_embeddings as the Hub's Doge configs do; returns
    `path`."""
    save_hf_dir(hf, path, tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope["rope_theta"],
        rope_scaling=dict(
            rope_type="dynamic",
            factor=4.0,
            original_max_position_embeddings=config["max_position_embeddings"],
        ),
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_dense_model_matches_transformers_whole_cached_paged_and_static(dense, monkeypatch):
    hf, expected = dense
    ours = our_model(hf.config.to_dict(), hf.state_dict())
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)
    check_static_decode(ours, monkeypatch)
    check_typed_cache(ours, IDS, expected, "f16", drift=0.1)


def test_the_moe_model_matches_transformers_whole_and_decoding(moe):
    hf, expected = moe
    ours = our_model(hf.config.to_dict(), hf.state_dict())
    with torch.no_grad():
        assert max_diff(ours(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
        out = hf(IDS[:, :PREFILL], use_cache=True)
        steps = [out.logits]
        for t in range(PREFILL, IDS.shape[1]):
            out = hf(IDS[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    decoded = torch.cat(steps, dim=1)
    cache = ours.new_cache(1, 64, torch.float32, "cpu")
    assert max_diff(cache_logits(ours, IDS, cache, sizes=(PREFILL,)), decoded) < 1e-4
    # A prompt in chunks is routed otherwise than whole, in transformers as in llmrun.
    assert max_diff(cached_logits(ours, IDS), expected) > 0.1


def test_moe_rows_padded_as_serve_pads_them_get_their_logits_alone(moe):
    """Two prompts of 30 and 22 tokens in one forward, the shorter padded on the right
    as serve pads it (its last token repeated at its last position): each row's last
    logits are those of its prompt alone (1e-5), the padding routed with no real token."""
    ours = our_model(moe[0].config.to_dict(), moe[0].state_dict())
    lengths, width = (30, 22), 30
    prompts = [IDS[0, :n] for n in lengths]
    ids = torch.stack([torch.cat([p, p[-1:].repeat(width - len(p))]) for p in prompts])
    positions = torch.tensor([[min(i, n - 1) for i in range(width)] for n in lengths])
    cache = ours.new_cache(2, 64, torch.float32, "cpu")
    with torch.no_grad():
        batched = ours(ids, positions, cache, last=torch.tensor(lengths) - 1)
        for row, prompt in enumerate(prompts):
            alone = ours(prompt[None], torch.arange(len(prompt))[None], last_only=True)
            assert max_diff(batched[row], alone[0]) < 1e-5


def test_moe_served_concurrently_as_run_alone(moe, tmp_path):
    """serve's scheduler (a paged pool, prompts padded together) decodes four requests,
    greedy and sampled, each getting the text it gets alone."""
    engine = api.load(str(save_hub_folder(moe[0], tmp_path / "Doge")), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "The sun was"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 12, parallel=4)


@pytest.mark.parametrize("config", ["dense", "moe"])
def test_the_folders_run_and_show(config, dense, moe, tmp_path):
    hf, expected = dense if config == "dense" else moe
    folder = save_hub_folder(hf, tmp_path / "Doge")
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "doge"
    with torch.no_grad():
        logits = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(logits, expected) < 1e-4
    # (The text: its first piece's space, which a decode of the new tokens alone drops.)
    check_run_token_ids(hf, folder, tokens=8, text=False)
    # 2 layers' keys and values of 2 heads of 16, f32, 8192 positions.
    check_show(folder, "doge", 2 * 2 * 2 * 16 * 4 * 8192)
    # Past max_position_embeddings (256), dynamic NTK would change the RoPE base.
    with pytest.raises(ContextOverflowError, match="dynamic NTK"):
        loaded.model(IDS[:, :1], torch.tensor([[256]]))


def plain_residuals(hf):
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("residual"):
                p.fill_(1.0)


def no_dynamic_mask(hf):
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("self_attn.A"):
                p.zero_()


# Each of Doge's features undone in the reference (same weights otherwise): the logits
# move by far more than the tolerance, so the parity tests check every one of them.
FEATURES = {
    "the kept window": (dict(keep_window_size=2048), None),
    "the sliding window": (dict(sliding_window=None), None),
    "the dynamic mask's biases": ({}, no_dynamic_mask),
    "the residual scales": ({}, plain_residuals),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(dense, feature):
    changes, undo = FEATURES[feature]
    hf = doge_model({**DENSE, **changes})
    if undo is not None:
        undo(hf)
    assert max_diff(reference(hf), dense[1]) > 0.1

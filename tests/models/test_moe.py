"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on
tiny random configs, with the Hub's per-expert weights: routing with and without the
top-k weights renormalized (Qwen2-MoE, whose shared expert joins every token, off by
default; Qwen3-MoE on), and Mixtral with a sliding window of 5.

Tolerance: 1e-4 max abs difference in float32 (logits span about ±7 here).
"""

import pytest
import torch
from helpers import CHUNKS, cached_logits
from moe_helpers import MOE_CONFIGS, hub_state_dict, tiny_moe_model

from llmrun.models import model_module
from llmrun.models.base import mix_experts, route

pytest.importorskip("transformers")
SEQ = 24
LONG = 40  # parity: past the windows of 5 and helpers.CHUNKS
# Name -> (MOE_CONFIGS entry, overrides).
CASES = {
    "mixtral": ("mixtral", {}),
    "mixtral-window": ("mixtral", {"sliding_window": 5}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe-norm-topk": ("qwen2_moe", {"norm_topk_prob": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-no-norm-topk": ("qwen3_moe", {"norm_topk_prob": False}),
}


def our_model(config: dict, state_dict: dict):
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_config(config))
    missing, unexpected = model.load_state_dict(state_dict, strict=True), []
    assert not missing.missing_keys and not unexpected
    return model.eval()


def chosen_experts(model, ids) -> dict[int, set[int]]:
    """Per layer, the experts that some token of `ids` is routed to."""
    chosen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if not hasattr(block, "experts"):
            continue

        def hook(module, args, logits, i=i, top_k=block.top_k):
            chosen.setdefault(i, set()).update(
                logits.topk(top_k, dim=-1).indices.flatten().tolist()
            )

        hooks.append(block.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1])[None])
    for h in hooks:
        h.remove()
    return chosen


def ids_for(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    """40 tokens, every expert chosen by some: one forward, a prefill of 3 and then one
    token at a time (the decode path of the experts), and prefills in chunks
    (helpers.CHUNKS) and then one at a time. Measured: the forward 1.4e-6..2.4e-6, the
    cached ways 5e-6..7e-6."""
    name, overrides = CASES[case]
    hf, config = tiny_moe_model(name, **overrides)
    ours = our_model(config, hub_state_dict(hf, config["model_type"]))
    ids = ids_for(seq=LONG)
    n_experts = config.get("num_local_experts") or config["num_experts"]
    chosen = chosen_experts(ours, ids)
    assert chosen and all(len(c) == n_experts for c in chosen.values()), chosen
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids, torch.arange(LONG)[None]), expected, atol=1e-4, rtol=0)
    for chunks in [(3,), CHUNKS]:
        torch.testing.assert_close(cached_logits(ours, ids, chunks), expected, atol=1e-4, rtol=0)


def test_the_variants_change_the_logits():
    """Renormalizing the top-k weights and the window each move the logits by units
    (else their parity cases would not test them)."""
    ids = ids_for(seq=LONG)
    for name, change in [
        ("mixtral", {"sliding_window": 5}),
        ("qwen2_moe", {"norm_topk_prob": True}),
        ("qwen3_moe", {"norm_topk_prob": False}),
    ]:
        hf, config = tiny_moe_model(name)
        state = hub_state_dict(hf, config["model_type"])
        with torch.no_grad():
            base = our_model(config, state)(ids, torch.arange(LONG)[None])
            other = our_model({**config, **change}, state)(ids, torch.arange(LONG)[None])
        assert (other - base).abs().max() > 0.5, (name, change)


def test_dense_layers_of_a_sparse_model():
    """mlp_only_layers and decoder_sparse_step make some layers dense, as in transformers."""
    for name, change in [
        ("qwen2_moe", {"mlp_only_layers": [0]}),
        ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3}),
    ]:
        hf, config = tiny_moe_model(name, **change)
        ours = our_model(config, hub_state_dict(hf, config["model_type"]))
        sparse = [hasattr(layer.mlp, "experts") for layer in ours.model.layers]
        assert sparse == ([False, True] if name == "qwen2_moe" else [False, True, False])
        ids = ids_for()
        with torch.no_grad():
            got = ours(ids, torch.arange(SEQ)[None])
            torch.testing.assert_close(got, hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_batched_rows_equal_each_row_alone(name):
    """A batch (one grouped pass over the union of the rows' experts) gives each row
    the logits it gets alone, in prefill and in one-token decode steps (to 1e-5: torch's
    f32 matmuls round a one-row product differently from a many-row one)."""
    hf, config = tiny_moe_model(name)
    ours = our_model(config, hub_state_dict(hf, config["model_type"]))
    rows = torch.cat([ids_for(s, 10) for s in (3, 4, 5)])
    positions = torch.arange(10).expand(3, 10)
    with torch.no_grad():
        cache = ours.new_cache(3, 32, torch.float32, "cpu")
        batched = [ours(rows[:, :8], positions[:, :8], cache)]
        batched += [ours(rows[:, t : t + 1], positions[:, t : t + 1], cache) for t in (8, 9)]
        batched = torch.cat(batched, dim=1)
        for r in range(3):
            own = ours.new_cache(1, 32, torch.float32, "cpu")
            alone = [ours(rows[r : r + 1, :8], positions[:1, :8], own)]
            alone += [
                ours(rows[r : r + 1, t : t + 1], positions[:1, t : t + 1], own) for t in (8, 9)
            ]
            torch.testing.assert_close(torch.cat(alone, dim=1)[0], batched[r], atol=1e-5, rtol=0)


def test_routing_ties_go_as_in_transformers():
    """Experts with equal router rows tie on every token; torch.topk on the same
    probabilities breaks the ties as transformers' router does, in a prompt and
    one token at a time."""
    hf, config = tiny_moe_model("qwen3_moe")
    with torch.no_grad():
        for layer in hf.model.layers:
            router = layer.mlp.gate.weight
            router[1] = router[0]  # 0 and 1 tie, and 5, 6 and 7
            router[6] = router[5]
            router[7] = router[5]
    ours = our_model(config, hub_state_dict(hf, config["model_type"]))
    ids = ids_for(7)
    split = []  # tokens whose top-k takes some but not all of a tied set

    def hook(module, args, logits):
        for row in logits.topk(4, dim=-1).indices.tolist():
            split.extend(1 for tied in ({0, 1}, {5, 6, 7}) if 0 < len(tied & set(row)) < len(tied))

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in ours.model.layers]
    with torch.no_grad():
        ours(ids, torch.arange(SEQ)[None])
    for h in hooks:
        h.remove()
    assert len(split) >= 5
    with torch.no_grad():
        expected = hf(ids).logits
        positions = torch.arange(SEQ)[None]
        torch.testing.assert_close(ours(ids, positions), expected, atol=1e-4, rtol=0)
        cache = ours.new_cache(1, 64, torch.float32, "cpu")
        steps = [ours(ids[:, t : t + 1], positions[:, t : t + 1], cache) for t in range(SEQ)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)
    logits = torch.randn(64, 16)
    logits[:, 1] = logits[:, 0]
    weights, indices = route(logits, 4, normalize=True)
    ref = torch.topk(torch.softmax(logits, -1), 4).indices
    assert torch.equal(indices, ref)
    assert torch.allclose(weights.sum(-1), torch.ones(64))


class Scale(torch.nn.Module):
    """A row-by-row expert (x * s + b), so any difference is the mixing's own."""

    def __init__(self):
        super().__init__()
        self.s, self.b = torch.randn(8), torch.randn(8)

    def forward(self, x):
        return x * self.s + self.b


def test_mix_experts_one_token_and_grouped_agree_exactly():
    """A token's experts are summed in the same order alone and in a group."""
    experts = torch.nn.ModuleList(Scale() for _ in range(6))
    x = torch.randn(5, 8)
    weights, indices = route(torch.randn(5, 6), 3, normalize=False)
    with torch.no_grad():
        grouped = mix_experts(x, weights, indices, experts)
        for n in range(5):
            alone = mix_experts(x[n : n + 1], weights[n : n + 1], indices[n : n + 1], experts)
            assert torch.equal(alone[0], grouped[n])
        expected = sum(
            weights[:, k, None]
            * torch.stack([experts[e](x[n]) for n, e in enumerate(indices[:, k])])
            for k in range(3)
        )
        torch.testing.assert_close(grouped, expected)


@pytest.mark.parametrize(
    "name,change,message",
    [
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok is 9, but there are 8"),
        ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok is 9, but there are 8"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_bad_configs_refused(name, change, message):
    from llmrun.errors import LlmrunError

    _, config = tiny_moe_model(name)
    module = model_module(config["model_type"])
    with pytest.raises(LlmrunError, match=message):
        module.ModelArgs.from_config({**config, **change})


def test_qwen3_moe_num_experts_under_either_name():
    """The Hub's config.json says num_experts; transformers 5 writes num_local_experts."""
    _, config = tiny_moe_model("qwen3_moe")
    module = model_module("qwen3_moe")
    hub = {k: v for k, v in config.items() if k != "num_local_experts"}
    hub["num_experts"] = 16
    assert module.ModelArgs.from_config(hub).num_experts == 16
    assert module.ModelArgs.from_config(config).num_experts == 16

"""OLMoE against transformers' OlmoeForCausalLM, from a config.json (the Hub's per-expert
keys) and from an "olmoe" GGUF written as llama.cpp's converter writes it
(conversion/olmo.py OlmoeModel: TextModel's keys, rms epsilon 1e-5, the experts stacked
[experts, rows, cols], q/k rows as they are).

The tiny models: 8 experts, the top 3 of each token's router; GQA 4:2 (the k norm as
wide as the keys). Its features each move the logits by far more than the tolerance
(asserted below): the norms over whole projections (per-head norms, Qwen3-MoE's, give
another model), the top-k weights left as the softmax gives them (renormalized: another
model), and norm_topk_prob on, which transformers follows and so does llmrun.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. A Q8_0 GGUF against transformers on the weights gguf dequantizes: 1e-4. An f16
or bf16 cache: 1e-5 against an f32 cache holding the rounded values, drifting from f32
by less than DRIFT.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize
from moe_helpers import hub_state_dict

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import olmoe as olmoe_loading
from llmrun.loading.loader import load_model
from llmrun.models import olmoe, qwen3_moe

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
OLMOE = dict(
    BASE,
    model_type="olmoe",
    intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=3,
    rope_theta=10000.0,
)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 4.3e-3, bf16 2.6e-2 to 0.14 (a router
# that picks another expert for a token moves its logits by more than rounding).
DRIFT = {"f16": 1e-2, "bf16": 0.3}
Q8 = gguf.GGMLQuantizationType.Q8_0


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**OLMOE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hub_state_dict(hf, "qwen3_moe"))


@pytest.fixture(scope="module", params=[False, True], ids=["softmax-topk", "norm-topk"])
def family(request):
    hf = hf_model(norm_topk_prob=request.param)
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, each layer's experts stacked [E, rows, cols]."""
    out, stacks = {}, {}
    for name, t in hub_state_dict(hf, "qwen3_moe").items():
        data = t.float().numpy()
        if name in _NAMES:
            out[_NAMES[name]] = data
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if module.startswith("mlp.experts."):
            _, _, expert, proj = module.split(".")
            stacks.setdefault((layer, proj), {})[int(expert)] = data
        else:
            out[f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"] = data
    for (layer, proj), experts in stacks.items():
        stacked = np.stack([experts[e] for e in sorted(experts)])
        out[f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"] = stacked
    return out


def write_olmoe_gguf(path, hf, qtype=None, **changed):
    """hf as llama.cpp's converter writes OLMoE: TextModel's keys (no key_length: the
    config has no head_dim), the expert counts, rms epsilon 1e-5. `changed`: keys
    replaced (None: left out)."""
    config = hf.config
    keys = {
        gguf.Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        gguf.Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        gguf.Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: config.intermediate_size,
        gguf.Keys.Attention.HEAD_COUNT: config.num_attention_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: config.num_key_value_heads,
        gguf.Keys.Rope.FREQ_BASE: config.rope_parameters["rope_theta"],
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: 1e-5,
        gguf.Keys.LLM.EXPERT_COUNT: config.num_experts,
        gguf.Keys.LLM.EXPERT_USED_COUNT: config.num_experts_per_tok,
    }
    keys.update({getattr(gguf.Keys.LLM, k.upper(), k): v for k, v in changed.items()})
    return write_keyed_gguf(path, olmoe_loading.ARCH, keys, converted(hf), qtype)


# ---- the model ----------------------------------------------------------------------


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits(monkeypatch):
    """norm_topk_prob changes transformers' logits by far more than the tolerance; the
    whole-projection norms and the unnormalized top-k weights are what make llmrun's
    logits transformers' (per-head norms or renormalized weights miss by more)."""
    hf = hf_model()
    expected = reference(hf)
    assert max_diff(reference(hf_model(norm_topk_prob=True)), expected) > 0.1
    model = ours(hf)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.norm_topk_prob = True
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    per_head = ours(hf)
    for layer in per_head.model.layers:
        attn = layer.self_attn
        attn.q_norm = _PerHead(attn.q_norm, attn.n_heads)
        attn.k_norm = _PerHead(attn.k_norm, attn.n_kv_heads)
    with torch.no_grad():
        assert max_diff(per_head(IDS, torch.arange(SEQ)[None]), expected) > 0.1
    assert isinstance(model.model.layers[0].mlp, qwen3_moe.SparseMoeBlock)


class _PerHead(torch.nn.Module):
    """An RMSNorm's weight over each head alone (Qwen3's q/k norms)."""

    def __init__(self, norm, heads: int) -> None:
        super().__init__()
        self.norm, self.heads = norm, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.unflatten(-1, (self.heads, -1))  # [..., H*D] -> [..., H, D]
        scale = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        return (grouped * scale).flatten(-2) * self.norm.weight


def test_clip_qkv_and_too_many_chosen_experts_are_refused():
    with pytest.raises(UnsupportedError, match="clip_qkv"):
        olmoe.ModelArgs.from_config({**OLMOE, "clip_qkv": 8.0})
    with pytest.raises(ModelFormatError, match="num_experts_per_tok is 9"):
        olmoe.ModelArgs.from_config({**OLMOE, "num_experts_per_tok": 9})
    assert olmoe.ModelArgs.from_config({**OLMOE, "clip_qkv": None}).clip_qkv is None


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_decode_step():
    """CUDA graphs' static step refuses a mixture of experts (its routers' choices are
    read back to the host)."""
    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None  # the native step does not know OLMoE
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_olmoe_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "olmoe" and config["norm_topk_prob"] is False
    assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 3)
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    """Every matrix and stack of experts Q8_0 but the routers, which the converter keeps
    in F32."""
    hf = hf_model()
    loaded = load_model(write_olmoe_gguf(tmp_path / "q.gguf", hf, Q8), CPU, "f32")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                blocks = gguf.quants.quantize(p.numpy(), Q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8)))
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize(
    ("changed", "error", "message"),
    [
        (dict(expert_used_count=None), ModelFormatError, "expert_used_count is 0"),
        (dict(expert_count=2), ModelFormatError, "expert_used_count is 3"),
        ({"{arch}.attention.key_length": 32}, UnsupportedError, "heads of 32 features"),
        ({"{arch}.rope.dimension_count": 8}, UnsupportedError, "rotates whole heads"),
    ],
)
def test_what_is_refused(tmp_path, changed, error, message):
    path = write_olmoe_gguf(tmp_path / "bad.gguf", hf_model(), **changed)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model()
    path = write_olmoe_gguf(tmp_path / "olmoe.gguf", hf)
    check_run_and_show(hf, path, "olmoe")

"""GPT-J against transformers' GPTJForCausalLM, from a config.json and a state dict, and
from an HF folder as save_pretrained writes it (the Hub's transformer.* names, with the
attention's mask buffers older files hold). llama.cpp names a "gptj" architecture but
has neither a converter nor a loader for it: such a GGUF is refused.

Its features each move the logits by far more than the tolerance (asserted below): the
parallel block from one LayerNorm (against a sequential one), RoPE on adjacent pairs
(against halves), the partial rotary_dim (against whole heads), lm_head's bias and the
LayerNorms' biases; the GELU's form (tanh "gelu_new" against the exact "gelu") by more
than it.

The tiny model: 2 layers, hidden 64, 4 heads of 16 (8 features rotated), a feed-forward
of 256, a 512-token vocabulary.

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged. An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32.
"""

import pytest
import torch
from family_checks import check_paged, check_static_decode, check_typed_cache, max_diff
from helpers import cached_logits, our_model, randomize

from llmrun.errors import UnsupportedError
from llmrun.loading import gpt2 as loading
from llmrun.loading.loader import Weight, load_model
from llmrun.models import base, gptj
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
GPTJ = dict(
    model_type="gptj",
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,
    n_positions=256,
    rotary_dim=8,  # 8 of each head's 16 features turn
    layer_norm_epsilon=1e-5,
    activation_function="gelu_new",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits: f16 about 1e-3, bf16 about 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random GPTJForCausalLM (f32, eval), GPTJ with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**GPTJ, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    # randomize() knows norms by "norm.weight"; GPT-J's are ln_1, ln_f: scales near 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith(".weight"):
                p.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    weights = loading.hf_weights({k: Weight(v) for k, v in hf.state_dict().items()}, Weight)
    return our_model(hf.config.to_dict(), {k: w.tensor for k, w in weights.items()})


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


VARIANTS = {
    "default": {},
    "whole-heads": dict(rotary_dim=16),
    "exact-gelu": dict(activation_function="gelu"),
    "inner-96": dict(n_inner=96),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS, chunks=(3, 11, 9)), expected) < 1e-4


def test_each_feature_moves_the_logits(family):
    """Whole-head rotation and the exact GELU change transformers' logits (llmrun follows
    each, above); so do lm_head's bias and the LayerNorms' biases, which llmrun takes."""
    hf, expected = family
    assert max_diff(reference(hf_model(**VARIANTS["whole-heads"])), expected) > 0.1
    assert max_diff(reference(hf_model(**VARIANTS["exact-gelu"])), expected) > 1e-3
    for suffix in ("lm_head.bias", "ln_1.bias", "ln_f.bias"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        assert max_diff(reference(changed), expected) > 0.1, suffix


def test_the_parallel_block_and_the_pairs_are_followed(family, monkeypatch):
    """llmrun with a sequential block, or turning halves instead of adjacent pairs,
    leaves transformers' logits: each is the model's, not an accident."""
    hf, expected = family
    model = ours(hf)

    def sequential(self, x, frame, cache):
        x = x + self.attn(self.ln_1(x), frame, cache)
        return x + self.mlp(self.ln_1(x))

    monkeypatch.setattr(gptj.DecoderLayer, "forward", sequential)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()
    monkeypatch.setattr(gptj, "rotate_pairs", lambda x, frame: frame.rotate(x))
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_an_hf_folder_with_the_hubs_names_loads_as_transformers_runs_it(tmp_path):
    """save_pretrained writes transformer.*; GPT-J-6B's files also hold the attention's
    mask buffers, which are not weights."""
    from safetensors.torch import load_file, save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    assert "transformer.wte.weight" in tensors and "lm_head.bias" in tensors
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    tensors["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e9)
    save_file(tensors, file)
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gptj"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family):
    """The native step knows no LayerNorm, parallel block or pairwise RoPE."""
    assert not decode_step.attach(ours(family[0]))


def test_rotary_dim_none_is_refused():
    """transformers then builds tables of the hidden size's width: no model to follow."""
    with pytest.raises(UnsupportedError, match="rotary_dim None"):
        gptj.ModelArgs.from_config({**GPTJ, "rotary_dim": None})


def test_the_rope_base_is_gpt_js(family):
    args = gptj.ModelArgs.from_config(family[0].config.to_dict())
    assert args.rope_parameters["rope_theta"] == 10000.0
    assert base.RotaryEmbedding(args.rope_parameters, 16, 256).rotary_dim == 8


def test_a_gptj_gguf_is_refused(tmp_path):
    """llama.cpp names the architecture but neither converts nor loads it: llmrun refuses
    it rather than guess the file's layout."""
    import numpy as np
    from family_checks import write_keyed_gguf

    embd = {"token_embd.weight": np.zeros((512, 64), np.float32)}
    path = write_keyed_gguf(tmp_path / "j.gguf", "gptj", {"{arch}.block_count": 2}, embd)
    with pytest.raises(UnsupportedError, match="architecture 'gptj' is not supported"):
        load_model(path, CPU, "f32")

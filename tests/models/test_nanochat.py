"""nanochat against transformers' NanoChatForCausalLM, from a config.json and a state
dict, and from an HF folder as save_pretrained writes it. llama.cpp has no converter
for it (nothing in its conversion/ names nanochat): a "nanochat" GGUF is refused.

Its features each move the logits by far more than the tolerance (asserted below, by
taking each out of llmrun's model): RoPE turned the other way (rotate_half's flipped
signs), the weightless q/k norm, the norm of the embeddings before the first layer,
relu(x)^2 (against relu) and the final soft-capping. The q/k norm's place after RoPE
rather than before cannot move them: a weightless RMSNorm of a head commutes with its
rotation, which keeps the head's length.

The tiny model: 2 layers, hidden 64, 4 query heads and 2 KV heads of 16, a feed-forward
of 96, a 512-token vocabulary (stories260K's tokenizer, for `llmrun run`).

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged. An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize, save_hf_dir

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import nanochat
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
NANOCHAT = dict(BASE, model_type="nanochat", rope_theta=10000.0)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits: f16 about 1e-3, bf16 about 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random NanoChatForCausalLM (f32, eval), NANOCHAT with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**NANOCHAT, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
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
    "no-softcap": dict(final_logit_softcapping=None),
    "bias-mha": dict(attention_bias=True, num_key_value_heads=4),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_is_followed(family, monkeypatch):
    """llmrun without each of nanochat's features leaves transformers' logits by far more
    than the tolerance: each is the model's, not an accident."""
    hf, expected = family
    model = ours(hf)
    removals = (
        (nanochat.Attention, "rotate", lambda self, x, frame: self.qk_norm(frame.rotate(x))),
        (nanochat.Attention, "rotate", lambda self, x, frame: ops_rotary(x, frame)),
        (nanochat.Model, "embed", lambda self, ids: self.model.embed_tokens(ids)),
        (nanochat, "relu_squared", torch.relu),
    )
    for owner, name, replacement in removals:
        monkeypatch.setattr(owner, name, replacement)
        changed = ours(hf)
        assert max_diff(cached_logits(changed, IDS), expected) > 0.1, name
        monkeypatch.undo()
    monkeypatch.setattr(model.args, "final_logit_softcapping", None)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def ops_rotary(x: torch.Tensor, frame) -> torch.Tensor:
    """nanochat's rotation without its q/k norm."""
    from llmrun import ops

    return ops.rotary(x, frame.cos, -frame.sin)


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "nanochat"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


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
    """The native step knows no weightless norms, reversed RoPE or relu^2 feed-forward."""
    assert not decode_step.attach(ours(family[0]))


def test_the_defaults_are_nanochats():
    args = nanochat.ModelArgs.from_config(
        {k: v for k, v in NANOCHAT.items() if k != "rms_norm_eps"}
    )
    assert args.final_logit_softcapping == 15.0 and args.hidden_act == "relu2"
    assert args.rms_norm_eps == 1e-6 and args.max_position_embeddings == 256


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = save_hf_dir(hf, tmp_path / "nanochat", tokenizer=True)
    check_run_and_show(hf, path, "nanochat")


def test_a_nanochat_gguf_is_refused(tmp_path):
    """llama.cpp neither converts nor loads nanochat: llmrun refuses such a file rather
    than guess its layout."""
    import numpy as np

    embd = {"token_embd.weight": np.zeros((512, 64), np.float32)}
    path = write_keyed_gguf(tmp_path / "n.gguf", "nanochat", {"{arch}.block_count": 2}, embd)
    with pytest.raises(UnsupportedError, match="architecture 'nanochat' is not supported"):
        load_model(path, CPU, "f32")

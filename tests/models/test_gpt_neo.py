"""GPT-Neo against transformers' GPTNeoForCausalLM, from a config.json and a state dict,
and from an HF folder as save_pretrained writes it (transformer.*, plus the attention's
mask buffers older files hold). llama.cpp has no converter for GPT-Neo: no GGUF to read.

Its features each move the logits by far more than the tolerance (asserted below): the
local layers' window (against global attention), the unscaled scores (against
1/sqrt(head width)), out_proj's bias; the window is small (5) and the sequence long (40),
so the local layers see far less than the global ones.

The tiny model: 3 layers (global, local, global), hidden 64, 4 heads of 16, a
feed-forward of 256, a 512-token vocabulary (stories260K's, so `llmrun run` decodes it).

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged (the local layers
also in a pool of their own). An f16 or bf16 cache: 1e-5 against an f32 cache that
stores the values rounded to the type, and DRIFT from f32.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_typed_cache,
    check_whole_and_cached,
    hf_model_of,
    max_diff,
)
from helpers import cached_logits, our_model, save_hf_dir
from in_process import llmrun

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import gpt_neo as loading
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import gpt_neo, kv_cache_bytes
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
GPT_NEO = dict(
    model_type="gpt_neo",
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    attention_types=[[["global", "local"], 1], [["global"], 1]],
    window_size=5,
    vocab_size=512,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.5e-2, bf16 0.27 (the unscaled
# scores carry the keys' rounding 4x further than 1/sqrt(16) would).
DRIFT = {"f16": 5e-2, "bf16": 0.5}
VARIANTS = {
    "default": {},
    "local-first": dict(attention_types=[[["local", "global", "local"], 1]]),
    "all-global": dict(attention_types=[[["global"], 3]]),
    "exact-gelu": dict(activation_function="gelu"),
    "inner-96": dict(intermediate_size=96),
}


def hf_model(**overrides):
    """A tiny random GPTNeoForCausalLM (f32, eval), GPT_NEO with `overrides`; LayerNorm
    scales near 1 (randomize() knows norms by "norm.weight"; GPT-Neo's are ln_1, ln_f)."""
    model = hf_model_of({**GPT_NEO, **overrides})
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
    return model


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
        if name != "default":
            assert max_diff(reference(hf_model(**overrides)), expected) > 1e-3, name


def test_the_window_and_the_unscaled_scores_are_followed(family, monkeypatch):
    """llmrun with every layer global, or with scores scaled by 1/sqrt(16), leaves
    transformers' logits: each is the model's, not an accident."""
    hf, expected = family
    model = ours(hf)
    monkeypatch.setattr(model.args, "window_size", 10**6)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()

    def scaled(q, k, v, layer, frame, cache, scale):
        return attend(q, k, v, layer, frame, cache, 0.25)

    attend = gpt_neo.attend_scaled
    monkeypatch.setattr(gpt_neo, "attend_scaled", scaled)
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_out_projs_bias_matters(family):
    _, expected = family
    changed = hf_model()
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if name.endswith("out_proj.bias"):
                p.zero_()
    assert max_diff(reference(changed), expected) > 0.1


def test_an_hf_folder_with_the_hubs_names_loads_as_transformers_runs_it(tmp_path):
    """save_pretrained writes transformer.*; gpt-neo-125m's files also hold the
    attention's mask buffers, which are not weights."""
    from safetensors.torch import load_file, save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    assert "transformer.h.0.attn.attention.q_proj.weight" in tensors
    tensors["transformer.h.0.attn.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    tensors["transformer.h.0.attn.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(tensors, file)
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gpt_neo"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_hubs_names_are_llmruns():
    assert loading.hf_name("transformer.h.2.attn.attention.out_proj.bias") == (
        "model.layers.2.attn.out_proj.bias"
    )
    assert loading.hf_name("transformer.wpe.weight") == "model.position_embeddings.weight"
    assert loading.hf_name("transformer.ln_f.bias") == "model.norm.bias"
    assert loading.hf_name("transformer.h.0.mlp.c_fc.weight") == "model.layers.0.mlp.c_fc.weight"


def test_the_local_layers_cache_their_window_alone(family):
    model = ours(family[0])
    assert model.args.layer_windows() == [None, 5, None]
    # Two global layers of 8192 positions and a local one of 5: 4 heads of 16 floats.
    assert kv_cache_bytes(family[0].config.to_dict(), 8192) == (2 * 8192 + 5) * 2 * 4 * 16 * 4


def test_serves_from_paged_blocks_as_every_family_does(family, monkeypatch):
    """test_paged.py's checks of serve's paged KV cache, the local layers also in a pool
    of their own whose blocks are let go and reused."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected, windowed="gpt_neo", monkeypatch=monkeypatch)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_neither_the_static_nor_the_native_decode_step_takes_it(family):
    """The static step's one frame knows no per-layer window; the native step no
    LayerNorm, learned positions or unscaled scores: GPT-Neo decodes through its torch
    layers."""
    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))
    assert not decode_step.attach(model)


@pytest.mark.parametrize(
    "attention_types,error,message",
    [
        ([[["global", "sparse"], 1], [["global"], 1]], UnsupportedError, "'sparse'"),
        ([[["global", "local"], 2]], ModelFormatError, "lists 4 layers"),
        ([["global", "local"]], ModelFormatError, "not a list of"),
    ],
)
def test_attention_types_it_cannot_mean_are_refused(attention_types, error, message):
    with pytest.raises(error, match=message):
        gpt_neo.ModelArgs.from_config({**GPT_NEO, "attention_types": attention_types})


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    path = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    check_run_prints_greedy_tokens(hf, path)


def test_show_describes_a_gpt_neo_folder(family, tmp_path):
    path = save_hf_dir(family[0], tmp_path / "hf", tokenizer=True)
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "gpt_neo" in result.stdout
    expected = kv_cache_bytes(family[0].config.to_dict(), 8192)
    assert inspect.describe(path)["kv_cache_bytes_8k"] == expected

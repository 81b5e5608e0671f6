"""LFM3 against transformers' Lfm3ForCausalLM, from a config.json (llama.cpp has no
"lfm3" GGUF arch in this version: Hugging Face folders only).

Its features each move the logits by far more than the tolerance, and llmrun follows
each: the convolution state carried from one forward to the next, the sliding window of
the sliding_attention layers (the tiny config's window is 5), the two layer types' own
RoPE (the full layers' proportional one), the per-head attention gate, the sandwich
norms, and the layer pattern (given, or Lfm3Config's default).

Tolerances: f32 logits (within about ±10) 1e-4 max abs against transformers: whole, or
through the KV cache and the convolution state (prefills in chunks, then one token at a
time), contiguous or paged, rows of a batch padded on the right. An f16/bf16/q8_0 KV
cache: 1e-5 against an f32 cache holding the rounded values, and DRIFT from f32.
"""

import pytest
import torch
from family_checks import (
    check_run_and_show,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
)
from helpers import cached_logits, our_model, randomize, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="lfm3",
    hidden_size=128,  # 4 heads of 32 (2 KV heads): a q8_0 cache's blocks fit a head
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,  # stories260K's tokenizer
    max_position_embeddings=256,
    num_hidden_layers=6,  # Lfm3Config's pattern: conv, conv, full, conv, sliding, conv
    sliding_window=5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 about 1e-3, bf16 and q8_0 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1, "q8_0": 1e-1}


def hf_model(**overrides):
    """transformers' model of CONFIG (with `overrides`) and randomize()'s weights."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's keys: transformers renames the attention
    gate's self_attn.gate_proj to g_proj."""
    return {
        k.replace(".self_attn.g_proj.", ".self_attn.gate_proj."): v
        for k, v in hf.state_dict().items()
    }


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hub_state(hf))


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    """Whole; prefills of 7, 3, 5, 1, 9, 2, 6 tokens through the cache, then one token
    at a time; and one prefill of the whole sequence."""
    hf, expected = family
    assert hf.config.layer_types == [
        "conv", "conv", "full_attention", "conv", "sliding_attention", "conv",
    ]  # fmt: skip
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(SEQ,)), expected) < 1e-4


def test_the_convolution_state_carries_the_sequence(family):
    """Zeroing the state after a prefill moves the next logits far beyond the tolerance."""
    hf, expected = family
    model = ours(hf)
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    with torch.no_grad():
        model(IDS[:, :20], torch.arange(20)[None], cache)
        for parts in cache.recurrent.tensors.values():
            for t in parts:
                t.zero_()
        moved = model(IDS[:, 20:21], torch.tensor([[20]]), cache)
    assert max_diff(moved[0, 0], expected[0, 20]) > 0.1


@pytest.mark.parametrize(
    "variant",
    [
        dict(sliding_window=64),  # the window, wider than the sequence, hides nothing
        dict(use_attention_gate=False),
        dict(use_sandwich_norm=False),
        dict(layer_types=["conv", "sliding_attention", "conv", "full_attention", "conv", "conv"]),
        dict(
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            }
        ),
        dict(
            rope_parameters={
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": 100.0,
                    "partial_rotary_factor": 0.25,
                },  # fmt: skip
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            }
        ),
        dict(conv_L_cache=3, conv_bias=True),
    ],
    ids=["window", "gate", "sandwich", "layer_types", "rope", "rope_theta", "conv"],
)
def test_each_feature_moves_the_logits(family, variant):
    """Each variant changes the logits far beyond the tolerance; llmrun follows each."""
    _, base = family
    hf = hf_model(**variant)
    assert max_diff(reference(hf), base) > 0.1
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_the_per_head_norms_matter(family):
    _, base = family
    hf = hf_model()
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(2.0)
    assert max_diff(reference(hf), base) > 0.1
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_padded_rows_in_scattered_slots(family):
    hf, _ = family
    check_padded_rows_in_scattered_slots(ours(hf), lambda ids: reference(hf, ids), IDS)


def test_padded_rows_decoded_together(family):
    hf, _ = family
    check_padded_rows_decoded_together(ours(hf), lambda ids: reference(hf, ids), IDS)


def test_one_sequence_on_paged_blocks_gives_the_contiguous_logits(family):
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py (the convolution state stays f32 whatever the type)."""
    hf, expected = family
    model = ours(hf)
    assert model.new_cache(1, 8, cache_type, "cpu").recurrent.dtype == torch.float32
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """Tied (Lfm3Config's default) and untied output; no native decode step or static
    CUDA-graphs step takes the family."""
    hf, expected = family
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    assert loaded.model.decode_step is None
    check_no_static_decode(loaded.model)
    untied = hf_model(tie_word_embeddings=False)
    loaded = load_model(save_hf_dir(untied, tmp_path / "untied"), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(untied)) < 1e-4


def test_serves_concurrent_requests_with_transformers_greedy_text(family, tmp_path):
    """serve's scheduler: four prompts of different lengths on three state rows."""
    hf, _ = family
    path = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    engine = api.load(str(path), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "Sam"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(family, tmp_path):
    hf, _ = family
    path = save_hf_dir(hf, tmp_path / "lfm3", tokenizer=True)
    check_run_and_show(hf, path, "lfm3")
    # Two attention layers of 2 KV heads of 32 floats cache keys and values; the
    # convolution layers none.
    check_show(path, "lfm3", 2 * 2 * 2 * 32 * 4 * 8192)


def test_show_counts_the_kv_cache_of_the_attention_layers_alone():
    """inspect's torch-free count is the cache the model allocates, with layer_types
    given or Lfm3Config's default pattern."""
    from llmrun.loading.inspect import kv_cache_bytes
    from llmrun.models import kv_cache_bytes as allocated

    for config in (
        {**CONFIG, "layer_types": ["conv", "full_attention"] * 3},
        {**CONFIG, "num_hidden_layers": 11},
    ):
        for context in (1, 12, 8192):
            assert kv_cache_bytes(config, context) == allocated(config, context)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(layer_types=["conv", "mamba"] * 3), UnsupportedError, "layer types \\['mamba'\\]"),
        (dict(layer_types=["conv"] * 5), ModelFormatError, "lists 5 layers"),
        (dict(sliding_window=0), ModelFormatError, "need a sliding_window"),
        (dict(attention_bias=True), UnsupportedError, "attention_bias"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
            UnsupportedError,
            "per layer type",
        ),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}),
            UnsupportedError,
            "RoPE type 'yarn'",
        ),
    ],
)
def test_what_llmrun_does_not_compute_is_refused(overrides, error, message):
    with pytest.raises(error, match=message):
        our_model({**CONFIG, **overrides}, {})

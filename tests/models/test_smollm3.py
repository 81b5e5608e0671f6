"""SmolLM3 against transformers' SmolLM3ForCausalLM, from a config.json and from a
"smollm3" GGUF written as llama.cpp's converter writes it (conversion/llama.py:
LlamaModel's keys and permuted q/k, no key for the NoPE layers, which llama.cpp takes
to be every fourth).

The NoPE layers move the logits by far more than the tolerance (a model whose layers
all rotate differs by more than 0.1), as do the GGUF's permuted q/k.

Tolerances as in test_olmo2.py: f32 logits 1e-4 max abs against transformers, whole
or through the KV cache (chunked prefill, one-token decoding), contiguous or paged;
typed caches 1e-5 against an f32 cache of their rounded values (and DRIFT from f32
logits); a Q8_0 GGUF 1e-4
against transformers on the dequantized weights.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    dequantize_2d_weights,
    max_diff,
)
from helpers import (
    BASE,
    _permute,
    cached_logits,
    our_model,
    randomize,
    save_hf_dir,
    write_gguf,
)
from test_olmo2 import IDS, POSITIONS

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
# Eight layers: the fourth and the eighth skip RoPE (transformers' and llama.cpp's
# default); tied embeddings, as SmolLM3-3B has them.
CONFIG = dict(BASE, model_type="smollm3", num_hidden_layers=8, rope_theta=10000.0)
# A typed cache's drift from f32 logits over eight layers, measured: f16 1.6e-2, bf16 0.12.
DRIFT = {"f16": 5e-2, "bf16": 0.5}


def hf_model(**overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{**CONFIG, **overrides}), dtype=torch.float32
    ).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_smollm3_gguf(path, hf, qtype=None):
    """As llama.cpp's converter writes SmolLM3: Llama's keys, q/k rows permuted for its
    adjacent-pair RoPE, the tied output left out."""
    config = hf.config.to_dict()
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    state = {}
    for name, tensor in hf.state_dict().items():
        projection = name.rsplit(".", 2)[-2]
        if projection in heads and name.endswith(".weight"):
            tensor = torch.from_numpy(_permute(tensor.numpy(), heads[projection]))
        state[name] = tensor
    return write_gguf(path, config, state, qtype)


@pytest.fixture(scope="module")
def smollm3():
    hf = hf_model()
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(smollm3):
    hf, expected = smollm3
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(IDS, POSITIONS), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_the_nope_layers_matter_and_a_config_may_list_them():
    expected = reference(hf_model())
    assert max_diff(reference(hf_model(no_rope_layers=[1] * 8)), expected) > 0.1
    listed = hf_model(no_rope_layers=[0, 1, 1, 1, 1, 0, 1, 1])
    assert max_diff(reference(listed), expected) > 0.1
    assert max_diff(cached_logits(ours(listed), IDS), reference(listed)) < 1e-4


def test_a_gguf_matches_transformers(smollm3, tmp_path):
    hf, expected = smollm3
    loaded = load_model(write_smollm3_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "smollm3"
    model = loaded.model
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_smollm3_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    # Row permutations move whole blocks: dequantizing commutes with them.
    dequantize_2d_weights(hf, q8)
    model = loaded.model
    assert max_diff(cached_logits(model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(smollm3, tmp_path):
    hf, expected = smollm3
    model = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32").model
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    assert model.decode_step is not None  # the native step takes the decoded tokens


def test_serves_from_paged_blocks_as_every_family_does(smollm3):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16), and rows of a batch sharing prefix blocks."""
    hf, expected = smollm3
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(smollm3, cache_type):
    hf, expected = smollm3
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(use_sliding_window=True, sliding_window=8), UnsupportedError, "use_sliding_window"),
        (dict(no_rope_layers=[1, 0]), ModelFormatError, "no_rope_layers lists 2 layers"),
        (dict(no_rope_layer_interval=0), ModelFormatError, "no_rope_layer_interval is 0"),
    ],
)
def test_configs_llmrun_does_not_take_are_refused(change, error, message):
    from llmrun.models import smollm3

    with pytest.raises(error, match=message):
        smollm3.ModelArgs.from_config({**CONFIG, **change})


def test_llmrun_run_prints_transformers_greedy_text(smollm3, tmp_path):
    hf, _ = smollm3
    check_run_and_show(hf, write_smollm3_gguf(tmp_path / "smollm3.gguf", hf), "smollm3")


def test_the_static_decode_step_gives_the_ordinary_logits(smollm3, monkeypatch):
    """CUDA graphs' static step, run eager on CPU as test_static_decode.py does (to 1e-4:
    its masked attention sums in another order, 1.3e-5 apart over these eight layers)."""
    check_static_decode(ours(smollm3[0]), monkeypatch, tolerance=1e-4)

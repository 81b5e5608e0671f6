"""Arcee AFM against transformers' ArceeForCausalLM, from a config.json and from an
"arcee" GGUF written as llama.cpp's converter writes it (conversion/llama.py ArceeModel:
LlamaModel's keys with key_length, vocab_size and the rope dimension count, YaRN's keys
where the config has YaRN, q/k rows permuted for llama.cpp's "normal" RoPE, no
ffn_gate).

Its features each move the logits by far more than the tolerance: the ReLU²
feed-forward without a gate (the tests against transformers fail without the square),
YaRN RoPE (AFM-4.5B's), tied embeddings; the GGUF's q/k rows read without undoing the
permutation would differ too (test_a_gguf_read_without_unpermuting_would_differ).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from helpers import BASE, _permute, cached_logits, gguf_name, our_model, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
ARCEE = dict(BASE, model_type="arcee", rope_theta=10000.0)
# AFM-4.5B's YaRN, scaled to the tiny model: 4 x an original context of 64 = 256.
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
VARIANTS = {
    "default": {},
    "yarn": dict(rope_parameters=YARN),
    "tied": dict(tie_word_embeddings=True),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 up to 8.2e-3, bf16 up to 5.5e-2.
DRIFT = {"f16": 2e-2, "bf16": 2e-1}


def hf_model(**overrides):
    """A tiny transformers Arcee with randomize()'s weights (BASE's bos 1 and eos 2, the
    stories260K vocabulary's, for ArceeConfig's Llama 3 ids)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**ARCEE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_arcee_gguf(path, hf, qtype=None, rope_dims=None, permute=True, yarn_attn_factor=None):
    """The model as llama.cpp's converter writes Arcee: LlamaModel's keys (vocab_size,
    the rope dimension count: the head size, or `rope_dims`), YaRN's type, factor and
    original context where the config has YaRN (and `yarn_attn_factor`, which it writes
    from a config's attention_factor), q/k rows permuted (`permute` False: as they are),
    2-D weights in `qtype` (default F32)."""
    config = hf.config
    rope = config.rope_parameters
    writer = gguf_writer(path, "arcee", config)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(rope_dims or config.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if yarn_attn_factor is not None:
            writer.add_rope_scaling_yarn_attn_factor(yarn_attn_factor)
    state = dict(hf.state_dict())
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    for name, tensor in state.items():
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            state[name] = torch.from_numpy(_permute(tensor.numpy(), heads))
    return finish_stories_gguf(writer, path, state, gguf_name, qtype)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """YaRN and tied embeddings each change the logits, and llmrun follows each."""
    plain = reference(hf_model())
    for variant in VARIANTS.values():
        if variant:
            hf = hf_model(**variant)
            assert max_diff(reference(hf), plain) > 0.1
            assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_arcee_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "arcee"
    assert config["rope_parameters"]["rope_type"] == hf.config.rope_parameters["rope_type"]
    # The native decode step knows no ReLU² feed-forward: not attached.
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_read_without_unpermuting_would_differ(tmp_path):
    """The converter permutes Arcee's q/k rows as a llama's: rows left as they are in the
    file give other logits once unpermuted, so undoing the permutation matters."""
    hf = hf_model()
    loaded = load_model(write_arcee_gguf(tmp_path / "p.gguf", hf, permute=False), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) > 0.1


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(rope_parameters=YARN)
    loaded = load_model(write_arcee_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_partial_rope_is_refused(tmp_path):
    path = write_arcee_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=8)
    with pytest.raises(ModelFormatError, match="Arcee rotates whole heads"):
        load_model(path, CPU, "f32")


def test_a_yarn_magnitude_llama_cpp_would_not_apply_is_refused(tmp_path):
    """llama.cpp scales YaRN by 0.1 ln(4) + 1 whatever yarn_attn_factor says: a file with
    another value is refused; one with that value loads."""
    hf = hf_model(rope_parameters=YARN)
    path = write_arcee_gguf(tmp_path / "m.gguf", hf, yarn_attn_factor=1.0)
    with pytest.raises(UnsupportedError, match="which llama.cpp does not apply"):
        load_model(path, CPU, "f32")
    usual = 0.1 * torch.log(torch.tensor(4.0)).item() + 1
    path = write_arcee_gguf(tmp_path / "u.gguf", hf, yarn_attn_factor=usual)
    assert max_diff(cached_logits(load_model(path, CPU, "f32").model, IDS), reference(hf)) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(rope_parameters=YARN)
    check_run_and_show(hf, write_arcee_gguf(tmp_path / "arcee.gguf", hf), "arcee")

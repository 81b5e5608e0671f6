"""InternLM3 against transformers (which runs model_type "internlm3" as LlamaForCausalLM),
from a config.json as InternLM3-8B-Instruct's spells it (qkv_bias, bias, dynamic NTK
rope_scaling) and from the "llama" GGUF llama.cpp's converter writes of it
(conversion/internlm.py InternLM3Model: TextModel's keys with key_length, the vocabulary
size, the rope dimension count as head_dim, q/k rows permuted as a llama's, no scaling
keys for dynamic RoPE).

Its features each move the logits by far more than the tolerance: heads of 32 features
in a hidden size of 64 with 4 heads (not 16), the biases (qkv_bias with bias). Dynamic NTK
scaling leaves RoPE plain within max_position_embeddings, which llmrun runs, and changes
transformers' logits past it, where llmrun refuses the positions.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time, the native decode
step included where the loader attaches it), contiguous or paged. An f16 or bf16 cache:
1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT from
f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

import json

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

from llmrun.errors import ContextOverflowError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
DYNAMIC = dict(rope_type="dynamic", factor=6.0, rope_theta=50000.0)
INTERNLM3 = dict(BASE, model_type="internlm3", head_dim=32, rope_parameters=DYNAMIC)
VARIANTS = {"default": {}, "biased": dict(attention_bias=True, mlp_bias=True)}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 7.7e-3 to 1.1e-2, bf16 4.7e-2 to 7.1e-2.
DRIFT = {"f16": 3e-2, "bf16": 3e-1}


def hf_model(**overrides):
    """A tiny transformers InternLM3 (a LlamaForCausalLM) with randomize()'s weights."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**INTERNLM3, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hub_config(hf) -> dict:
    """config.json as InternLM3-8B-Instruct's spells it: qkv_bias and bias, rope_theta and
    rope_scaling at the top."""
    config = hf.config
    rope = dict(config.rope_parameters)
    return dict(
        model_type="internlm3",
        architectures=["InternLM3ForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=config.attention_bias,
        bias=config.mlp_bias,
        rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope if rope["rope_type"] != "default" else None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def ours(hf) -> torch.nn.Module:
    return our_model(hub_config(hf), hf.state_dict())


def write_internlm3_gguf(path, hf, qtype=None):
    """The model as llama.cpp's converter writes InternLM3: arch "llama", TextModel's keys
    (key and value length: head_dim), the vocabulary size, the rope dimension count
    (head_dim), its base (no key for dynamic scaling), q and k rows permuted, 2-D weights
    in `qtype` (default F32)."""
    config = hf.config
    writer = gguf_writer(path, "llama", config)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType.MOSTLY_Q8_0
    )
    state = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = torch.from_numpy(_permute(tensor.numpy(), heads))
        state[name] = tensor
    return finish_stories_gguf(writer, path, state, gguf_name, qtype)


def write_hub_folder(path, hf):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hub_config(hf)))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    safetensors_torch.save_file(state, path / "model.safetensors")
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family):
    """The biases and heads of 32 features (against 16, hidden / heads) each change the
    logits; llmrun follows both."""
    hf, expected = family
    plain = reference(hf_model())
    if hf.config.attention_bias:
        assert max_diff(expected, plain) > 0.1
    narrow = hf_model(head_dim=16)
    assert max_diff(reference(narrow), plain) > 0.1
    assert max_diff(cached_logits(ours(narrow), IDS), reference(narrow)) < 1e-4


def test_dynamic_scaling_is_plain_rope_within_the_context_and_refused_past_it():
    """transformers' dynamic NTK RoPE gives plain RoPE's logits up to
    max_position_embeddings (32 here) and others past it (to every position of the
    sequence, and to those of any later call: it keeps its grown base); llmrun gives the
    first and refuses a position past it rather than computing either."""
    hf = hf_model(max_position_embeddings=32)
    plain = hf_model(max_position_embeddings=32, rope_parameters={"rope_theta": 50000.0})
    assert max_diff(reference(hf, IDS[:, :32]), reference(plain, IDS[:, :32])) < 1e-5
    assert max_diff(reference(hf)[:, :32], reference(plain)[:, :32]) > 0.1
    model = ours(hf)
    with torch.no_grad():
        within = model(IDS[:, :32], torch.arange(32)[None])
    assert max_diff(within, reference(plain, IDS[:, :32])) < 1e-4
    with pytest.raises(ContextOverflowError, match="dynamic NTK"):
        cached_logits(model, IDS)


def test_a_hub_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_hf_folder_saved_by_transformers_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_unequal_biases_are_refused(tmp_path):
    hf = hf_model()
    folder = write_hub_folder(tmp_path / "hub", hf)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "qkv_bias": True}))
    with pytest.raises(UnsupportedError, match="qkv_bias different from bias"):
        load_model(folder, CPU, "f32")


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_internlm3_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "llama"
    assert loaded.checkpoint.config["head_dim"] == 32
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    loaded = load_model(write_internlm3_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)  # q/k rows permuted or not, each row quantizes alike
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_the_native_decode_step_gives_the_torch_logits(family, tmp_path, monkeypatch):
    """InternLM3's layers are Llama's: the loader attaches Llama's native step to a
    folder's model, and its decoded logits are those of the torch layers."""
    hf, expected = family
    folder = write_hub_folder(tmp_path / "hub", hf)
    native = load_model(folder, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(folder, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5
    assert max_diff(cached_logits(native, IDS), expected) < 1e-4
    assert native.decode_step is not None  # it took the steps


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
    hf = hf_model()
    check_run_and_show(hf, write_internlm3_gguf(tmp_path / "internlm3.gguf", hf), "llama")

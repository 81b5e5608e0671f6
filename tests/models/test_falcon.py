"""Falcon against transformers' FalconForCausalLM, from a config.json (its three fused
layouts and both blocks) and from a "falcon" GGUF written as llama.cpp's converter
writes it (conversion/falcon.py FalconModel: context length 2048, tensor_data_layout
"jploski", embedding and feed-forward (4 * embedding) lengths, head counts, the
LayerNorms' epsilon, no RoPE keys; each query_key_value's rows regrouped from the KV
groups to all queries, all keys, all values; ln_attn as attn_norm_2, ln_mlp or
input_layernorm as attn_norm).

Its features each move the logits by far more than the tolerance (asserted below): the
parallel block, the second LayerNorm (ln_mlp), RoPE, the KV groups' row order in a GGUF
(undone: 2 KV heads, not 1), the biases.

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged. An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    hf_model_of,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import falcon as falcon_loading
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import falcon
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
FALCON = dict(
    model_type="falcon",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    layer_norm_epsilon=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Falcon-40B's and -180B's shape: the new decoder architecture, KV groups, two LayerNorms.
NEW = dict(new_decoder_architecture=True, num_kv_heads=2)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1e-3, bf16 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random FalconForCausalLM (f32, eval), FALCON with `overrides` (by default
    Falcon-7B's: multi-query, one LayerNorm, the parallel block)."""
    model = hf_model_of({**FALCON, **overrides})
    with torch.no_grad():  # randomize() knows no ln_attn, ln_mlp or ln_f by name
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), falcon_loading.hf_weights(hf.state_dict()))


# transformers' module (less "transformer.") -> llama.cpp's tensor (gguf-py's tensor_mapping).
_NAMES = {
    "input_layernorm": "attn_norm",
    "ln_mlp": "attn_norm",
    "ln_attn": "attn_norm_2",
    "self_attention.query_key_value": "attn_qkv",
    "self_attention.dense": "attn_output",
    "mlp.dense_h_to_4h": "ffn_up",
    "mlp.dense_4h_to_h": "ffn_down",
}
_GLOBAL = {"word_embeddings": "token_embd", "ln_f": "output_norm", "lm_head": "output"}


def gguf_tensor_name(name: str) -> str:
    module, _, suffix = name.removeprefix("transformer.").rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, layer, rest = module.split(".", 2)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def write_falcon_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes Falcon: FalconModel's keys, each
    query_key_value's rows regrouped (the jploski layout), 2-D weights in `qtype`
    (default F32), no output tensor (tied). `keys`: metadata to change ("{arch}.…" ->
    value, None leaves one out)."""
    config = hf.config
    n_embd, n_head = config.hidden_size, config.num_attention_heads
    n_kv = config.num_kv_heads if config.new_decoder_architecture else 1
    metadata = {
        "{arch}.context_length": 2048,
        "{arch}.tensor_data_layout": "jploski",
        "{arch}.embedding_length": n_embd,
        "{arch}.feed_forward_length": 4 * n_embd,
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_kv,
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_epsilon),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    head_dim = n_embd // n_head
    tensors = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: not in the checkpoint
            continue
        data = t.detach().float().numpy()
        if "query_key_value" in name:
            rest = data.shape[1:]  # a weight's columns, none for a bias
            groups = data.reshape(n_kv, n_head // n_kv + 2, head_dim, *rest)
            q = groups[:, :-2].reshape(-1, *rest)
            k, v = groups[:, -2].reshape(-1, *rest), groups[:, -1].reshape(-1, *rest)
            data = np.concatenate((q, k, v))
        tensors[gguf_tensor_name(name)] = data
    return write_keyed_gguf(path, "falcon", metadata, tensors, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        NEW,
        {**NEW, "num_ln_in_parallel_attn": 1},  # Falcon 2 11B
        {"multi_query": False},
        {"multi_query": False, "parallel_attn": False, "bias": True},  # Falcon-RW's block
    ],
    ids=["7b", "40b", "11b", "per-head-qkv", "sequential-biased"],
)
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**variant)
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """The parallel block (against a sequential one), ln_mlp (against ln_attn for both),
    RoPE (against none) and the biases each change the logits by far more than the
    tolerance."""
    hf, expected = family
    assert max_diff(reference(hf_model(parallel_attn=False)), expected) > 0.1
    two = hf_model(**NEW)
    model = ours(two)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.ln_mlp.load_state_dict(layer.ln_attn.state_dict())
    assert max_diff(cached_logits(model, IDS), reference(two)) > 0.1
    biased = hf_model(bias=True)
    model = ours(biased)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attention.query_key_value.bias.zero_()
    assert max_diff(cached_logits(model, IDS), reference(biased)) > 0.1
    monkeypatch.setattr(falcon.Frame, "rotate", lambda self, x: x)
    assert max_diff(cached_logits(ours(hf), IDS), expected) > 0.1


@pytest.mark.parametrize("variant", [{}, NEW, {**NEW, "num_ln_in_parallel_attn": 1}],
                         ids=["7b", "40b", "11b"])  # fmt: skip
def test_a_gguf_matches_transformers(variant, tmp_path):
    hf = hf_model(**variant)
    loaded = load_model(write_falcon_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "falcon" and config["tie_word_embeddings"]
    assert config["num_ln_in_parallel_attn"] == variant.get(
        "num_ln_in_parallel_attn", 2 if variant else 1
    )
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(**NEW)
    f32 = reference(hf)
    loaded = load_model(write_falcon_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)  # rows quantize alike in either order
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(tmp_path):
    hf = hf_model(**NEW)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "falcon"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("variant", [{}, NEW], ids=["7b", "40b"])
def test_serves_from_paged_blocks_as_every_family_does(variant):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf = hf_model(**variant)
    check_paged(ours(hf), IDS, reference(hf))


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """The native step knows no fused query_key_value or parallel block: the loader
    leaves Falcon to the torch layers."""
    loaded = load_model(write_falcon_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(ours(family[0]))


def test_alibi_is_refused():
    with pytest.raises(UnsupportedError, match="ALiBi"):
        falcon.ModelArgs.from_config({**FALCON, "alibi": True})


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.attention.key_length": 8}, UnsupportedError, "head of 8 features"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_falcon_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_biases_in_a_gguf_are_refused(tmp_path):
    """llama.cpp's falcon reads no projection biases; the converter would write them."""
    path = write_falcon_gguf(tmp_path / "m.gguf", hf_model(bias=True))
    with pytest.raises(UnsupportedError, match="no biases"):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_a_fused_qkv_of_the_wrong_height_is_refused(family, tmp_path):
    path = write_falcon_gguf(
        tmp_path / "m.gguf", family[0], **{"{arch}.attention.head_count_kv": 2}
    )
    with pytest.raises(ModelFormatError, match="attn_qkv of layer 0 has 96 rows"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    """Falcon 2 11B's shape: 2 KV groups regrouped in the file, one LayerNorm. (40B's
    shape greedily picks a "\\r", which the test's text-mode pipe turns to "\\n".)"""
    hf = hf_model(**NEW, num_ln_in_parallel_attn=1)
    check_run_prints_greedy_tokens(hf, write_falcon_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_falcon_gguf(family, tmp_path):
    path = write_falcon_gguf(tmp_path / "m.gguf", family[0])
    # Two layers of 8192 positions: 1 KV head of 16 floats, keys and values.
    check_show(path, "falcon", 2 * 2 * 1 * 16 * 4 * 8192)

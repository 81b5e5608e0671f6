"""BLOOM against transformers' BloomForCausalLM, from a config.json and from a "bloom"
GGUF written as llama.cpp's converter writes it (conversion/bloom.py BloomModel: context
length (seq_length, else the embedding length), embedding and feed-forward (4 *
embedding) lengths, head counts, the LayerNorms' epsilon; the "transformer." prefix
dropped, each query_key_value's rows regrouped from (head, q/k/v) to (q/k/v, head); no
output tensor where the embeddings are tied).

Its features each move the logits by far more than the tolerance (asserted below):
ALiBi, the LayerNorm over the embeddings, apply_residual_connection_post_layernorm;
6 heads check ALiBi's slopes for a head count that is not a power of 2.

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
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    hf_model_of,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import alibi_families
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import bloom
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
BLOOM = dict(
    model_type="bloom",
    hidden_size=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    layer_norm_epsilon=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 4e-4, bf16 4e-3.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random BloomForCausalLM (f32, eval), BLOOM with `overrides`."""
    return trained_norms(hf_model_of({**BLOOM, **overrides}))


def trained_norms(model):
    """`model` with every LayerNorm's scale 1 + N(0, 0.1), as randomize() draws the norms
    it knows by name (ln_f, norm_1, ... it does not): N(0, 0.2) scales shrink attention
    to near uniform and hide position bugs."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    state = alibi_families.hf_weights(hf.state_dict(), "bloom")
    return our_model(hf.config.to_dict(), state)


# transformers' module (less "transformer.") -> llama.cpp's tensor (gguf-py's tensor_mapping).
_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attention.query_key_value": "attn_qkv",
    "self_attention.dense": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.dense_h_to_4h": "ffn_up",
    "mlp.dense_4h_to_h": "ffn_down",
}
_GLOBAL = {
    "word_embeddings": "token_embd",
    "word_embeddings_layernorm": "token_embd_norm",
    "ln_f": "output_norm",
    "lm_head": "output",
}


def gguf_tensor_name(name: str) -> str:
    module, _, suffix = name.removeprefix("transformer.").rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, layer, rest = module.split(".", 2)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def write_bloom_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes BLOOM: BloomModel's keys, each
    query_key_value's rows regrouped, 2-D weights in `qtype` (default F32), no output
    tensor (tied). `keys`: metadata to change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    n_embd, n_head = config.hidden_size, config.n_head
    metadata = {
        "{arch}.context_length": getattr(config, "seq_length", None) or n_embd,
        "{arch}.embedding_length": n_embd,
        "{arch}.feed_forward_length": 4 * n_embd,
        "{arch}.block_count": config.n_layer,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_head,
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_epsilon),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    tensors = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: not in the checkpoint
            continue
        data = t.detach().float().numpy()
        if "query_key_value" in name:
            # [H * 3 * D, ...] -> [H, 3, D, ...] -> [3, H, D, ...]
            grouped = data.reshape(n_head, 3, n_embd // n_head, *data.shape[1:])
            data = np.ascontiguousarray(grouped.swapaxes(0, 1)).reshape(data.shape)
        tensors[gguf_tensor_name(name)] = data
    return write_keyed_gguf(path, "bloom", metadata, tensors, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


@pytest.mark.parametrize(
    "variant",
    [{}, {"n_head": 6, "hidden_size": 48}, {"apply_residual_connection_post_layernorm": True}],
    ids=["4-heads", "6-heads", "post-layernorm-residual"],
)
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**variant)
    expected = reference(hf)
    model = ours(hf)
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """ALiBi (against no position bias), the embeddings' LayerNorm (against none) and
    the post-LayerNorm residual (against the usual one) each change the logits by far
    more than the tolerance."""
    hf, expected = family
    other = hf_model(apply_residual_connection_post_layernorm=True)
    assert max_diff(reference(other), expected) > 0.1
    model = ours(hf)
    monkeypatch.setattr(bloom.ModelArgs, "alibi_slopes", lambda self: torch.zeros(4))
    assert max_diff(cached_logits(model, IDS), expected) > 0.1
    monkeypatch.undo()
    monkeypatch.setattr(bloom.Model, "embed", lambda self, ids: self.model.embed_tokens(ids))
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_alibi_slopes_are_transformers_for_any_head_count():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for heads in (1, 4, 6, 12, 16, 30):
        mask = torch.ones(1, 2)
        expected = build_alibi_tensor(mask, heads, torch.float32)[:, 0, 1]
        torch.testing.assert_close(bloom.alibi_slopes(heads), expected, rtol=1e-6, atol=0)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_bloom_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "bloom" and config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_of_6_heads_matches_transformers(tmp_path):
    hf = hf_model(n_head=6, hidden_size=48)
    loaded = load_model(write_bloom_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    loaded = load_model(write_bloom_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)  # rows quantize alike in either order
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "bloom"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_checkpoint_names_without_the_transformer_prefix_load():
    """bigscience/bloom-560m's files name word_embeddings, h.N, ln_f at the top."""
    names = {"word_embeddings.weight": 0, "word_embeddings_layernorm.bias": 1,
             "h.3.mlp.dense_h_to_4h.weight": 2, "ln_f.weight": 3}  # fmt: skip
    assert alibi_families.hf_weights(names, "bloom") == {
        "model.embed_tokens.weight": 0,
        "model.word_embeddings_layernorm.bias": 1,
        "model.layers.3.mlp.dense_h_to_4h.weight": 2,
        "model.norm.weight": 3,
    }


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks, each with its ALiBi bias."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_neither_the_static_nor_the_native_decode_step_takes_it(family, tmp_path):
    """Both attend without a position bias: BLOOM decodes through its torch layers."""
    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))
    assert not decode_step.attach(model)
    loaded = load_model(write_bloom_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.feed_forward_length": 100}, UnsupportedError, "feed-forward of 100"),
        ({"{arch}.attention.head_count_kv": 2}, UnsupportedError, "fewer KV heads"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_bloom_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_bloom_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_bloom_gguf(family, tmp_path):
    path = write_bloom_gguf(tmp_path / "m.gguf", family[0])
    # Two layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    check_show(path, "bloom", 2 * 2 * 4 * 16 * 4 * 8192)

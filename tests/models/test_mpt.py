"""MPT against transformers' MptForCausalLM, from a config.json and from an "mpt" GGUF
written as llama.cpp's converter writes it (conversion/mpt.py MPTModel: context length
max_seq_len, embedding and feed-forward (4 * embedding) lengths, head count, epsilon
1e-5, attention.clamp_kqv where clip_qkv is set, attention.max_alibi_bias; tensors as
they are, the fused Wqkv already queries, keys, values; no output tensor where the
embeddings are tied).

Its features each move the logits by far more than the tolerance (asserted below):
ALiBi, clip_qkv, softmax_scale; 6 heads check ALiBi's slopes for a head count that is
not a power of 2 (MPT orders them its own way, which comes to BLOOM's).

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
from llmrun.models import mpt
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
MPT = dict(
    model_type="mpt",
    d_model=64,
    n_layers=2,
    n_heads=4,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    max_seq_len=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CLIP = 0.3  # below the random projections' largest outputs, so clamping moves them
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 3e-4, bf16 3e-3.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random MptForCausalLM (f32, eval), MPT with `overrides` (attn_config's
    clip_qkv and softmax_scale as keywords)."""
    attn = {k: overrides.pop(k) for k in ("clip_qkv", "softmax_scale") if k in overrides}
    return trained_norms(hf_model_of({**MPT, "attn_config": attn, **overrides}))


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
    return our_model(hf.config.to_dict(), alibi_families.hf_weights(hf.state_dict(), "mpt"))


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping).
_NAMES = {
    "norm_1": "attn_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm_2": "ffn_norm",
    "ffn.up_proj": "ffn_up",
    "ffn.down_proj": "ffn_down",
}
_GLOBAL = {"transformer.wte": "token_embd", "transformer.norm_f": "output_norm"}


def gguf_tensor_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def write_mpt_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes MPT: MPTModel's keys, the tensors as
    they are, 2-D weights in `qtype` (default F32), no output tensor (tied). `keys`:
    metadata to change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    attn = config.attn_config
    metadata = {
        "{arch}.context_length": config.max_seq_len,
        "{arch}.embedding_length": config.d_model,
        "{arch}.block_count": config.n_layers,
        "{arch}.feed_forward_length": 4 * config.d_model,
        "{arch}.attention.head_count": config.n_heads,
        "{arch}.attention.layer_norm_epsilon": 1e-5,
        "{arch}.attention.clamp_kqv": float(attn.clip_qkv) if attn.clip_qkv else None,
        "{arch}.attention.max_alibi_bias": float(attn.alibi_bias_max) if attn.alibi else 0.0,
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    tensors = {
        gguf_tensor_name(name): t.detach().float().numpy()
        for name, t in hf.state_dict().items()
        if name != "lm_head.weight"  # tied: not in the checkpoint
    }
    return write_keyed_gguf(path, "mpt", metadata, tensors, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model(clip_qkv=CLIP)
    return hf, reference(hf)


@pytest.mark.parametrize(
    "variant",
    [{}, {"clip_qkv": CLIP}, {"n_heads": 6, "d_model": 48}, {"softmax_scale": 0.5}],
    ids=["plain", "clip_qkv", "6-heads", "softmax_scale"],
)
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**variant)
    expected = reference(hf)
    model = ours(hf)
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """ALiBi (against no position bias), clip_qkv and a softmax scale of its own (against
    none, in transformers) each change the logits by far more than the tolerance."""
    hf, expected = family
    for variant in ({}, {"clip_qkv": CLIP, "softmax_scale": 0.5}):
        assert max_diff(reference(hf_model(**variant)), expected) > 0.1, variant
    monkeypatch.setattr(mpt.ModelArgs, "alibi_slopes", lambda self: torch.zeros(4))
    assert max_diff(cached_logits(ours(hf), IDS), expected) > 0.1


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_mpt_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "mpt" and config["tie_word_embeddings"]
    assert config["attn_config"]["clip_qkv"] == pytest.approx(CLIP)
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_of_6_heads_without_clamping_matches_transformers(tmp_path):
    hf = hf_model(n_heads=6, d_model=48)
    loaded = load_model(write_mpt_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["attn_config"]["clip_qkv"] is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(clip_qkv=CLIP)
    f32 = reference(hf)
    loaded = load_model(write_mpt_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "mpt"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


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
    """Both attend without a position bias: MPT decodes through its torch layers."""
    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))
    assert not decode_step.attach(model)
    loaded = load_model(write_mpt_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.attention.max_alibi_bias": 0.0}, UnsupportedError, "without ALiBi"),
        ({"{arch}.attention.max_alibi_bias": None}, UnsupportedError, "without ALiBi"),
        ({"{arch}.attention.head_count_kv": 2}, UnsupportedError, "fewer KV heads"),
        ({"{arch}.context_length": None}, ModelFormatError, "context_length"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_mpt_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_learned_positions_in_a_gguf_are_refused(tmp_path):
    """llama.cpp's mpt reads a position_embd table where a file has one; transformers'
    MPT has none."""
    keys = {
        "{arch}.context_length": 256,
        "{arch}.embedding_length": 64,
        "{arch}.feed_forward_length": 256,
        "{arch}.block_count": 2,
        "{arch}.attention.head_count": 4,
        "{arch}.attention.layer_norm_epsilon": 1e-5,
        "{arch}.attention.max_alibi_bias": 8.0,
    }
    path = write_keyed_gguf(
        tmp_path / "pos.gguf", "mpt", keys, {"position_embd.weight": np.zeros((256, 64))}
    )
    with pytest.raises(UnsupportedError, match="no learned positions"):
        config_from_gguf(read_gguf(path, with_tensors=False))


@pytest.mark.parametrize(
    "attn,message", [({"alibi": False}, "without ALiBi"), ({"qk_ln": True}, "q/k LayerNorms")]
)
def test_configs_transformers_does_not_run_are_refused(attn, message):
    with pytest.raises(UnsupportedError, match=message):
        mpt.ModelArgs.from_config({**MPT, "attn_config": attn})


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_mpt_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_an_mpt_gguf(family, tmp_path):
    path = write_mpt_gguf(tmp_path / "m.gguf", family[0])
    # Two layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    check_show(path, "mpt", 2 * 2 * 4 * 16 * 4 * 8192)

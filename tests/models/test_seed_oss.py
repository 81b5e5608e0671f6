"""Seed-OSS against transformers' SeedOssForCausalLM, from a config.json and from a
"seed_oss" GGUF written as llama.cpp's converter writes it (conversion/olmo.py
SeedOssModel: TextModel's keys with key_length, q/k rows as they are, the norm before
the feed-forward as post_attention_norm, the q/k/v biases).

Its features each move the logits by far more than the tolerance: the q/k/v biases,
the output projection's bias (attention_out_bias, tried on), and heads of 32 features
in a hidden size of 64 with 4 heads (not 16).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time, the native decode
step included where the loader attaches it), contiguous or paged. An f16 or bf16 cache:
1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT from
f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

import subprocess
import sys

import numpy as np
import pytest
import test_paged
import test_static_decode
import torch
from helpers import BASE, STORIES_GGUF, cached_logits, gguf_name, our_model, randomize
from test_cache_types import rounded_to

from llmrun import static_decode
from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models.paged import PagedKVCache
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
SEED_OSS = dict(BASE, model_type="seed_oss", head_dim=32, rope_theta=10000.0)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 1.4e-3, bf16 1.3e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**SEED_OSS, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def seed_gguf_name(name: str) -> str:
    if name.endswith("post_attention_layernorm.weight"):
        return f"blk.{name.split('.')[2]}.post_attention_norm.weight"
    return gguf_name(name)


def write_seed_gguf(path, hf, qtype=None, rope_dims=None):
    """The model as llama.cpp's converter writes Seed-OSS: TextModel's keys (key and
    value length from the config's head_dim), tensors unpermuted, 2-D weights in
    `qtype` (default F32). rope_dims: a rope dimension count, for the refusal."""
    config = hf.config
    writer = gguf.GGUFWriter(str(path), "seed_oss")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        if data.ndim == 2 and qtype is not None:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(seed_gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(seed_gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["default", "out-bias"])
def family(request):
    hf = hf_model(attention_out_bias=request.param)
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_each_feature_moves_the_logits():
    """No q/k/v biases, no output bias, or heads of hidden / heads: each changes the
    logits by far more than the tolerance, and llmrun follows each variant."""
    expected = reference(hf_model(attention_out_bias=True))
    for variant in (
        dict(attention_bias=False, attention_out_bias=True),
        dict(attention_out_bias=False),
        dict(head_dim=None, attention_out_bias=True),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_seed_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "seed_oss" and config["head_dim"] == 32
    assert config["attention_out_bias"] == hf.config.attention_out_bias
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(attention_out_bias=True)
    loaded = load_model(write_seed_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, q8)))
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_gives_the_torch_logits(family, tmp_path, monkeypatch):
    """The loader attaches the native step (Llama's layers with biases); its decoded
    logits are those of the torch layers."""
    hf, expected = family
    path = write_seed_gguf(tmp_path / "m.gguf", hf)
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def cache_logits(model, cache, sizes=(7, 20)) -> torch.Tensor:
    """Logits of IDS through `cache` (a KV cache, or a function giving each forward call
    its paged view): prefills of `sizes`, then one token at a time."""
    out, start = [], 0
    with torch.inference_mode():
        for n in list(sizes) + [1] * (SEQ - sum(sizes)):
            positions = torch.arange(start, start + n)[None]
            view = cache() if callable(cache) else cache
            out.append(model(IDS[:, start : start + n], positions, view))
            start += n
    return torch.cat(out, dim=1)


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = family
    model = ours(hf)
    pool = PagedKVCache(model.new_cache(1, 1, "f32", "cpu"), 16, 16, 256)
    assert max_diff(cache_logits(model, lambda: pool.view([[9, 2, 14]])), expected) < 1e-4
    for cache_type in ("f32", "f16"):
        test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(
            model, cache_type
        )
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(model)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    hf, expected = family
    model = ours(hf)
    typed = cache_logits(model, model.new_cache(1, 64, cache_type, "cpu"))
    rounded = model.new_cache(1, 64, torch.float32, "cpu")
    rounded.encode = rounded_to(cache_type)
    assert max_diff(typed, cache_logits(model, rounded)) < 1e-5
    assert 0 < max_diff(typed, expected) < DRIFT[cache_type]


def test_partial_rope_is_refused(tmp_path):
    path = write_seed_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=16)
    with pytest.raises(ModelFormatError, match="Seed-OSS rotates whole heads"):
        load_model(path, CPU, "f32")


def greedy_text(hf, path, prompt: str, tokens: int) -> str:
    """transformers' greedy continuation of `prompt` (encoded by the GGUF's tokenizer),
    as `llmrun run` prints it: the text the new tokens add to the prompt's."""
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=2
        )
    new = [t for t in out[0, len(ids) :].tolist() if t != 2]
    return tokenizer.decode(ids + new)[len(tokenizer.decode(ids)) :]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmrun", *args], capture_output=True, text=True, timeout=120
    )


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(attention_out_bias=True)
    path = write_seed_gguf(tmp_path / "seed.gguf", hf)
    expected = greedy_text(hf, path, "Once upon a time", 16)
    result = run_cli("run", str(path), "Once upon a time", "-n", "16", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected
    shown = run_cli("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "seed_oss" in shown.stdout


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    hf = family[0]
    model = ours(hf)
    monkeypatch.setattr(static_decode, "FIRST_BUCKET", 8)
    static_cache = model.new_cache(1, 32, torch.float32, "cpu")
    assert static_decode.supported(model, static_cache)
    cache = model.new_cache(1, 32, torch.float32, "cpu")
    got = test_static_decode.decode_logits(
        model, static_decode.step(model, static_cache), static_cache
    )
    expected = test_static_decode.decode_logits(
        model, test_static_decode.ordinary(model, cache), cache
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

"""Checks each model family's test file holds its own model to: through serve's paged
blocks and a typed KV cache (as tests/models/test_paged.py and test_cache_types.py hold
every family), CUDA graphs' static decode step run eager (test_static_decode.py), and
`llmrun run` printing transformers' greedy text, `llmrun show` naming the family (both
run in process: tests/in_process.py). Each takes the family's model and its reference
and tolerances; only the code is shared."""

import json

import test_paged
import test_static_decode
import torch
from helpers import STORIES_GGUF, cached_logits, randomize
from in_process import llmrun
from test_cache_types import logits_of, rounded_to

from llmrun import static_decode
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.models.paged import PagedKVCache
from llmrun.tokenizer import load_tokenizer

PROMPT = "Once upon a time"


def hf_model_of(config: dict, scales: dict[str, float] | None = None):
    """transformers' model of `config` (f32, eval) with randomize()'s weights (and
    `scales`), seed 0."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32
    ).eval()
    randomize(model, scales)
    return model


def dequantize_2d_weights(hf, qtype) -> None:
    """Round `hf`'s 2-D weights in place through gguf's `qtype` quantizer and back: the
    weights a GGUF of that type holds."""
    import gguf

    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))


def dequantize_weights_ending(hf, qtype, endings: tuple[str, ...]) -> None:
    """Round `hf`'s weights whose names end with one of `endings` in place through gguf's
    `qtype` quantizer and back: the weights a GGUF quantizing those alone holds."""
    import gguf

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(endings):
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))


def gguf_writer(path, arch: str, config, context: bool = True, key_length: bool = True):
    """A GGUFWriter of `arch` with TextModel's shape keys from a transformers config:
    block count, (context length), embedding and feed-forward lengths, head counts, RMS
    norm eps, (key and value length: the config's head_dim)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    if context:
        writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if key_length:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    return writer


def finish_stories_gguf(writer, path, state: dict, name_of, qtype=None):
    """Write stories260K's llama vocabulary (bos 1, eos 2) and `state`'s tensors under
    name_of(name), 2-D ones in `qtype` (default F32), then the file; returns `path`."""
    import gguf
    import numpy as np

    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if data.ndim == 2 and qtype is not None:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name_of(name), raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name_of(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_keyed_gguf(
    path, arch: str, keys: dict, tensors: dict, qtype=None, whole_blocks=False, keep_f32=()
):
    """A GGUF of `arch`: `keys` ("{arch}.…" templates -> value, as the converter writes
    them; None leaves a key out), stories260K's llama vocabulary, and `tensors` (GGUF
    name -> array), those of two or more dimensions but the routers (ffn_gate_inp, which
    the converter keeps in F32) and those whose names hold one of `keep_f32` in `qtype`
    (default F32); with `whole_blocks`, only those whose rows are whole blocks of it (the
    rest F32, as the converter falls back); returns `path`."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        name = key.format(arch=arch)
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, np.ndarray) and value.dtype == np.uint64:  # qwen4exp's
            writer.add_key_value(
                name, value.tolist(), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64
            )
        elif isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_string(name, value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, data in tensors.items():
        partial = (
            whole_blocks and qtype is not None and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]
        )
        kept = "ffn_gate_inp" in name or any(part in name for part in keep_f32)
        if data.ndim == 1 or qtype is None or kept or partial:
            writer.add_tensor(name, data.astype(np.float32))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def check_whole_and_cached(
    model, ids: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-4
) -> None:
    """model's logits of ids [1, T], whole and through a KV cache (helpers.cached_logits:
    prefills in pieces, then a token at a time), within `tolerance` of `expected`
    (transformers' logits of ids)."""
    with torch.no_grad():
        assert max_diff(model(ids, torch.arange(ids.shape[1])[None]), expected) < tolerance
    assert max_diff(cached_logits(model, ids), expected) < tolerance


def cache_logits(model, ids: torch.Tensor, cache, sizes=(7, 20)) -> torch.Tensor:
    """Logits of `ids` through `cache` (a KV cache, or a function giving each forward
    call its paged view): prefills of `sizes`, then one token at a time."""
    out, start = [], 0
    with torch.inference_mode():
        for n in list(sizes) + [1] * (ids.shape[1] - sum(sizes)):
            positions = torch.arange(start, start + n)[None]
            view = cache() if callable(cache) else cache
            out.append(model(ids[:, start : start + n], positions, view))
            start += n
    return torch.cat(out, dim=1)


def check_paged(model, ids: torch.Tensor, expected: torch.Tensor, windowed=None, monkeypatch=None):
    """test_paged.py's checks of serve's paged KV cache: `ids` through blocks 9, 2, 14 of
    a pool (1e-4 from `expected`), one sequence on shuffled blocks (f32, f16), rows of a
    batch sharing prefix blocks; with `windowed` (a name), the windowed layers in a pool
    of their own whose blocks are let go and reused."""
    pool = PagedKVCache(model.new_cache(1, 1, "f32", "cpu"), 16, 16, 256)
    assert max_diff(cache_logits(model, ids, lambda: pool.view([[9, 2, 14]])), expected) < 1e-4
    for cache_type in ("f32", "f16"):
        test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(
            model, cache_type
        )
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(model)
    if windowed is not None:
        monkeypatch.setattr(test_paged, "built", lambda _: model)
        test_paged.test_windowed_layers_in_a_pool_of_their_own_give_the_contiguous_logits(windowed)


def check_typed_cache(model, ids: torch.Tensor, expected: torch.Tensor, cache_type, drift):
    """As test_cache_types.py: the logits of a `cache_type` cache are those of an f32
    cache whose writes are rounded to the type (1e-5), drifting from f32 `expected` by
    the rounding (more than 0, less than `drift`)."""
    typed = cache_logits(model, ids, model.new_cache(1, 64, cache_type, "cpu"))
    rounded = model.new_cache(1, 64, torch.float32, "cpu")
    rounded.encode = rounded_to(cache_type)
    assert max_diff(typed, cache_logits(model, ids, rounded)) < 1e-5
    assert 0 < max_diff(typed, expected) < drift


def check_rounded_cache(model, cache_type, drift=None, moves=True):
    """test_cache_types' check: the logits of a `cache_type` cache are those of an f32
    cache holding the rounded values (1e-5). With `moves`, they differ from the f32
    cache's; with `drift`, by less than that."""
    logits = logits_of(model, cache_type)
    rounded = logits_of(model, torch.float32, rounded=cache_type)
    torch.testing.assert_close(logits, rounded, atol=1e-5, rtol=0)
    if moves or drift is not None:
        moved = (logits - logits_of(model, torch.float32)).abs().max()
        assert moved > 0
        if drift is not None:
            assert moved < drift


def check_static_decode(model, monkeypatch, tolerance=1e-5):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does) is
    supported and gives the ordinary forward's decoded logits (rtol = atol = tolerance)."""
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
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def greedy_text(hf, path, prompt: str, tokens: int, eos: int = 2) -> str:
    """transformers' greedy continuation of `prompt` (encoded by the GGUF's tokenizer),
    as `llmrun run` prints it: the text the new tokens add to the prompt's."""
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=eos
        )
    new = [t for t in out[0, len(ids) :].tolist() if t != eos]
    return tokenizer.decode(ids + new)[len(tokenizer.decode(ids)) :]


def check_run_and_show(hf, path, model_type: str, tokens: int = 16) -> None:
    """`llmrun run PATH PROMPT -n tokens --temperature 0` prints transformers' greedy
    text exactly, and `llmrun show PATH` succeeds naming `model_type`."""
    expected = greedy_text(hf, path, PROMPT, tokens)
    result = llmrun("run", str(path), PROMPT, "-n", str(tokens), "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert model_type in shown.stdout


def check_run_token_ids(hf, path, tokens: int = 12, text: bool = True) -> None:
    """`llmrun run PATH PROMPT -n tokens --temperature 0 --json --logprobs 1` picks
    transformers' greedy token ids; with `text`, its text is their decoding."""
    prompt = load_tokenizer(path).encode(PROMPT)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    result = llmrun(
        "run", str(path), PROMPT, "-n", str(tokens), "--temperature", "0",
        "--json", "--logprobs", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [entry["id"] for entry in data["logprobs"]] == expected
    if text:
        assert data["text"] == load_tokenizer(path).decode(expected)


def check_run_prints_greedy_tokens(hf, path, tokens: int = 24, at_least: int = 8) -> None:
    """`llmrun run PATH PROMPT -n tokens --temperature 0` prints the decoding of
    transformers' greedy tokens up to its end of sequence (2), at least `at_least` of
    them (and a first space, where their first token has one)."""
    result = llmrun("run", str(path), PROMPT, "-n", str(tokens), "--temperature", "0")
    assert result.returncode == 0, result.stderr
    tokenizer = load_tokenizer(path)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=2)
    new = out[0, ids.shape[1] :].tolist()
    new = new[: new.index(2)] if 2 in new else new
    assert len(new) > at_least
    # The CLI prints a continuation's first space ("▁Lily" after the prompt), which a
    # SentencePiece decode of the new tokens alone drops.
    assert result.stdout.removeprefix(" ") == tokenizer.decode(new)


def check_show(path, architecture: str, kv_cache_bytes_8k: int, moe: bool = False):
    """`llmrun show PATH` names the architecture; inspect.describe gives it, the KV
    cache's bytes at 8192 positions and, for `moe`, fewer active parameters than all."""
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert architecture in result.stdout
    info = inspect.describe(path)
    assert info["architecture"] == architecture
    assert info["kv_cache_bytes_8k"] == kv_cache_bytes_8k
    if moe:
        assert 0 < info["active_parameters"] < info["parameters"]


def check_served_as_alone(engine, cases, tokens: int, parallel: int) -> None:
    """serve's scheduler (`parallel` rows, a queue of 8) gives each of `cases` (prompt
    ids, sampling params) the text and finish reason engine.generate gives it alone,
    more than 5 pieces of it."""
    from test_batching import Collector

    from llmrun.batching import Request, Scheduler

    scheduler = Scheduler(engine, parallel=parallel, queue=8)
    collectors = [Collector() for _ in cases]
    for (prompt, params), collector in zip(cases, collectors, strict=True):
        scheduler.submit(Request(prompt, params, tokens), collector)
    scheduler.start()
    try:
        for (prompt, params), collector in zip(cases, collectors, strict=True):
            responses = list(engine.generate(prompt, params, tokens))
            assert len(responses) > 5
            assert collector.result() == (
                "".join(r.text for r in responses),
                responses[-1].finish_reason,
            )
    finally:
        scheduler.close()


def load_matching_weights(source, target) -> None:
    """Load into `target` (a transformers model) `source`'s weights that `target` has under
    the same name and shape; the rest of `target` keeps its own."""
    own = target.state_dict()
    same = {k: v for k, v in source.state_dict().items() if k in own and own[k].shape == v.shape}
    target.load_state_dict(same, strict=False)

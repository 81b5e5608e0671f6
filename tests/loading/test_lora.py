"""LoRA adapters (llmrun.loading.lora) against PEFT, the reference implementation.

A tiny random Llama or Qwen2 in transformers, a PEFT LoRA on every projection with
random non-zero A and B (rank 8, alpha 16: the adapter moves the logits by ~5), saved as
a PEFT folder and as a GGUF adapter the way convert_lora_to_gguf.py writes one. llmrun's
logits, prefill and then one token at a time through its KV cache (where the native
decode step would run without an adapter), match PEFT's within 1e-4 (f32), for the HF
folder and the GGUF base (F32; Q8_0, against PEFT on the same rounded weights) with
either adapter; so do a scale of 0.5 (PEFT with half the alpha), rsLoRA, two adapters
at once, and batch rows at scales of their own (serve's per-request scales: 0 is the
base model). `llmrun run --lora` picks PEFT's greedy tokens and `llmrun serve --lora` answers
their text. Adapters llmrun does not run are refused in one line.
"""

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import (
    STORIES_GGUF,
    STORIES_HF,
    cached_logits,
    save_hf_dir,
    tiny_hf_model,
    write_gguf,
)
from in_process import llmrun
from lora_helpers import needs_peft, peft_model, write_gguf_lora
from serving import Server

from llmrun import native
from llmrun.errors import LlmrunError, ModelFormatError, UnsupportedError, UsageError
from llmrun.loading.loader import load_model
from llmrun.loading.lora import Adapter, LoraLinear, LoraScales, LoraWeight, parse_spec, scaled
from llmrun.tokenizer import load_tokenizer

pytestmark = needs_peft
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 44, 501, 12, 7, 250]])
ALPHA = 16.0
TOLERANCE = 1e-4


def llmrun_logits(base, adapters) -> torch.Tensor:
    """llmrun's logits of IDS through a KV cache (prefill chunks, then decode steps)."""
    model = load_model(base, CPU, "f32", adapters).model
    assert model.decode_step is None  # the native step would leave the adapters out
    return cached_logits(model, IDS, chunks=(5, 3))


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    """(config, transformers model, PEFT model, folder holding base/, peft/, base.gguf
    and lora.gguf)."""
    hf, config = tiny_hf_model(request.param)
    peft = peft_model(hf, rank=8, alpha=ALPHA)
    folder = tmp_path_factory.mktemp(request.param)
    save_hf_dir(hf, folder / "base", tokenizer=True)
    peft.save_pretrained(folder / "peft")
    write_gguf(folder / "base.gguf", config, hf.state_dict())
    write_gguf_lora(folder / "lora.gguf", peft, config, ALPHA)
    return config, hf, peft, folder


@pytest.mark.parametrize(
    ("base", "adapter"),
    [("base", "peft"), ("base.gguf", "lora.gguf"), ("base.gguf", "peft"), ("base", "lora.gguf")],
)
def test_adapter_matches_peft(family, base, adapter):
    _, hf, peft, folder = family
    expected = reference(peft)
    assert (expected - reference(hf)).abs().max() > 1  # the adapter changes the logits
    got = llmrun_logits(folder / base, [(folder / adapter, 1.0)])
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_scale_matches_peft_with_scaled_alpha(family):
    _, hf, peft, folder = family
    half = peft_model(hf, rank=8, alpha=ALPHA / 2)  # the same A and B (same seed)
    expected = reference(half)
    for adapter in ("peft", "lora.gguf"):
        got = llmrun_logits(folder / "base.gguf", [(folder / adapter, 0.5)])
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_rslora_scales_by_the_root_of_the_rank(tmp_path):
    hf, _ = tiny_hf_model("llama")
    peft = peft_model(hf, rank=16, alpha=ALPHA, use_rslora=True)
    save_hf_dir(hf, tmp_path / "base")
    peft.save_pretrained(tmp_path / "peft")
    got = llmrun_logits(tmp_path / "base", [(tmp_path / "peft", 1.0)])
    torch.testing.assert_close(got, reference(peft), atol=TOLERANCE, rtol=0)


def _round_q8_0(t: torch.Tensor) -> torch.Tensor:
    q8 = GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8))


def test_q8_0_base_and_adapter_match_peft_on_the_rounded_weights(tmp_path):
    """A Q8_0 model (its blocks multiplied by the native kernels) with a Q8_0 adapter:
    lora_a in Q8_0, lora_b (rows of rank 8, not a whole block) in F16 as the converter
    falls back; PEFT runs the same rounded weights."""
    hf, config = tiny_hf_model("llama")
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(_round_q8_0(p))
    peft = peft_model(hf, rank=8, alpha=ALPHA)
    q8 = GGMLQuantizationType.Q8_0
    write_gguf(tmp_path / "base.gguf", config, hf.state_dict(), qtype=q8)
    write_gguf_lora(tmp_path / "lora.gguf", peft, config, ALPHA, qtype=q8)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:
                p.copy_(_round_q8_0(p))
            elif "lora_B" in name:
                p.copy_(p.half().float())
    if native.available():  # without an adapter, decoding goes through the native step
        assert load_model(tmp_path / "base.gguf", CPU, "f32").model.decode_step is not None
    model = load_model(tmp_path / "base.gguf", CPU, "f32", [(tmp_path / "lora.gguf", 1.0)]).model
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoraLinear) and layer.base.ggml_type == q8  # still blocks
    got = cached_logits(model, IDS, chunks=(5, 3))
    torch.testing.assert_close(got, reference(peft), atol=TOLERANCE, rtol=0)


def test_two_adapters_add_up(family):
    """Two adapters on one model: the sum of their products (PEFT's two adapters active
    at once)."""
    _, hf, peft, folder = family
    both = copy.deepcopy(peft)
    both.add_adapter("other", both.peft_config["default"])
    with torch.no_grad():
        for name, p in both.named_parameters():
            if ".other." in name:
                p.copy_(dict(peft.named_parameters())[name.replace(".other.", ".default.")])
    both.base_model.set_adapter(["default", "other"])
    got = llmrun_logits(folder / "base", [(folder / "peft", 1.0), (folder / "lora.gguf", 1.0)])
    torch.testing.assert_close(got, reference(both.eval()), atol=TOLERANCE, rtol=0)


def test_rows_at_their_own_scales_match_the_base_and_peft(family):
    """serve's batches (lora.scaled): rows at scales 0, 1 and 0.5 in each forward (a
    prefill, then decode steps) match the base model, PEFT, and PEFT with half the alpha."""
    _, hf, peft, folder = family
    half = peft_model(hf, rank=8, alpha=ALPHA / 2)
    loaded = load_model(folder / "base.gguf", CPU, "f32", [(folder / "lora.gguf", 1.0)])
    rows = [(0.0,), (1.0,), (0.5,)]
    ids = IDS.repeat(len(rows), 1)
    cache = loaded.model.new_cache(len(rows), 64, torch.float32, "cpu")
    out, start = [], 0
    with torch.no_grad(), scaled(loaded.lora, rows, CPU):
        for n in [10] + [1] * (ids.shape[1] - 10):
            positions = torch.arange(start, start + n)[None].repeat(len(rows), 1)
            out.append(loaded.model(ids[:, start : start + n], positions, cache))
            start += n
    got = torch.cat(out, dim=1)
    for row, model in enumerate((hf, peft, half)):
        torch.testing.assert_close(got[row], reference(model)[0], atol=TOLERANCE, rtol=0)


def test_rows_flattened_batch_major_keep_their_scales():
    """A layer called on [batch * T, in] (Qwen2-MoE's shared expert flattens its input)
    scales each row's positions by that row's scale."""
    torch.manual_seed(0)
    weight = LoraWeight(torch.randn(4, 16), torch.randn(8, 4), 2.0)
    lora = LoraScales([Adapter(Path("adapter.gguf"), 1.0, {"layer": weight})])
    layer = LoraLinear(torch.nn.Linear(16, 8), lora)
    layer.add(weight, 0)
    x = torch.randn(2, 3, 16)
    with torch.no_grad(), scaled(lora, [(0.5,), (3.0,)], CPU):
        batched, flat = layer(x), layer(x.reshape(6, 16)).reshape(2, 3, 8)
    with torch.no_grad():
        lora.scales = [0.5]
        first = layer(x[:1])
        lora.scales = [3.0]
        second = layer(x[1:])
    torch.testing.assert_close(batched, torch.cat([first, second]), atol=1e-5, rtol=0)
    torch.testing.assert_close(flat, batched, atol=1e-5, rtol=0)


def test_rows_scales_hold_on_their_own_thread():
    """A forward on another thread (serve's embeddings, beside its scheduler's batch)
    runs at the adapters' own scales."""
    weight = LoraWeight(torch.randn(4, 16), torch.randn(8, 4), 1.0)
    lora = LoraScales([Adapter(Path("adapter.gguf"), 1.0, {"layer": weight})])
    layer = LoraLinear(torch.nn.Linear(16, 8), lora)
    layer.add(weight, 0)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        expected = layer(x)
        with scaled(lora, [(0.0,), (2.0,)], CPU), ThreadPoolExecutor(1) as pool:
            elsewhere = pool.submit(layer, x).result()
    torch.testing.assert_close(elsewhere, expected, atol=0, rtol=0)


def test_run_prints_pefts_greedy_tokens(family):
    """`llmrun run BASE.gguf --lora ADAPTER`: the path a user gets on CPU (native kernels)
    picks PEFT's greedy tokens."""
    _, _, peft, folder = family
    prompt = "Once upon a time"
    ids = load_tokenizer(STORIES_HF).encode(prompt)
    with torch.no_grad():
        out = peft.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    expected = out[0, len(ids) :].tolist()
    result = llmrun(
        "run", str(folder / "base.gguf"), "--lora", str(folder / "lora.gguf"), prompt,
        "-n", "6", "--temperature", "0", "--json", "--logprobs", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_serve_completes_with_the_adapter(family, tmp_path):
    """`llmrun serve BASE --lora ADAPTER` (the batched scheduler's paged cache) answers
    with the text of PEFT's greedy tokens."""
    _, _, peft, folder = family
    tokenizer = load_tokenizer(STORIES_HF)
    ids = tokenizer.encode("Once upon a time")
    with torch.no_grad():
        out = peft.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    expected = tokenizer.decode(out[0].tolist())[len(tokenizer.decode(ids)) :]
    server = Server(tmp_path, str(folder / "base.gguf"), "--lora", str(folder / "lora.gguf"))
    try:
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    assert answer["choices"][0]["text"] == expected


def test_cli_refuses_a_model_file_as_adapter_in_one_line():
    model = str(STORIES_GGUF)
    result = llmrun("run", model, "--lora", model, "hi", "-n", "1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {model}: not a LoRA adapter (general.type is None, adapter.type None; "
        "expected 'adapter' and 'lora')"
    ]


def test_parse_spec():
    assert parse_spec("a:b/lora.gguf:0.5") == ("a:b/lora.gguf", 0.5)
    for bad in ("lora.gguf", "lora.gguf:x", ":1", "lora.gguf:nan"):
        with pytest.raises(UsageError, match="PATH:SCALE"):
            parse_spec(bad)


def _peft_folder(tmp_path, hf, **settings):
    peft_model(hf, **settings).save_pretrained(tmp_path / "peft")
    return tmp_path / "peft"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["embed_tokens"]), "LoRA on embeddings"),
        (dict(target_modules=["lm_head"]), "only the decoder layers' linear layers"),
    ],
)
def test_unsupported_peft_adapters_are_refused(tmp_path, settings, message):
    hf, _ = tiny_hf_model("llama")
    base = save_hf_dir(hf, tmp_path / "base")
    adapter = _peft_folder(tmp_path, hf, **settings)
    with pytest.raises(UnsupportedError, match=message):
        load_model(base, CPU, "f32", [(adapter, 1.0)])


def test_adapter_of_another_model_is_refused(family, tmp_path):
    config, hf, peft, folder = family
    other = "qwen2" if config["model_type"] == "llama" else "llama"
    with pytest.raises(UnsupportedError, match=f"a LoRA adapter for {other}, but the model is"):
        path = write_gguf_lora(tmp_path / "other.gguf", peft, config, ALPHA, arch=other)
        load_model(folder / "base.gguf", CPU, "f32", [(path, 1.0)])
    wider, _ = tiny_hf_model(config["model_type"], intermediate_size=128)
    adapter = _peft_folder(tmp_path, wider)
    with pytest.raises(ModelFormatError, match=r"mlp\.\w+_proj: the adapter's product is"):
        load_model(folder / "base", CPU, "f32", [(adapter, 1.0)])


def test_broken_adapters_are_refused(tmp_path):
    hf, config = tiny_hf_model("llama")
    base = write_gguf(tmp_path / "base.gguf", config, hf.state_dict())
    writer = gguf.GGUFWriter(str(tmp_path / "half.gguf"), "llama")  # a pair without its B
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.ones((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "folder").mkdir()
    cases = [
        (tmp_path / "half.gguf", "has a lora_a or a lora_b, not both"),
        (tmp_path / "missing", "no such file or directory"),
        (tmp_path / "folder", "no adapter_config.json"),
    ]
    for path, message in cases:
        with pytest.raises(LlmrunError, match=message):
            load_model(base, CPU, "f32", [(path, 1.0)])

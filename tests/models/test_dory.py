"""Dory (NVIDIA Nemotron Labs Dory 1.0, llmrun/models/dory.py) against transformers'
DoryForCausalLM, on one tiny random model: 6 layers (2 input, 2 recurrent run 3 times,
2 output), sliding-window layers (window 5) and global ones in each section, each kind
with its own RoPE base, 4 query heads over 2 KV heads, untied output matrix. The config
is passed as transformers saves it (each layer an attention block and an "mlp" block,
counts in blocks); folders as save_pretrained writes them (backbone., embeddings,
g_proj) and as the Hub stores them (each layer two blocks of layers.N.mixer, attn_alpha
and mlp_alpha), which transformers' from_pretrained reads as the same model.

nGPT's scales are drawn near their trained sizes (randomize()'s N(0, 0.2) shrunk for
sqk, s_gate and logit_scale): the logits span about ±5.

Tolerances: f32 logits 1e-4 max abs against transformers, whole, through the KV cache
(prefills in chunks, then one token at a time) and serve's paged blocks. With
recurrent_kv_cache_mode "last_loop" a cached forward depends on its chunks (earlier
loops attend to the last loop's cached keys): held to transformers' DynamicCache fed the
same chunks, through the KV cache and serve's paged blocks. `llmrun run` picks transformers' 8 greedy token ids from each folder.
"""

import copy
import json

import pytest
import torch
from family_checks import (
    cache_logits,
    check_paged,
    check_run_token_ids,
    check_served_as_alone,
    check_show,
    max_diff,
)
from helpers import BASE, CHUNKS, cached_logits, our_model, randomize, save_hf_dir
from safetensors.torch import load_file, save_file

from llmrun import api
from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import dory_config
from llmrun.models.paged import PagedKVCache
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.dory")

CPU = torch.device("cpu")
CONFIG = dict(
    BASE,
    model_type="dory",
    num_hidden_layers=6,
    head_dim=16,
    n_input_layers=2,
    n_output_layers=2,
    n_recurrent_loops=3,
    sliding_window=5,
    initializer_range=0.02,
    layer_types=[
        "sliding_attention", "full_attention", "full_attention",
        "sliding_attention", "sliding_attention", "full_attention",
    ],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
    },
)  # fmt: skip
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
SCALES = {"sqk": 0.07, "s_gate": 0.1, "logit_scale": 0.5}


def hf_model(**overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, SCALES)
    return model


def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


def hf_cached_logits(hf, ids: torch.Tensor, chunks=CHUNKS) -> torch.Tensor:
    """transformers' logits of ids [1, T] through its DynamicCache in `chunks` (by default
    cached_logits'), then one token at a time."""
    cache = transformers.DynamicCache(config=hf.config)
    sizes = list(chunks) + [1] * (ids.shape[1] - sum(chunks))
    out, start = [], 0
    with torch.no_grad():
        for n in sizes:
            out.append(hf(ids[:, start : start + n], cache=cache, use_cache=True).logits)
            start += n
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def hf():
    return hf_model()


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


def test_matches_transformers_whole_cached_and_paged(hf, expected, monkeypatch):
    assert 3 < expected.abs().max() < 10
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    check_paged(model, IDS, expected, windowed="dory", monkeypatch=monkeypatch)


def test_last_loop_cache_matches_transformers_chunk_by_chunk():
    """The loops share the last loop's KV entries: transformers' cached logits, which a
    whole forward's are not (the earlier loops then attend to their own keys)."""
    hf = hf_model(recurrent_kv_cache_mode="last_loop")
    expected = hf_cached_logits(hf, IDS)
    with torch.no_grad():
        whole = hf(IDS).logits
    assert max_diff(whole, expected) > 0.1
    model = ours(hf)
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), whole) < 1e-4
    # serve's paged blocks, in family_checks.cache_logits' chunks
    pool = PagedKVCache(model.new_cache(1, 1, "f32", "cpu"), 16, 16, 256)
    paged = cache_logits(model, IDS, lambda: pool.view([[9, 2, 14]]))
    assert max_diff(paged, hf_cached_logits(hf, IDS, (7, 20))) < 1e-4


VARIANTS = {
    "one loop": dict(n_recurrent_loops=1),
    "no window": dict(sliding_window=64),
    "one RoPE base": dict(
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0}
            for kind in ("sliding_attention", "full_attention")
        }
    ),
    "wider sections": dict(n_input_layers=1, n_output_layers=1),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_setting_moves_the_logits_and_is_followed(hf, expected, name):
    """Each setting moves transformers' logits by far more than the tolerance (on the
    same weights), and llmrun follows it: a model ignoring it would fail the test above."""
    changed = hf_model(**VARIANTS[name])
    changed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        moved = changed(IDS).logits
    assert max_diff(moved, expected) > 0.1
    assert max_diff(cached_logits(ours(changed), IDS), moved) < 1e-4


def hub_layout(folder, path):
    """`folder` (save_pretrained's) as the Hub stores Dory: each layer i as blocks
    layers.2i.mixer (attention) and layers.2i+1.mixer (MLP), lambda_1 and lambda_2 as
    their attn_alpha and mlp_alpha; returns `path`."""
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((folder / name).read_bytes())
    renamed = {}
    for key, tensor in load_file(folder / "model.safetensors").items():
        parts = key.split(".")
        if parts[1] == "layers":
            i, part = int(parts[2]), parts[3]
            block, name = {
                "self_attn": (2 * i, "mixer"),
                "mlp": (2 * i + 1, "mixer"),
                "lambda_1": (2 * i, "attn_alpha"),
                "lambda_2": (2 * i + 1, "mlp_alpha"),
            }[part]
            key = ".".join([*parts[:2], str(block), name, *parts[4:]])
        renamed[key] = tensor
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def folders(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("dory")
    saved = save_hf_dir(hf, root / "saved", tokenizer=True)
    return saved, hub_layout(saved, root / "hub")


def test_the_folders_run_and_show(hf, expected, folders):
    saved, hub = folders
    assert "backbone.embeddings.weight" in load_file(saved / "model.safetensors")
    from_hub = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    with torch.no_grad():
        assert max_diff(from_hub.eval()(IDS).logits, expected) == 0
    # Per KV entry (6 layers, then loops 2 and 3's 2 recurrent layers) 2 heads of 16,
    # keys and values, f32: the global ones (3 + 2 x 1) 8192 positions, the sliding
    # ones (3 + 2 x 1) their window of 5.
    kv_8k = 2 * 2 * 16 * 4 * (5 * 8192 + 5 * 5)
    for path in (saved, hub):
        loaded = load_model(path, CPU, "f32")
        assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
        check_run_token_ids(hf, path, tokens=8)
        check_show(path, "dory", kv_8k)


def test_a_bf16_folder_matches_transformers_on_its_rounded_weights(hf, tmp_path):
    """The Hub's weights are bf16: every matrix stays half (the native kernels' exact f32
    products) and the output head keeps its logit_scale (an nn.Linear would have lost it
    to the loader's QuantLinear swap)."""
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():  # not .to(): its RoPE buffers would round too
            p.copy_(p.bfloat16().float())
        expected = rounded(IDS).logits
    copy.deepcopy(rounded).to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_refuses_a_layer_list_that_does_not_alternate_mlp_blocks():
    config = hf_model().config.to_dict()
    config["layer_types"][1] = "sliding_attention"
    config["layer_types"][2] = "mlp"
    with pytest.raises(ModelFormatError, match="alternate"):
        dory_config.in_layers(config)
    config = json.loads(json.dumps(CONFIG))
    config["n_recurrent_layers"] = 3
    with pytest.raises(ModelFormatError, match="must equal"):
        dory_config.in_layers(config)


def test_serves_concurrent_requests_as_it_runs_them_alone(folders):
    engine = api.load(str(folders[0]), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)

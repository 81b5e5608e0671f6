"""Muse Glimmer's language model against transformers' MuseGlimmerForConditionalGeneration
(text alone): a tiny random model (tests/muse_glimmer_helpers.py: a sliding layer of
window 4 that rotates, then a global one that does not) from its Hugging Face folder, and
from the GGUFs llama.cpp's converter writes of that folder (conversion/muse_glimmer.py:
q/k rows permuted per head, the layer norms as 1 + w, qk_scale_factor folded into
synthesized q/k norm weights), F32, F16 and Q8_0. `llmrun run` replies as transformers
to the prompt its chat template (llama.cpp's muse-glimmer.jinja) renders.

What is special moves the logits by far more than the tolerance (planted bugs): the
weightless norm of the embeddings, RoPE on the global layer, the GGUF's layer norms left
as 1 + w.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole, through
the KV cache (prefills in chunks, then one token at a time) and serve's paged blocks; the
F32 GGUF 1e-5 from the folder; the F16 and Q8_0 GGUFs against transformers running their
rounded weights, 1e-4; tokens exact.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_show,
    check_whole_and_cached,
    dequantize_2d_weights,
    max_diff,
)
from gguf import GGMLQuantizationType
from helpers import needs_converter
from in_process import llmrun
from muse_glimmer_helpers import converted, folder_of, tiny_muse_glimmer

from llmrun.loading import muse_glimmer as muse_glimmer_gguf
from llmrun.loading.loader import load_model
from llmrun.models import muse_glimmer

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PROMPT = "Once upon a time"
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return tiny_muse_glimmer()


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_of(tmp_path_factory)


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(folder, CPU).model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


def test_the_folder_matches_transformers_whole_through_the_cache_and_paged(ours, expected):
    assert expected.abs().max() > 3  # logits that a wrong norm or turn would move
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)


@pytest.mark.parametrize("bug", ["embeddings not normed", "the global layer turned"])
def test_a_planted_bug_fails_the_comparison(folder, expected, monkeypatch, bug):
    if bug == "embeddings not normed":
        monkeypatch.setattr(
            muse_glimmer.Model, "embed", lambda self, ids: self.model.embed_tokens(ids)
        )
    else:
        monkeypatch.setattr(muse_glimmer.ModelArgs, "rotates", lambda self, layer: True)
    assert max_diff(logits(load_model(folder, CPU).model), expected) > 1e-2


@needs_converter
def test_the_converter_s_gguf_matches_transformers(tmp_path_factory, ours, expected, monkeypatch):
    """F32: the folder's logits (1e-5: qk_scale_factor rounded to f32 in the file) and
    the model's config as the file gives it, which fail with the layer norms left as the
    file stores them (1 + w); F16 and Q8_0: transformers on the weights rounded as the
    file holds them."""
    files = converted(tmp_path_factory)
    gguf = load_model(files["f32"], CPU).model
    assert gguf.args.layer_types == ["sliding_attention", "full_attention"]
    assert gguf.args.layer_rope_theta == [10000.0, 0]
    assert gguf.args.qk_scale_factor == pytest.approx(3.87)
    assert max_diff(logits(gguf), logits(ours)) < 1e-5
    check_whole_and_cached(gguf, IDS, expected)
    monkeypatch.setattr(muse_glimmer_gguf, "_SHIFTED", "no such name")  # norms left 1 + w
    assert max_diff(logits(load_model(files["f32"], CPU).model), expected) > 1e-2
    monkeypatch.undo()
    for qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0):
        rounded = tiny_muse_glimmer()
        dequantize_2d_weights(rounded.model.language_model, qtype)
        dequantize_2d_weights(rounded.lm_head, qtype)
        with torch.no_grad():
            reference = rounded(IDS).logits
        assert max_diff(reference, expected) > 1e-5  # the rounding shows
        path = files[qtype.name.lower()]
        assert max_diff(logits(load_model(path, CPU).model), reference) < 1e-4


def test_run_replies_as_transformers_and_show_names_it(hf, folder):
    """`llmrun run FOLDER PROMPT -n 8 --temperature 0` picks transformers' greedy tokens
    after the prompt as the chat template renders it (llama.cpp's muse-glimmer.jinja)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=8, do_sample=False)
    args = [str(folder), PROMPT, "-n", "8", "--temperature", "0", "--json", "--logprobs", "0"]
    result = llmrun("run", *args)
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == out[
        0, ids.shape[1] :
    ].tolist()
    # One sliding layer keeping 4 positions, one global: 2 x 2 KV heads x 16 x 4 bytes each.
    check_show(folder, "muse_glimmer", 256 * (4 + 8192))

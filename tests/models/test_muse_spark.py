"""Muse Spark's language model against transformers' MuseSparkForConditionalGeneration
(text alone): a tiny random model (tests/muse_spark_helpers.py: two sliding layers that
rotate, then a global one that does not; a dense feed-forward, then two of experts) from
its Hugging Face folder. `llmrun run` replies as transformers to the prompt its chat
template (Muse Glimmer's) renders. llama.cpp has no converter for it: folders only.

What Muse Spark adds to Muse Glimmer moves the logits by far more than the tolerance
(planted bugs): the per-head norm of the attention output, the residual gates, the
router's output_multiplier and selection bias, the experts' shared output norm.

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers, whole, through
the KV cache (prefills in chunks, then one token at a time) and serve's paged blocks;
tokens exact.
"""

import json

import pytest
import torch
from family_checks import check_paged, check_show, check_whole_and_cached, max_diff
from in_process import llmrun
from muse_spark_helpers import folder_of, tiny_muse_spark

from llmrun.loading.loader import load_model
from llmrun.models import muse_spark

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PROMPT = "Once upon a time"
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return tiny_muse_spark()


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_of(tmp_path_factory)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


def test_the_folder_matches_transformers_whole_through_the_cache_and_paged(folder, expected):
    ours = load_model(folder, CPU).model
    assert ours.args.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert expected.abs().max() > 3  # logits that a wrong norm, gate or route would move
    check_whole_and_cached(ours, IDS, expected)
    check_paged(ours, IDS, expected)


BUGS = {
    "head outputs not normed": (muse_spark.Attention, "heads_out", lambda self, out: out),
    "residual gates as plain sums": (muse_spark.ResidualGate, "forward", lambda s, r, x: r + x),
    "router logits not scaled": (muse_spark.Router, "__init__", None),
    "selection bias ignored": (muse_spark.Router, "forward", None),
    "experts' norm skipped": (muse_spark.Experts, "__getitem__", None),
}


@pytest.mark.parametrize("bug", BUGS)
def test_a_planted_bug_fails_the_comparison(folder, expected, monkeypatch, bug):
    owner, name, replacement = BUGS[bug]
    original = getattr(owner, name)
    if bug == "router logits not scaled":

        def replacement(self, args):
            original(self, args)
            self.multiplier = 1.0

    elif bug == "selection bias ignored":

        def replacement(self, x):
            with torch.no_grad():
                self.e_score_correction_bias.zero_()
            return original(self, x)

    elif bug == "experts' norm skipped":

        def replacement(self, e):
            return self._modules[str(e)]

    monkeypatch.setattr(owner, name, replacement)
    assert max_diff(logits(load_model(folder, CPU).model), expected) > 1e-2


def test_run_replies_as_transformers_and_show_names_it(hf, folder):
    """`llmrun run FOLDER PROMPT -n 8 --temperature 0` picks transformers' greedy tokens
    after the prompt as the chat template renders it."""
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
    # Two sliding layers keeping 4 positions, one global: 2 x 2 KV heads x 16 x 4 bytes each.
    check_show(folder, "muse_spark", 256 * (4 + 4 + 8192), moe=True)

"""Gemma 4 Unified's language model (Gemma 4's, without per-layer inputs or experts)
against transformers: a tiny random Gemma4UnifiedForConditionalGeneration
(gemma4_unified_helpers: a sliding layer of window 8, then a global one with heads of its
own width) from its Hugging Face folder and as the converter's gemma4 text GGUF. The
logits of 40 tokens whole, through a KV cache (its sliding layer a ring of 8) and from
serve's paged blocks match; `run` (Gemma 4's chat template) picks transformers' greedy
tokens from either; `show` names it; serve decodes concurrent requests as each alone.

Tolerance: f32 logits 1e-4 max abs (measured ~3e-7).
"""

import json

import pytest
import torch
from family_checks import PROMPT, check_paged, check_served_as_alone, max_diff
from gemma4_unified_helpers import processor_inputs, save_gemma4_unified_dir, tiny_gemma4_unified
from gemma4_vision_helpers import write_text_gguf
from helpers import cached_logits, needs_templates
from in_process import llmrun

from llmrun import api
from llmrun.loading.loader import load_model
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = needs_templates
CPU = torch.device("cpu")
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf():
    return tiny_gemma4_unified()


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        logits = hf(input_ids=IDS).logits
    assert logits.abs().max() > 3
    return logits


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_gemma4_unified_dir(hf, tmp_path_factory.mktemp("gemma4-unified"))


@pytest.fixture(scope="module")
def text_gguf(hf, tmp_path_factory):
    return write_text_gguf(hf, tmp_path_factory.mktemp("gemma4-unified-gguf") / "m.gguf")


def test_the_folder_matches_transformers_whole_cached_and_paged(folder, expected):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gemma4_unified_text"
    model = loaded.model
    assert not model.args.has_per_layer_inputs and not model.args.enable_moe_block
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    check_paged(model, IDS, expected)


def test_the_converters_gguf_matches_transformers(text_gguf, expected):
    loaded = load_model(text_gguf, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gemma4_text"
    assert not loaded.model.args.has_per_layer_inputs
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_run_replies_as_transformers_and_show_names_it(hf, folder, text_gguf):
    """`llmrun run PATH PROMPT` (Gemma 4's chat template) picks the greedy tokens
    transformers picks after Gemma4UnifiedProcessor's ids, from the folder and the GGUF."""
    inputs = processor_inputs(folder, PROMPT)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected = out[0, inputs.input_ids.shape[1] :].tolist()
    for path, model_type in ((folder, "gemma4_unified"), (text_gguf, "gemma4")):
        args = ("-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
        result = llmrun("run", str(path), PROMPT, *args)
        assert result.returncode == 0, result.stderr
        assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
        shown = llmrun("show", str(path))
        assert shown.returncode == 0, shown.stderr
        assert model_type in shown.stdout


def test_serves_concurrent_requests_as_it_runs_them_alone(text_gguf):
    engine = api.load(str(text_gguf), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 16, parallel=3)

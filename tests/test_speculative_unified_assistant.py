"""Speculative decoding with Gemma 4 Unified's assistant drafter (transformers'
Gemma4UnifiedAssistantForCausalLM, model_type gemma4_unified_assistant: Gemma 4's
assistant under other names; llmrun.speculative.Assistant) for a tiny random Gemma 4
Unified folder (gemma4_unified_helpers: Gemma4UnifiedForConditionalGeneration, a sliding
layer of window 8, then a global one) as a user sees it: greedy output is plain greedy
decoding's token for token, and every round's drafts are those transformers' assistant
makes from transformers' target state for that round's sequence (its sliding keys through
the ring after it wrapped); `run --draft` takes the assistant's folder, and the GGUF
llama.cpp's converter writes of it (arch gemma4-assistant, centroids dropped), whose
drafts are then transformers' with use_ordered_embeddings off.

The assistant: 2 layers (local, global) of width 32 with the target's head shapes, ordered
embeddings of 6 clusters of 87 tokens (top 2 scored) over a random token order, layer
scalars 0.7. Its drafts are never accepted (it is not trained on the target). Tolerance:
tokens exact."""

import json
import shutil

import llama_converter
import pytest
import torch
from gemma4_assistant_helpers import hf_drafts
from gemma4_unified_helpers import WINDOW, F, S, save_gemma4_unified_dir, tiny_gemma4_unified
from gemma4_vision_helpers import VOCAB
from helpers import needs_converter, needs_templates, randomize
from in_process import llmrun

from llmrun.generate import KVState, stream_generate
from llmrun.loading import gemma4_assistant
from llmrun.loading.loader import load_model
from llmrun.sampling import Sampler, SamplingParams
from llmrun.speculative import Assistant
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = needs_templates
PROMPT = "Once upon a time"
DRAFTS = 3


def tiny_unified_assistant(target):
    """A random Gemma4UnifiedAssistantForCausalLM for `target`, as the module's note says."""
    config = transformers.Gemma4UnifiedAssistantConfig(
        text_config=dict(
            model_type="gemma4_unified_text",
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            global_head_dim=32,
            layer_types=[S, F],
            sliding_window=WINDOW,
            vocab_size=VOCAB,
            max_position_embeddings=512,
            rope_parameters=target.config.text_config.rope_parameters,
        ),
        backbone_hidden_size=64,
        use_ordered_embeddings=True,
        num_centroids=6,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(1)
    assistant = transformers.Gemma4UnifiedAssistantForCausalLM(config).eval()
    randomize(assistant, {"q_norm.weight": 0.5})
    with torch.no_grad():
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
        for layer in assistant.model.layers:
            layer.layer_scalar.fill_(0.7)
    return assistant


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' target and assistant and their folders."""
    hf_target = tiny_gemma4_unified()
    hf_assistant = tiny_unified_assistant(hf_target)
    root = tmp_path_factory.mktemp("unified-pair")
    target_dir = save_gemma4_unified_dir(hf_target, root / "target")
    assistant_dir = root / "assistant"
    hf_assistant.save_pretrained(assistant_dir)
    return hf_target, hf_assistant, target_dir, assistant_dir


def drafted_rounds(target_dir, assistant) -> tuple[list[int], list[int], list]:
    """Greedy tokens of the folder's model after PROMPT plainly and with `assistant`
    drafting, and each round's (sequence, drafts)."""
    target = load_model(target_dir, torch.device("cpu"), "f32").model
    tokenizer = load_tokenizer(target_dir)
    speculator = Assistant(assistant, DRAFTS)
    rounds, propose = [], speculator.propose

    def recorded(sequence, *args):
        drafts = propose(sequence, *args)
        rounds.append((list(sequence), drafts[0]))
        return drafts

    speculator.propose = recorded
    outputs, prompt, greedy = [], tokenizer.encode(PROMPT), Sampler(SamplingParams(temperature=0))
    for drafter in (None, speculator):
        state = KVState(target.new_cache(1, 64, torch.float32, "cpu"))
        responses = stream_generate(
            target, tokenizer, state, prompt, greedy, 24, [2], (), None, None, drafter
        )
        outputs.append([r.token for r in responses if r.token is not None])
    return *outputs, rounds


def test_drafts_are_transformers_assistants_and_greedy_is_plain(pair):
    hf_target, hf_assistant, target_dir, assistant_dir = pair
    assert gemma4_assistant.is_assistant(assistant_dir)
    assistant = gemma4_assistant.load(assistant_dir, torch.device("cpu"), torch.float32)
    plain, tokens, rounds = drafted_rounds(target_dir, assistant)
    assert tokens == plain and len(tokens) == 24
    assert len(rounds[-1][0]) > 2 * WINDOW  # the sliding ring wrapped
    for sequence, drafts in rounds:
        assert drafts == hf_drafts(hf_target, hf_assistant, sequence, DRAFTS, WINDOW)


def test_run_drafts_with_the_folder(pair):
    _, _, target_dir, assistant_dir = pair
    args = ("run", str(target_dir), PROMPT, "-n", "12", "--temperature", "0")
    plain = llmrun(*args)
    drafted = llmrun(*args, "-v", "--draft", str(assistant_dir), "--draft-max", "2")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and "| draft: 0/" in drafted.stderr


@needs_converter
def test_the_converters_gguf_drafts_as_transformers_without_centroids(pair, tmp_path):
    hf_target, hf_assistant, target_dir, assistant_dir = pair
    folder = tmp_path / "assistant"
    shutil.copytree(assistant_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the converter writes a vocab
        shutil.copy(target_dir / name, folder / name)
    # The converter reads moe_intermediate_size, which transformers 5.25 does not save for
    # a Gemma 4 Unified text config (as benchmarks/llama_cpp_gemma4_unified.py notes).
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = None
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "assistant.gguf"
    llama_converter.convert([[folder, "--outtype", "f32", "--outfile", out]])
    assert gemma4_assistant.is_assistant(out)
    assistant = gemma4_assistant.load(out, torch.device("cpu"), torch.float32)
    assert assistant.masked_embedding is None
    plain, tokens, rounds = drafted_rounds(target_dir, assistant)
    assert tokens == plain
    hf_assistant.config.use_ordered_embeddings = False
    try:
        for sequence, drafts in rounds:
            assert drafts == hf_drafts(hf_target, hf_assistant, sequence, DRAFTS, WINDOW)
    finally:
        hf_assistant.config.use_ordered_embeddings = True

"""Gemma 4's assistant drafter (llmrun.models.gemma4_assistant, loaded from its folder by
llmrun.loading.gemma4_assistant) against transformers' Gemma4AssistantForCausalLM, given
the same target hidden state, token embedding and target keys and values (a 9-token
prompt, longer than the window of 5): its logits through the ordered embeddings (the
tokens of the top 2 of 8 clusters scored, the rest the lowest score minus 1) and through
the whole lm_head, and the hidden state it passes to the next draft; the same from a GGUF
written as llama.cpp's converter writes one (conversion/gemma.py Gemma4AssistantModel:
arch gemma4-assistant, Gemma 4's keys and names, embedding_length_out, nextn.pre_projection
and nextn.post_projection, rope_freqs, the centroids dropped, so the whole head scores).
A folder or target that does not fit is refused in one line.

Tolerance: 1e-4 max abs (logits within about ±4; measured 1e-6)."""

import json

import pytest
import torch
from gemma4_assistant_helpers import TARGET, WINDOW, F, S, converted, hf_pair, target_state
from helpers import our_model
from safetensors.torch import load_file, save_file

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import gemma4_assistant
from llmrun.models import gemma4

PROMPT = torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(2)).tolist()
NEXT = 7  # the token the assistant drafts after


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, assistant = hf_pair()
    folder = tmp_path_factory.mktemp("assistant")
    assistant.save_pretrained(folder)
    ours = gemma4_assistant.load(folder, torch.device("cpu"), torch.float32)
    return target, assistant, ours, folder


def test_logits_and_next_hidden_match_transformers(pair):
    target, assistant, ours, _ = pair
    hidden, kv = target_state(target, PROMPT)
    with torch.no_grad():
        embedded = target.get_input_embeddings()(torch.tensor([[NEXT]]))
        inputs = torch.cat([embedded, hidden[:, -1:]], -1)
        position = torch.tensor([[len(PROMPT)]])
        # Its sliding layers see the last WINDOW + 1 keys of the 9 (the mask's, flipped).
        seen = {**kv, S: tuple(t[:, :, -WINDOW - 1 :] for t in kv[S])}
        for ordered in (True, False):
            assistant.config.use_ordered_embeddings = ordered
            expected = assistant(inputs_embeds=inputs, position_ids=position, shared_kv_states=kv)
            embedder = ours.masked_embedding
            if not ordered:
                ours.masked_embedding = None
            logits, next_hidden = ours(inputs, position, seen)
            ours.masked_embedding = embedder
            assert (logits - expected.logits).abs().max() < 1e-4
            assert (next_hidden - expected.last_hidden_state).abs().max() < 1e-4
            masked = logits[0, 0] == logits[0, 0].min()
            assert masked.sum() == (512 - 2 * 64 if ordered else 1)
    assistant.config.use_ordered_embeddings = True


def test_a_gguf_as_the_converter_writes_it(pair, tmp_path):
    target, assistant, _, _ = pair
    path = converted(assistant, tmp_path / "assistant.gguf")
    assert gemma4_assistant.is_assistant(path)
    ours = gemma4_assistant.load(path, torch.device("cpu"), torch.float32)
    assert ours.masked_embedding is None
    hidden, kv = target_state(target, PROMPT)
    with torch.no_grad():
        embedded = target.get_input_embeddings()(torch.tensor([[NEXT]]))
        inputs = torch.cat([embedded, hidden[:, -1:]], -1)
        position = torch.tensor([[len(PROMPT)]])
        assistant.config.use_ordered_embeddings = False
        expected = assistant(inputs_embeds=inputs, position_ids=position, shared_kv_states=kv)
        assistant.config.use_ordered_embeddings = True
        seen = {**kv, S: tuple(t[:, :, -WINDOW - 1 :] for t in kv[S])}
        logits, next_hidden = ours(inputs, position, seen)
    assert (logits - expected.logits).abs().max() < 1e-4
    assert (next_hidden - expected.last_hidden_state).abs().max() < 1e-4


def test_a_folder_or_target_that_does_not_fit_is_refused(pair, tmp_path):
    target, _, ours, folder = pair
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    del weights["pre_projection.weight"]
    save_file(weights, broken / "model.safetensors")
    assert gemma4_assistant.is_assistant(broken)
    with pytest.raises(ModelFormatError, match="missing tensors: pre_projection.weight"):
        gemma4_assistant.load(broken, torch.device("cpu"), torch.float32)
    config = json.loads((folder / "config.json").read_text())
    config["num_centroids"] = 7
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="7 centroids"):
        gemma4_assistant.load(broken, torch.device("cpu"), torch.float32)

    gemma4_assistant.check_pair(ours, our_model(target.config.to_dict(), target.state_dict()), "a")
    for change, problem in (
        ({"hidden_size": 32}, "a width of 64, the model's is 32"),
        ({"global_head_dim": 16}, "full_attention heads of 32 read the model's 2 of 16"),
        ({"layer_types": [F, F, F]}, "the model has no sliding_attention layer"),
    ):
        other = gemma4.Model(gemma4.ModelArgs.from_config({**TARGET, **change}))
        with pytest.raises(UsageError, match=problem):
            gemma4_assistant.check_pair(ours, other, "a")

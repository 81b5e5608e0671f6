"""T5Gemma text-to-text folders (llmrun.models.t5gemma, llmrun.text_to_text) against
transformers: a tiny random -it folder of the 9b-2b kind (tests/t5_helpers.py: an encoder
wider than the decoder, grouped keys and values, sliding windows of 4, soft-capping) gives
transformers' encoder output and decoder logits (prefilled, then a token a step through the
KV cache), and greedy decoding gives transformers' generate ids. The encoder's sliding
window without its edge (the planted bug: transformers' bidirectional window includes it)
fails. `run` and `chat` build the encoder's input with the chat template as transformers'
apply_chat_template does, each chat turn encoding the whole conversation, and print
generate's text; `show` names the family.

Tolerances: encoder output and logits 1e-4; ids and text exact.
"""

import pytest
import torch
from in_process import llmrun
from t5_helpers import PROMPT, t5gemma_folder

from llmrun import api
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, transformers' model and tokenizer, llmrun's engine)."""
    folder = t5gemma_folder(tmp_path_factory.mktemp("t5gemma"))
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return folder, ref, tokenizer, api.load(str(folder), text_to_text=True)


def _logits(model, encoded, decoder_ids):
    """llmrun's decoder logits of decoder_ids [1, T]: 5 prefilled, then one a step."""
    decoding = model.decoding(encoded)
    cache = model.new_cache(1, 32, torch.float32, torch.device("cpu"))
    steps = [decoding(decoder_ids[:, :5], torch.arange(5)[None], cache)]
    for i in range(5, decoder_ids.shape[1]):
        steps.append(decoding(decoder_ids[:, i : i + 1], torch.tensor([[i]]), cache))
    return torch.cat(steps, dim=1)


def test_encoder_and_decoder_match_transformers(model, monkeypatch):
    _, ref, _, engine = model
    prompt = torch.tensor([engine.tokenizer.encode(PROMPT)])
    decoder_ids = torch.tensor([[1, *range(20, 44)]])  # 25 positions, past the window too
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        encoded = engine.model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = _logits(engine.model, encoded, decoder_ids)
        assert (logits - expected.logits).abs().max() < 1e-4
        monkeypatch.setattr(engine.model.args.encoder, "sliding_window", 3)
        wrong = engine.model.encode(prompt)
        assert (wrong - expected.encoder_last_hidden_state).abs().max() > 1e-2


def test_greedy_decoding_is_transformers_generate(model):
    _, ref, _, engine = model
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0]
    responses = list(engine.generate(ids, SamplingParams(temperature=0.0), 16))
    tokens = [r.token for r in responses if r.token is not None]
    assert tokens == expected[1:].tolist()  # generate's without its start token
    assert len(set(tokens)) >= 8
    assert responses[-1].stats.prompt_tokens == len(ids)


def _reply(ref, tokenizer, engine, messages: list[dict]) -> str:
    """transformers' greedy reply (8 tokens) to `messages` as the model card runs it, in
    llmrun's decoding (transformers' turns a character of two byte tokens into two U+FFFD)."""
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = ref.generate(**inputs, do_sample=False, max_new_tokens=8)
    return engine.tokenizer.decode(out[0, 1:].tolist())


def test_run_and_chat_encode_the_chat_template(model):
    folder, ref, tokenizer, engine = model
    first, second = "Tell me a story.", "And then?"
    expected = _reply(ref, tokenizer, engine, [{"role": "user", "content": first}])
    result = llmrun("run", folder, first, "-n", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected
    # Each turn encodes the conversation so far, the first reply as chat printed it.
    chat = llmrun("chat", folder, "-n", "8", "--temperature", "0", input=f"{first}\n{second}\n")
    assert chat.returncode == 0, chat.stderr
    reply, rest = chat.stdout.split("\n\n", 1)
    assert reply == expected
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": second},
    ]
    assert rest == _reply(ref, tokenizer, engine, history) + "\n\n"
    shown = llmrun("show", folder)
    assert shown.returncode == 0, shown.stderr
    assert "t5gemma (text-to-text (encoder-decoder): 2 encoder and 2 decoder layers)" in (
        shown.stdout
    )

"""serve with images for Llama 3.2 Vision, on a tiny random MllamaForConditionalGeneration
(mllama_helpers), whose image reaches the language model by cross-attention, kept per
sequence beside its KV blocks. A greedy chat completion with an image equals `llmrun run
--image`'s tokens (the engine's single-sequence loop) and transformers'; requests with
different images and a text-only one batched together (in prefill chunks shorter than the
text up to the image) each get their reply alone; an image prompt sent again, and a text-only
prompt after the same long text, reuse no block (the text before the image attends to it)
and reply alone.

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import check_batched_replies_are_alone_s, check_reply_is_run_s
from mllama_helpers import greedy_tokens, processor_inputs, save_mllama_dir, tiny_mllama
from serving import GREEDY, alone, chat_reply, image_prompt, served
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
WIDE, TALL = picture(100, 260, 3), picture(200, 90, 4)  # 1 x 3 tiles, 4 x 1
PREAMBLE = "Once upon a time there was a little girl who lived in a village near the forest."


@pytest.fixture(scope="module")
def model():
    return tiny_mllama()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_mllama_dir(model, tmp_path_factory.mktemp("mllama"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "mllama")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    expected = greedy_tokens(model, processor_inputs(folder, [open_image(WIDE)], messages))
    _, ids, _, _ = image_prompt(engine, WIDE, QUESTION)
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), expected, len(ids))


def test_images_batched_with_text_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    # The prompt up to <|image|> goes whole in one forward, past a chunk of 4 tokens.
    assert all(image_prompt(engine, *p)[2].spans()[0][1] > 4 for p in (wide, tall))
    check_batched_replies_are_alone_s(engine, wide, tall, prefill_budget=4)


def test_no_block_is_reused_across_an_image(client, engine):
    def cached(reply: dict) -> int:
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = chat_reply(client, PREAMBLE, TALL, QUESTION)
    again = chat_reply(client, PREAMBLE, TALL, QUESTION)
    assert cached(again) == 0 and again["choices"] == first["choices"]
    assert first["choices"][0]["message"]["content"] == alone(engine, PREAMBLE, TALL, QUESTION)[0]
    # The same text before the image fills blocks, but they attended to the image.
    text = f"{PREAMBLE} {QUESTION}"
    ids = engine.tokenizer.encode(engine.render([{"role": "user", "content": text}]))
    assert image_prompt(engine, PREAMBLE, TALL, QUESTION)[1][:BLOCK_SIZE] == ids[:BLOCK_SIZE]
    reply = chat_reply(client, text)
    assert cached(reply) == 0
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8))
    assert reply["choices"][0]["message"]["content"] == expected

"""serve with images for LLaVA-NeXT, on a tiny random LlavaNextForConditionalGeneration
(llava_helpers), whose images take a number of tokens by their size and shape (a base tile,
then the unpadded grid of its pinpoint's tiles, a newline a row). A greedy chat completion
with an image equals `llmrun run --image`'s tokens (the engine's single-sequence loop) and
transformers'; requests with images of other token counts batched together (in prefill
chunks that would split an image) each get their reply alone.

Tolerances: tokens and text exact.
"""

import pytest
from llava_helpers import greedy_tokens, processor_inputs, save_llava_dir, tiny_llava
from serving import GREEDY, alone, chat_reply, image_prompt, scheduled
from starlette.testclient import TestClient
from vision_helpers import picture

from llmrun import api
from llmrun.batching import Request, Scheduler
from llmrun.images import open_image
from llmrun.server import Service, create_app

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# 50x90: in a 32x64 pinpoint, 16 + 4 rows of 8 + a newline (52 tokens); 100x40: in a 64x32
# one, 16 + 8 rows of 4 + a newline (56).
WIDE, TALL = picture(50, 90, 1), picture(100, 40, 2)


@pytest.fixture(scope="module")
def model():
    return tiny_llava(next_=True)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_llava_dir(model, tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    service = Service("llava", set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, WIDE, QUESTION)
    text, tokens = alone(engine, WIDE, QUESTION)
    reference = processor_inputs(folder, [open_image(WIDE)], QUESTION)
    expected = greedy_tokens(model, reference)
    assert tokens == expected[: len(tokens)] and len(tokens) >= 4  # run stops at EOS
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == reference["input_ids"].shape[1]
    assert reply["usage"]["completion_tokens"] == len(tokens)


def test_images_of_other_token_counts_batched_together_each_get_their_own_reply(engine):
    wide, tall = ("Look here", WIDE, "What is it?"), ("Look here", TALL, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (wide, tall)]
    # Chunks of 16 tokens would end inside each image.
    assert [b - a for ((a, b),) in spans] == [52, 56]
    assert all(a < 16 < b for ((a, b),) in spans)
    text_only = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hi"}]))
    requests = []
    for parts in (wide, tall):
        _, ids, prompt_images, digests = image_prompt(engine, *parts)
        requests.append(Request(ids, GREEDY, 8, images=prompt_images, image_digests=digests))
    requests.append(Request(text_only, GREEDY, 8))
    got = scheduled(Scheduler(engine, parallel=3, prefill_budget=16), requests)
    assert got[0] == alone(engine, *wide)
    assert got[1] == alone(engine, *tall)
    assert got[0] != got[1]
    assert got[2][0] == "".join(r.text for r in engine.generate(text_only, GREEDY, 8))

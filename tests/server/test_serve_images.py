"""serve with images, on a tiny random Gemma 3 with its vision tower (vision_helpers):
OpenAI's image_url content parts (base64 data: URLs) on /v1/chat/completions and the
Responses API's input_image parts. A greedy reply equals `llmrun run --image`'s (the
engine's single-sequence loop) and transformers' Gemma3ForConditionalGeneration's tokens,
for one image and for images across messages (one sent twice, encoded once);
requests with different images batched together (in prefill chunks that would split an
image, and preempted) each get their reply alone; the prefix cache reuses an image's
blocks for the same image only, also where the reused prefix ends inside the image;
URLs that are not base64 data:, undecodable or oversized images, and a model without
an image encoder are 400s; `llmrun serve GGUF --mmproj FILE` takes images (the checks
shared with the other families: image_serving's).

Tolerances: tokens and text exact.
"""

import pytest
from image_serving import (
    Reused,
    check_batched_replies_are_alone_s,
    check_prefix_cache_reuses_an_image_only_for_the_same_image,
    check_reply_is_run_s,
    served_process_reply,
)
from serving import (
    GREEDY,
    alone,
    chat_reply,
    data_url,
    image_content,
    image_prompt,
    image_request,
    scheduled,
    served,
)
from starlette.testclient import TestClient
from vision_helpers import (
    greedy_tokens,
    picture,
    processor_inputs,
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
    write_mmproj,
    write_text_gguf,
)

from llmrun import api
from llmrun.batching import Scheduler
from llmrun.images import open_image
from llmrun.kv_blocks import BLOCK_SIZE
from llmrun.models.paged import PagedKVCache
from llmrun.server import Service, create_app, images

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
RED, BLUE = picture(48, 80, 1), picture(100, 60, 2)  # PNG bytes


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma3_vl_dir(model, tmp_path_factory.mktemp("gemma3-vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "gemma3")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(RED), "detail": "low"}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    reply = client.post("/v1/chat/completions", json=body).json()
    reference = processor_inputs(folder, [open_image(RED)], QUESTION)
    expected = greedy_tokens(model, reference, 8)
    prompt_tokens = reference.input_ids.shape[1]
    check_reply_is_run_s(reply, engine, (RED, QUESTION), expected, prompt_tokens, whole=True)


def test_images_across_messages_are_transformers_and_each_encoded_once(
    client, engine, model, folder, monkeypatch
):
    green, gray = picture(64, 64, 4), picture(30, 90, 5, "L")  # not encoded before
    turns = [
        ("user", [green, "What is this?"]),
        ("assistant", ["A picture."]),
        ("user", ["And these two?", gray, green]),
    ]
    encoded = []

    encode_images = api.Engine.encode_images

    def encode(self, pictures):
        encoded.extend(pictures)
        return encode_images(self, pictures)

    monkeypatch.setattr(api.Engine, "encode_images", encode)
    messages = [
        {"role": role, "content": image_content(*parts) if role == "user" else parts[0]}
        for role, parts in turns
    ]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert len(encoded) == 2  # green once, though sent twice
    template_messages = [
        {
            "role": role,
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in parts
            ],
        }
        for role, parts in turns
    ]
    pictures = [open_image(p) for p in (green, gray, green)]
    ids, prompt_images = engine.image_prompt(engine.render(template_messages), pictures)
    responses = list(engine.generate(ids, GREEDY, 8, images=prompt_images))
    reference = processor_inputs(folder, pictures, template_messages)
    assert [r.token for r in responses if r.token is not None] == greedy_tokens(model, reference, 8)
    assert reply["choices"][0]["message"]["content"] == "".join(r.text for r in responses)
    assert reply["usage"]["prompt_tokens"] == len(ids) == reference.input_ids.shape[1]


def test_responses_take_input_image_parts(client):
    item = {
        "role": "user",
        "content": [
            {"type": "input_image", "image_url": data_url(BLUE), "detail": "auto"},
            {"type": "input_text", "text": QUESTION},
        ],
    }
    body = {"input": [item], "max_output_tokens": 8, "temperature": 0}
    response = client.post("/v1/responses", json=body).json()
    text = response["output"][0]["content"][0]["text"]
    assert text == chat_reply(client, BLUE, QUESTION)["choices"][0]["message"]["content"]


def test_different_images_batched_together_each_get_their_own_reply(engine):
    # "Look here" puts the image at prompt positions 14..18: chunks of 8 tokens would
    # end inside it at 16.
    red = ("Look here", RED, "What is it?")
    blue = ("Look here", BLUE, "What is it?")
    assert image_prompt(engine, *red)[2].starts == [14]
    check_batched_replies_are_alone_s(engine, red, blue, prefill_budget=8)


def test_preempted_requests_are_prefilled_again_with_their_images(engine):
    parts = [("Look here", RED, "What is it?"), (BLUE, QUESTION), (RED, "Tell me more.")]
    like = engine.new_cache(1, 1)
    block = PagedKVCache.block_bytes(like, BLOCK_SIZE, [5])  # the global layer's
    probe = Scheduler(engine, parallel=3, kv_memory=10**9)
    # 8 blocks of the global layer (128 positions) for three sequences that grow to ~80
    # each, besides the sliding-window layers' pool.
    memory = 10**9 - (probe.blocks.n_blocks - 8) * block
    scheduler = Scheduler(engine, parallel=3, kv_memory=memory)
    assert scheduler.blocks.n_blocks == 8
    requests = [image_request(engine, *p, max_tokens=48, ignore_eos=True) for p in parts]
    got = scheduled(scheduler, requests)
    assert scheduler.preemptions > 0
    for p, result in zip(parts, got, strict=True):
        assert result == alone(engine, *p, max_tokens=48, ignore_eos=True)


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(client, engine):
    # The first block (0..15) ends inside the image (14..18): the rest of it is fed.
    reused = check_prefix_cache_reuses_an_image_only_for_the_same_image(
        client, engine, ("Look here", RED, "What is it?"), BLUE, "And what else is there?"
    )
    assert reused == Reused(again=32, other_question=BLOCK_SIZE, other_image=0)


def error(client, body, status=400) -> dict:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    return response.json()["error"]


def image_body(url: str, role: str = "user") -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": role, "content": [part, {"type": "text", "text": QUESTION}]}]
    if role == "assistant":
        messages.insert(0, {"role": "user", "content": "Hi"})
    return {"messages": messages, "max_tokens": 4}


BROKEN_PNG = RED[: len(RED) // 2]


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://example.com/cat.png", "fetches nothing, not 'https://example.com/cat.png'"),
        ("file:///etc/passwd", "fetches nothing"),
        ("cat.png", "base64 data: URLs"),
        ("data:image/png,%89PNG", "the data: URL is not base64"),
        ("data:image/png;base64,@@@@", "base64 does not decode"),
        ("data:image/png;base64,", "holds no image"),
        (data_url(b"GIF89a, but no more"), "not an image"),
        (data_url(BROKEN_PNG), "a broken or unreadable image"),
    ],
    ids=["https", "file", "path", "not-base64", "bad-base64", "empty", "not-image", "broken"],
)
def test_bad_image_urls_are_400(client, url, message):
    found = error(client, image_body(url))
    assert message in found["message"]
    assert found["param"] == "messages.0.content.0.image_url.url"


def test_images_go_in_user_messages(client):
    found = error(client, image_body(data_url(RED), role="assistant"))
    assert found["message"] == "messages.1.content.0.image_url.url: images go in user messages"


def test_oversized_images_are_400(client, monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 1000)
    assert "an image over" in error(client, image_body(data_url(RED)))["message"]
    monkeypatch.undo()
    monkeypatch.setattr("llmrun.images.MAX_PIXELS", 1000)  # a decompression bomb's size
    unseen = picture(40, 30, 3)  # (an image encoded before is not decoded again)
    assert "30x40 pixels is more than" in error(client, image_body(data_url(unseen)))["message"]


def test_a_body_is_large_for_its_images_only(client):
    """Images may pass the 4 MiB a text body is held to (bytes after a PNG's end are
    ignored by its decoder); text may not."""
    padded = RED + bytes(5 << 20)
    body = image_body(data_url(padded))
    body["max_tokens"] = 1
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    long_text = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    assert "besides its images" in error(client, long_text, 413)["message"]


def test_a_model_without_an_image_encoder_says_so(model, tmp_path):
    gguf = api.load(str(write_text_gguf(model, tmp_path / "gemma3.gguf")), device="cpu")
    plain = api.load(None, device="cpu", ctx_size=256)
    for engine, message in ((gguf, "--mmproj FILE"), (plain, "takes no images")):
        service = Service("m", set(), None, parallel=1, queue=1)
        service.start(engine)
        try:
            with TestClient(create_app(service)) as http:
                assert message in error(http, image_body(data_url(RED)))["message"]
        finally:
            service.close()


def test_serve_takes_a_gguf_s_mmproj(model, tmp_path):
    text = write_text_gguf(model, tmp_path / "gemma3.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    reply = served_process_reply(tmp_path, [str(text), "--mmproj", str(mmproj)], RED, QUESTION)
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    assert reply == alone(engine, RED, QUESTION)[0]

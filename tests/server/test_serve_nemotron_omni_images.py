"""serve with images for Nemotron 3 Nano Omni, on a tiny random NemotronH_Omni_Reasoning_V3
(nemotron_omni_helpers), whose images take a number of tokens by their size and whose
language model keeps a Mamba-2 state. A greedy chat completion with an image equals
`llmrun run --image`'s tokens (the engine's single-sequence loop) and transformers';
requests with images of other sizes batched together (in prefill chunks that would split
an image) each get their reply alone (image_serving's checks). A clip as an input_audio
part gets run's and transformers' reply too.

Tolerances: tokens and text exact.
"""

import base64

import pytest
from image_serving import check_batched_replies_are_alone_s, check_reply_is_run_s
from nemotron_omni_helpers import (
    greedy_tokens,
    processor_inputs,
    save_nemotron_omni_dir,
    tiny_nemotron_omni,
)
from serving import GREEDY, chat_reply, image_prompt, served
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api
from llmrun.audio import SAMPLE_RATE, open_audio
from llmrun.images import open_image

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is in this picture?"
# Grids of 8 x 10 patches (20 tokens), 4 x 6 (6 tokens), 2 x 30 (15 tokens).
LARGE, SMALL, STRIP = picture(56, 72, 1), picture(20, 30, 2), picture(24, 300, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_nemotron_omni()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_nemotron_omni_dir(model, tmp_path_factory.mktemp("nemotron_omni"))


@pytest.fixture(scope="module")
def engine(folder):
    # Both towers, as `llmrun serve FOLDER` loads them (llmrun.server.app._towers).
    return api.load(str(folder), device="cpu", vision=True, audio=True)


@pytest.fixture(scope="module")
def client(engine):
    yield from served(engine, "nemotron_omni")


def test_a_greedy_reply_to_an_image_is_run_s_and_transformers(client, engine, model, folder):
    reply = chat_reply(client, LARGE, QUESTION)
    reference = processor_inputs(folder, engine.vision, [open_image(LARGE)], QUESTION)
    expected = greedy_tokens(model, reference)
    # The prompt's tokens count the image's 20 and its <img> and </img>.
    prompt_tokens = reference["input_ids"].shape[1]
    check_reply_is_run_s(reply, engine, (LARGE, QUESTION), expected, prompt_tokens)


def test_images_of_other_sizes_batched_together_each_get_their_own_reply(engine):
    small, strip = (SMALL, "What is it?"), (STRIP, "What is it?")
    spans = [image_prompt(engine, *parts)[2].spans() for parts in (small, strip)]
    # Chunks of 8 tokens would end inside each image.
    assert all(a < 8 < b for ((a, b),) in spans), spans
    check_batched_replies_are_alone_s(engine, small, strip, prefill_budget=8)


def test_a_greedy_reply_to_a_clip_is_run_s_and_transformers(client, engine, model, folder):
    data = wav_bytes(chirp(0.8, SAMPLE_RATE, 7), SAMPLE_RATE)
    clip_part = {"data": base64.b64encode(data).decode(), "format": "wav"}
    part = {"type": "input_audio", "input_audio": clip_part}
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
        "max_tokens": 8,
        "temperature": 0,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    clip = open_audio(data)
    reference = processor_inputs(folder, engine.vision, [], QUESTION, [clip.samples])
    expected = greedy_tokens(model, reference)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # to its EOS
    ids, clips = engine.audio_prompt(engine.prompt_text(QUESTION, audio=1), [clip])
    assert ids == reference["input_ids"][0].tolist()
    replies = list(engine.generate(ids, GREEDY, 8, images=clips))
    assert [r.token for r in replies if r.token is not None] == expected
    assert response.json()["choices"][0]["message"]["content"] == "".join(r.text for r in replies)

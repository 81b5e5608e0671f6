"""Checks that every image family's test module makes against transformers, once: the
prompt's logits whole and prefilled in chunks, greedy tokens, a text-only prompt, and
`run --image`, `chat` and `serve` from the folder. Tolerances: logits 1e-4 (absolute),
tokens and text exact."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from exaone4_5_helpers import greedy_tokens
from image_serving import check_reply_is_run_s
from in_process import llmrun
from serving import chat_reply, served
from vision_helpers import picture

from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.sampling import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def logits(engine, ids: list[int], prompt_images) -> torch.Tensor:
    """llmrun's logits of the whole prompt with its images in one pass."""
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def image_features(model, reference) -> torch.Tensor:
    """transformers' features of the images of `reference` (pixel_values and
    image_grid_thw, Qwen2-VL's way), one row per merged token, the images one after the
    other."""
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    return torch.cat(out.pooler_output)


def check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits) -> None:
    """The prompt's logits whole and prefilled in chunks of 7 (generate's prefill, moved so
    that no image is split) are transformers'; so are 8 greedy tokens (not all one)."""
    ids, prompt_images = prompt
    with torch.no_grad():
        state = KVState(engine.model.new_cache(1, max(128, len(ids)), torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected_logits[-1], atol=1e-4, rtol=0)
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8 and len(set(expected)) > 1
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected


def check_text_only_prompt(model, engine, question: str) -> None:
    """The logits of a prompt without images are transformers'."""
    ids = engine.tokenizer.encode(engine.prompt_text(question))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def check_run_and_chat_with_an_image(
    model, folder: Path, tmp_path: Path, processor_inputs, question: str, name: str, size=(60, 90)
) -> None:
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` reply
    with transformers' greedy tokens (up to EOS, id 2); the folder's text alone runs with
    the note "a multimodal NAME; running its language model"."""
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    image = tmp_path / "photo.png"
    image.write_bytes(picture(*size, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], question))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = [str(folder), "--image", str(image), question, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    options = ("--image", str(image), "-n", "8", "--temperature", "0")
    chat = llmrun("chat", str(folder), *options, input=question)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == load_tokenizer(folder).decode(expected) + "\n\n"
    result = llmrun("run", str(folder), question, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert f"a multimodal {name}; running its language model" in result.stderr


def check_run_chat_and_serve_with_an_image(
    engine, folder: Path, image: Path, question: str, expected: list[int], name: str | None
) -> None:
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts
    give transformers' 8 greedy tokens `expected` for `image` and `question`; where `name`,
    the text alone runs the language model with the note "a multimodal NAME; running its
    language model"."""
    ids, _ = engine.image_prompt(
        engine.prompt_text(question, images=1), [open_image(image.read_bytes())]
    )
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, "--image", image, question, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", folder, *options, input=f"/image {image}\n{question}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    parts = (image.read_bytes(), question)
    for client in served(engine, "model"):
        check_reply_is_run_s(chat_reply(client, *parts), engine, parts, expected, len(ids))
    if name is not None:
        text = llmrun("run", folder, question, "-n", "2", "--temperature", "0")
        assert text.returncode == 0, text.stderr
        assert f"a multimodal {name}; running its language model" in text.stderr

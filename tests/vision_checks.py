"""Checks that every image family's test module makes against transformers, once: the
prompt's logits whole and prefilled in chunks (with M-RoPE, and turned by plain positions
failing), image features, greedy tokens (after images and of a text-only prompt after
them), a GGUF with its mmproj and what loading them refuses, and `run --image`, `chat` and
`serve` from the folder. The audio families' tests share the logits and tokens ones.
Tolerances: logits and features 1e-4 (absolute), tokens and text exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from exaone4_5_helpers import greedy_tokens
from image_serving import check_reply_is_run_s
from in_process import llmrun
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.models.mrope import MRopeImages
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


def check_prompt_logits(model, engine, prompt, reference, chunk: int, context: int):
    """The logits of the prompt with its images (or clips) whole and prefilled in chunks
    of `chunk` (generate's prefill, moved so that none is split) through a cache of
    `context` are transformers'; returns transformers' logits."""
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        state = KVState(engine.model.new_cache(1, context, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=chunk, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    return expected


def soft_rows(ids: list[int], prompt_images, token: int) -> torch.Tensor:
    """The embeddings at a prompt's `token` places (an image's own rows, not the text
    tokens inside its span), in order."""
    rows = [
        embeds[[ids[start + i] == token for i in range(len(embeds))]]
        for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True)
    ]
    return torch.cat(rows)


def greedy_ids(engine, ids: list[int], prompt_images, state=None) -> list[int]:
    """llmrun's 8 greedy tokens after the prompt `ids` with its images."""
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images, state=state)
    return [r.token for r in stream if r.token is not None]


def check_image_features_each(model, prompt, reference) -> None:
    """The features of each image of the prompt are transformers'."""
    with torch.no_grad():
        expected = model.model.get_image_features(
            reference.pixel_values, reference.image_grid_thw
        ).pooler_output
    for ours, theirs in zip(prompt[1].embeds, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def check_m_rope_logits(model, engine, prompt, reference) -> None:
    """The prompt's logits whole and prefilled in chunks of 7 are transformers'; with the
    image tokens turned by plain RoPE (their places in the prompt) instead, they are not."""
    ids, prompt_images = prompt
    length = len(ids)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7 (moved so that no image is split): the text
        # after the first image turns by the shift the KV cache keeps.
        state = KVState(engine.model.new_cache(1, 160, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
        soft = prompt_images.tokens(0, length, CPU)
        plain = MRopeImages(soft.embeds, soft.groups, torch.arange(length).expand(3, -1), 0)
        wrong = engine.model(torch.tensor([ids]), torch.arange(length)[None], images=plain)[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    assert (wrong - expected).abs().max() > 1e-2


def check_m_rope_greedy_then_text(
    model, engine, prompt, reference, made_processor, question: str, eos: int | None = None
) -> None:
    """8 greedy tokens decoded at positions shifted by the images; then, through the same
    KV cache, a text-only prompt turns by plain positions again. Where `eos`, transformers'
    text-only continuation is cut before it (generate() goes past it, llmrun stops)."""
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    state = engine.new_state(256)
    assert greedy_ids(engine, *prompt, state=state) == expected
    assert state.cache.rope_shifts
    text = made_processor.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer.encode(text)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    continuation = out[0, len(ids) :].tolist()
    if eos is not None and eos in continuation:
        continuation = continuation[: continuation.index(eos)]
    assert greedy_ids(engine, ids, None, state=state) == continuation
    assert not state.cache.rope_shifts


def check_engine_with_images(model, engine, images, reference, question: str) -> None:
    """`engine`'s prompt ids, image features, logits and 8 greedy tokens for `images` and
    `question` are transformers' (`reference`: the processor's inputs)."""
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(question, images=len(images)), images
    )
    assert ids == reference.input_ids[0].tolist()
    with torch.no_grad():
        expected = model(**reference).logits[0]
    features = image_features(model, reference)
    torch.testing.assert_close(torch.cat(prompt_images.embeds), features, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert greedy_ids(engine, ids, prompt_images) == greedy_tokens(model, reference)


def check_mmproj_refusals(text: Path, mmproj: Path, from_mmproj) -> None:
    """A text GGUF alone takes no images, and `from_mmproj` refuses the text GGUF and an
    mmproj whose projection does not fit the language model (64 features)."""
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def check_run_with_an_image(model, folder: Path, tmp_path: Path, processor_inputs, question: str):
    """`llmrun run FOLDER --image PATH "prompt"` prints transformers' 8 greedy tokens."""
    from PIL import Image

    path = tmp_path / "cat.png"
    path.write_bytes(picture(90, 120, seed=4))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], question))
    args = ("run", str(folder), "--image", str(path), question, "-n", "8", "--temperature", "0")
    result = llmrun(*args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected


def check_chat_with_an_image_in_every_turn(model, folder: Path, tmp_path: Path, processor_inputs):
    """`llmrun chat FOLDER --image PATH`: the image stays in the first message, each turn
    renders the conversation again, and each reply is transformers' greedy one over it."""
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    path = tmp_path / "cat.png"
    path.write_bytes(picture(90, 120, seed=4))
    tokenizer = load_tokenizer(folder)
    questions = ("What is in this picture?", "And then?")
    first = [{"type": "image"}, {"type": "text", "text": questions[0]}]
    messages, expected = [], ""
    for question in questions:
        messages.append({"role": "user", "content": first if not messages else question})
        inputs = processor_inputs(folder, [Image.open(path)], messages)
        reply = tokenizer.decode(greedy_tokens(model, inputs))
        messages.append({"role": "assistant", "content": reply})
        expected += reply + "\n\n"
    options = ("-n", "8", "--temperature", "0")
    result = llmrun("chat", folder, "--image", path, *options, input="\n".join(questions))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected


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

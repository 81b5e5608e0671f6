"""GIT with an image against transformers: a tiny random GitForCausalLM (a CLIP tower of
hidden 32 in 2 layers on 32-pixel images of 8-pixel patches, 17 tokens with the class
token; a BERT-style text decoder of hidden 64 in 2 layers; a 512-word WordPiece
vocabulary, [CLS] 2 and [SEP] 3) and CLIPImageProcessor's Pillow backend (the shorter side
to 32, bicubic, a centre crop) make the reference inputs, [CLS] and the question's ids
as GIT's model card builds them. The pixels, the image features, the logits over the
image's and the text's tokens (whole and prefilled in chunks) and 8 greedy tokens match;
`run --image` captions with no prompt and answers a question with generate()'s tokens;
`show` names it. Text positions counted from the image's first token, or the image's
tokens seen causally, move the logits.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from blip2_helpers import random_model
from exaone4_5_helpers import greedy_tokens
from in_process import llmrun
from rerank_helpers import write_wordpiece
from serving import chat_reply, served
from vision_checks import check_logits_chunks_and_greedy, logits
from vision_helpers import picture

from llmrun import api, git_images, vision_families
from llmrun.chat_template import plain_transcript
from llmrun.images import open_image
from llmrun.models.gemma3 import ImageTokens

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

QUESTION = "what is in the picture?"
CLS, SEP = 2, 3
SIZE, PATCH = 32, 8
TOKENS = (SIZE // PATCH) ** 2 + 1
PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": SIZE},
    "crop_size": {"height": SIZE, "width": SIZE},
    "do_center_crop": True,
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def tiny_git(seed: int = 0):
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=PATCH,
    )
    config = transformers.GitConfig(
        vision_config=vision,
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        bos_token_id=CLS,
        eos_token_id=SEP,
        pad_token_id=0,
    )
    return random_model(transformers.GitForCausalLM, config, seed)


def image_processor():
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.CLIPImageProcessorPil(**settings)


def reference_inputs(folder, images: list, question: str) -> dict:
    """GIT's model card's inputs: the processor's pixels, [CLS] and the question's ids
    without special tokens."""
    tokenizer = transformers.BertTokenizerFast(str(folder / "vocab.txt"))
    ids = [CLS, *tokenizer(question, add_special_tokens=False).input_ids]
    pixels = image_processor()(images=images, return_tensors="pt").pixel_values
    return {"input_ids": torch.tensor([ids]), "pixel_values": pixels}


@pytest.fixture(scope="module")
def model():
    return tiny_git()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("git")
    model.save_pretrained(folder)
    write_wordpiece(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return folder


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def image():
    return open_image(picture(50, 27, 1))


@pytest.fixture(scope="module")
def reference(folder, image):
    return reference_inputs(folder, [image], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, image):
    return engine.image_prompt(QUESTION, [image])


def image_features(model, pixels) -> torch.Tensor:
    with torch.no_grad():
        states = model.git.image_encoder(pixels).last_hidden_state
        return model.git.visual_projection(states)[0]


def test_the_pixels_features_logits_and_tokens_are_transformers(
    model, engine, image, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "GIT"
    ids, prompt_images = prompt
    assert ids[TOKENS:] == reference["input_ids"][0].tolist()
    assert prompt_images.starts == [0] and engine.image_tokens(image) == TOKENS
    pixels = git_images.pixel_values(engine.vision, image)
    torch.testing.assert_close(pixels[None], reference["pixel_values"], atol=1e-5, rtol=0)
    expected = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(prompt_images.embeds[0], expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert expected_logits.shape[0] == len(ids) and 2 < expected_logits.abs().max() < 50
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_positions_from_the_image_and_a_causal_image_differ(model, engine, prompt, reference):
    """Planted: text positions counted from the image's first token (transformers' own
    when a forward's cache holds the image, but not generate()'s), and the image's tokens
    seen causally, as text is."""
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
    engine.model.args.image_tokens = 0
    try:
        moved = logits(engine, ids, prompt_images)
    finally:
        engine.model.args.image_tokens = TOKENS
    assert (moved[TOKENS:] - expected[TOKENS:]).abs().max() > 1e-2
    causal = ImageTokens(prompt_images.embeds[0], prompt_images.tokens(0, len(ids), "cpu").groups)
    causal.unmask = lambda frames, window: frames
    with torch.no_grad():
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], images=causal)[0]
    assert (ours - expected).abs().max() > 1e-2


def test_run_captions_with_no_prompt_and_answers_a_question(model, folder, tmp_path):
    from PIL import Image

    path = tmp_path / "cat.png"
    path.write_bytes(picture(60, 90, seed=6))
    for question in ("", QUESTION):
        inputs = reference_inputs(folder, [Image.open(path)], question)
        expected = greedy_tokens(model, inputs)
        expected = expected[: expected.index(SEP)] if SEP in expected else expected
        assert len(expected) >= 4
        args = ("--image", str(path), *([question] if question else []))
        result = llmrun("run", str(folder), *args, "-n", "8", "--temperature", "0", "--json",
                        "--logprobs", "0")  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    # serve: no chat template, so the plain transcript after [CLS].
    transcript = plain_transcript([{"role": "user", "content": QUESTION}])
    expected = greedy_tokens(model, reference_inputs(folder, [Image.open(path)], transcript))
    expected = expected[: expected.index(SEP)] if SEP in expected else expected
    engine = api.load(str(folder), device="cpu", vision=True)
    for client in served(engine, "model"):
        reply = chat_reply(client, path.read_bytes(), QUESTION)
        stream = engine.tokenizer.stream()
        text = "".join(stream.add(t) for t in expected) + stream.flush()
        assert reply["choices"][0]["message"]["content"] == text
        assert reply["usage"]["completion_tokens"] == len(expected)
    text = llmrun("run", str(folder), QUESTION, "-n", "2")
    assert text.returncode != 0 and text.stderr.startswith("error: ")
    assert "reads an image before its text" in text.stderr and text.stderr.count("\n") == 1
    assert "architecture   git" in llmrun("show", str(folder)).stdout

"""InstructBLIP with an image against transformers: a tiny random
InstructBlipForConditionalGeneration (BLIP-2's ViT and Q-Former, the Q-Former also reading
the prompt in its own WordPiece vocabulary; Llama text, as Vicuna's) and
InstructBlipProcessor (BlipImageProcessor's Pillow backend, the folder's
qformer_tokenizer/) make the reference inputs; no chat template, as the Hub's folders have
none. The prompt ids, the pixel values, the image features, the logits (whole and
prefilled in chunks), 8 greedy tokens and a text-only prompt match; `run --image` and
`chat` and serve's image parts reply with transformers' tokens. Features read without the prompt differ.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from blip2_helpers import (
    IMAGE,
    QUERIES,
    VISION,
    VOCAB,
    check_serve_reply,
    image_processor,
    random_model,
    save_blip2_dir,
)
from exaone4_5_helpers import greedy_tokens
from in_process import llmrun
from rerank_helpers import write_wordpiece
from vision_checks import check_logits_chunks_and_greedy, check_text_only_prompt
from vision_helpers import picture

from llmrun import api, blip2_images, vision_families
from llmrun.images import open_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

QUESTION = "what is in the picture?"


def tiny_instructblip(seed: int = 0):
    """A random InstructBlipForConditionalGeneration: Llama text of hidden 64 in 2 layers,
    a ViT of hidden 32 in 2 layers on 32-pixel images of 8-pixel patches, a Q-Former of
    hidden 32 in 2 layers (cross-attention in the first) with 4 queries and a 512-word
    vocabulary."""
    text = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=513,
    )
    qformer = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        cross_attention_frequency=2,
        encoder_hidden_size=32,
        vocab_size=512,
        max_position_embeddings=64,
    )
    config = transformers.InstructBlipConfig(
        text_config=text,
        vision_config=VISION,
        qformer_config=qformer,
        num_query_tokens=QUERIES,
        image_token_index=IMAGE,
    )
    return random_model(transformers.InstructBlipForConditionalGeneration, config, seed)


def processor_inputs(folder, images: list, text: str) -> dict:
    """InstructBlipProcessor's inputs for `images` and the plain prompt `text`."""
    processor = transformers.InstructBlipProcessor(
        image_processor=image_processor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        qformer_tokenizer=transformers.AutoTokenizer.from_pretrained(folder / "qformer_tokenizer"),
        num_query_tokens=QUERIES,
    )
    inputs = processor(images=images, text=text, return_tensors="pt")
    keys = ("input_ids", "attention_mask", "pixel_values", "qformer_input_ids")
    return {k: inputs[k] for k in (*keys, "qformer_attention_mask")}


@pytest.fixture(scope="module")
def model():
    return tiny_instructblip()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = save_blip2_dir(model, tmp_path_factory.mktemp("instructblip"))
    (folder / "qformer_tokenizer").mkdir()
    write_wordpiece(folder / "qformer_tokenizer")
    return folder


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def image():
    return open_image(picture(50, 27, 1))


@pytest.fixture(scope="module")
def reference(folder, image):
    return processor_inputs(folder, [image], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, image):
    assert engine.template is None
    return engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.get_image_features(
            reference["pixel_values"],
            reference["qformer_input_ids"],
            reference["qformer_attention_mask"],
        )
    return out.pooler_output.flatten(0, 1)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, image, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "InstructBLIP"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert ids[:QUERIES] == [IMAGE] * QUERIES and IMAGE not in ids[QUERIES:]
    qformer_ids = engine.vision.qformer_tokenizer.encode_sequence(QUESTION)
    assert qformer_ids == reference["qformer_input_ids"][0].tolist()
    assert len(set(qformer_ids)) > 3  # the question's words, not all unknown
    ours = blip2_images.pixel_values(image, engine.vision)
    torch.testing.assert_close(ours, reference["pixel_values"][0], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)
    # Text alone: InstructBlipForConditionalGeneration.forward wants pixels; its Llama not.
    check_text_only_prompt(model.language_model, engine, QUESTION)


def test_features_read_without_the_prompt_differ(engine, image, reference, model):
    """Planted: the Q-Former's queries read the image alone, as BLIP-2's do."""
    encoder = engine.vision.encoder
    states = blip2_images.encode_for_instructblip(engine.vision, [image])[0][None]
    queries = encoder.query_tokens
    with torch.no_grad():
        embeddings = encoder.qformer.embeddings
        x = embeddings.layernorm(queries)
        for layer in encoder.qformer.encoder.layer:
            x = layer(x, states, queries.shape[1])
        planted = encoder.language_projection(x)[0]
    assert (planted - image_features(model, reference)).abs().max() > 1e-2


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `llmrun chat MODEL --image PATH` and
    serve's image parts (the image before the plain transcript, which the Q-Former reads
    too, as chat's) give transformers' greedy tokens; two images are one 400."""
    from PIL import Image

    from llmrun.chat_template import plain_transcript
    from llmrun.tokenizer import load_tokenizer

    path = tmp_path / "cat.png"
    path.write_bytes(picture(60, 90, seed=6))
    for command, text in (
        ("run", QUESTION),
        ("chat", plain_transcript([{"role": "user", "content": QUESTION}])),
    ):
        inputs = processor_inputs(folder, [Image.open(path)], text)
        expected = greedy_tokens(model, inputs)
        expected = expected[: expected.index(2)] if 2 in expected else expected  # EOS
        assert len(expected) >= 4
        options = ("--image", str(path), "-n", "8", "--temperature", "0")
        if command == "run":
            result = llmrun("run", str(folder), *options, QUESTION, "--json", "--logprobs", "0")
            assert result.returncode == 0, result.stderr
            assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
        else:
            chat = llmrun("chat", str(folder), *options, input=QUESTION)
            assert chat.returncode == 0, chat.stderr
            assert chat.stdout == load_tokenizer(folder).decode(expected) + "\n\n"
            reply, image = chat.stdout[:-2], path.read_bytes()
            check_serve_reply(engine, image, QUESTION, reply, inputs, len(expected))

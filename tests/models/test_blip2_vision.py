"""BLIP-2 with an image against transformers: a tiny random Blip2ForConditionalGeneration
(ViT with a class token, a Q-Former of 4 queries cross-attending every other layer, a
Linear projection, OPT text) and Blip2Processor (BlipImageProcessor's Pillow backend: the
image resized square, bicubic) make the reference inputs; the folder has no chat template,
as the Hub's blip2-opt folders have none, so prompts are plain text. The prompt ids (the
queries' tokens before the text), the pixel values, the image features, the logits (whole
and prefilled in chunks), 8 greedy tokens and a text-only prompt match; `run --image`,
`chat` (its plain transcript) and serve's image parts reply with transformers' tokens. A Q-Former cross-attending
in every layer differs.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from blip2_helpers import (
    IMAGE,
    PROCESSOR,
    QUERIES,
    TOKENS,
    VISION,
    VOCAB,
    check_serve_reply,
    image_processor,
    random_model,
    save_blip2_dir,
)
from exaone4_5_helpers import greedy_tokens
from helpers import save_vision_dir
from in_process import llmrun
from vision_checks import check_logits_chunks_and_greedy, check_text_only_prompt
from vision_helpers import picture

from llmrun import api, blip2_images, vision_families
from llmrun.errors import UsageError
from llmrun.images import open_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

QUESTION = "Question: what is in the picture? Answer:"


def tiny_blip2(seed: int = 0):
    """A random Blip2ForConditionalGeneration: OPT text of hidden 64 in 2 layers (its head
    tied), a ViT of hidden 32 in 2 layers on 32-pixel images of 8-pixel patches, a Q-Former
    of hidden 32 in 3 layers (cross-attention in the first and third) with 4 queries."""
    text = dict(
        model_type="opt",
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=513,
    )
    qformer = dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        cross_attention_frequency=2,
        encoder_hidden_size=32,
    )
    config = transformers.Blip2Config(
        text_config=text,
        vision_config=VISION,
        qformer_config=qformer,
        num_query_tokens=QUERIES,
        image_token_index=IMAGE,
    )
    return random_model(transformers.Blip2ForConditionalGeneration, config, seed)


def processor_inputs(folder, images: list, text: str) -> dict:
    """Blip2Processor's inputs for `images` and the plain prompt `text`."""
    processor = transformers.Blip2Processor(
        image_processor=image_processor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        num_query_tokens=QUERIES,
    )
    inputs = processor(images=images, text=text, return_tensors="pt")
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


@pytest.fixture(scope="module")
def model():
    return tiny_blip2()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_blip2_dir(model, tmp_path_factory.mktemp("blip2"))


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
        out = model.get_image_features(reference["pixel_values"])
    return out.pooler_output.flatten(0, 1)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, image, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "BLIP-2"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert ids[:QUERIES] == [IMAGE] * QUERIES and IMAGE not in ids[QUERIES:]
    assert prompt_images.starts == [0] and engine.image_tokens(image) == QUERIES
    ours = blip2_images.pixel_values(image, engine.vision)
    torch.testing.assert_close(ours, reference["pixel_values"][0], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)
    # Text alone: Blip2ForConditionalGeneration.forward wants pixels; its OPT does not.
    check_text_only_prompt(model.language_model, engine, QUESTION)


def test_cross_attention_in_every_layer_differs(engine, image, reference, model, monkeypatch):
    """Planted: the second Q-Former layer cross-attends too (with the third's weights)."""
    layers = engine.vision.encoder.qformer.encoder.layer
    monkeypatch.setattr(layers[1], "crossattention", layers[2].crossattention)
    ours = torch.cat(blip2_images.encode(engine.vision, [image]))
    assert (ours - image_features(model, reference)).abs().max() > 1e-2


def test_older_files_split_q_and_v_biases_load_as_blip2_builds_them(
    model, folder, image, reference, tmp_path
):
    """Files from before transformers 5 hold each attention's q_bias and v_bias, which
    Blip2Attention joins into the qkv bias with zeros for the keys."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmrun.loading import blip2_vision

    old = shutil.copytree(folder, tmp_path / "old")
    weights = load_file(old / "model.safetensors")
    for name in [n for n in weights if n.endswith(".self_attn.qkv.bias")]:
        q, _, v = weights.pop(name).chunk(3)
        weights[name.replace("qkv.bias", "q_bias")] = q.contiguous()
        weights[name.replace("qkv.bias", "v_bias")] = v.contiguous()
    save_file(weights, old / "model.safetensors", metadata={"format": "pt"})
    vision = blip2_vision.from_hf_dir(old, 64)
    for layer in vision.encoder.vision_model.encoder.layers:
        assert not layer.self_attn.qkv.bias.chunk(3)[1].any()
    # A key bias moves every score of a query alike, so softmax cancels it: the features
    # are the random model's.
    ours = torch.cat(blip2_images.encode(vision, [image]))
    torch.testing.assert_close(ours, image_features(model, reference), atol=1e-4, rtol=0)


def test_one_image_a_prompt(engine, image):
    with pytest.raises(UsageError, match="one image a prompt, not 2"):
        engine.image_prompt(QUESTION, [image, image])
    with pytest.raises(UsageError, match="image token of its own"):
        engine.image_prompt("<image>" + QUESTION, [image])


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `llmrun chat MODEL --image PATH` and
    serve's image parts (no chat template: the image before the plain transcript, as
    chat's) give transformers' greedy tokens; two images are one 400; text alone runs the
    language model with a note."""
    from PIL import Image

    from llmrun.chat_template import plain_transcript
    from llmrun.tokenizer import load_tokenizer

    path = tmp_path / "cat.png"
    path.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    options = ("-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    result = llmrun("run", str(folder), "--image", str(path), QUESTION, *options)
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    # chat and serve: no chat template, so a plain transcript, the image's tokens before it.
    transcript = plain_transcript([{"role": "user", "content": QUESTION}])
    inputs = processor_inputs(folder, [Image.open(path)], transcript)
    expected = greedy_tokens(model, inputs)
    expected = expected[: expected.index(2)] if 2 in expected else expected
    assert len(expected) >= 4
    options = ("--image", str(path), "-n", "8", "--temperature", "0")
    chat = llmrun("chat", str(folder), *options, input=QUESTION)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == load_tokenizer(folder).decode(expected) + "\n\n"
    reply = chat.stdout[:-2]
    check_serve_reply(engine, path.read_bytes(), QUESTION, reply, inputs, len(expected))
    text = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert text.returncode == 0, text.stderr
    assert "a multimodal BLIP-2; running its language model" in text.stderr


def test_a_flan_t5_blip2_is_one_error(tmp_path):
    """The Flan-T5 BLIP-2s (an encoder-decoder language model) are refused in one line."""
    text = dict(model_type="t5", d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    config = transformers.Blip2Config(
        text_config={**text, "vocab_size": VOCAB, "decoder_start_token_id": 0},
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2),
        qformer_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, encoder_hidden_size=32
        ),
        num_query_tokens=QUERIES,
    )
    model = transformers.Blip2ForConditionalGeneration(config)
    folder = save_vision_dir(model, tmp_path / "flan", TOKENS, "", PROCESSOR)
    result = llmrun("run", str(folder), QUESTION, "-n", "2")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "encoder-decoder language model (Flan-T5)" in result.stderr

"""Idefics2 (a SigLIP tower on each image at its own size, a SwiGLU projection and a
perceiver resampler; Mistral text) with images against transformers: a tiny random
Idefics2ForConditionalGeneration (text hidden 64 in 2 layers; vision hidden 32 in 2 layers
of 8-pixel patches on a 4x4 position table; 8 latents in 2 resampler layers of 2 query
heads and 1 key-value head) and Idefics2Processor (Idefics2ImageProcessorPil: shortest edge
32, longest 48) make the reference inputs. Two images, 40x64 and 70x50 (48x34 once
resized: a side that is not whole patches), split into four crops and the whole image: the
prompt ids, each picture's pixels (the processor's unpadded), the image features (the
processor's batch padded to its largest picture), the logits (whole, and prefilled in
chunks) and 8 greedy tokens match; so do a text-only prompt's logits, and without
splitting the ids and pixels. `run --image`, `chat`'s /image and serve's image parts reply
with transformers' tokens; the text alone runs with a note. The tower's patch positions
with rows and columns swapped fail. llama.cpp has no Idefics2 converter: no mmproj.

Tolerances: ids exact; pixels 1e-6; features and logits 1e-4 (absolute); tokens exact.
"""

import json

import pytest
import torch
from chat_processor import user_message_inputs
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
)
from vision_helpers import picture

from llmrun import api, idefics2_images, vision_families
from llmrun.errors import UnsupportedError, UsageError
from llmrun.images import open_image
from llmrun.loading import idefics2_vision as idefics2_loading
from llmrun.models import idefics2_vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from transformers.models.idefics2.image_processing_pil_idefics2 import (  # noqa: E402
    Idefics2ImageProcessorPil,
)

QUESTION = "What is in these pictures?"
# Ids 512 on, after stories260K's 512 tokens.
TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>")
FAKE, IMAGE = 512, 513
LATENTS = 8
# HuggingFaceM4/idefics2-8b's chat template, which also takes a message whose content is
# a string.
TEMPLATE = (
    "{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SIZES = [(40, 64), (70, 50)]


def processor_settings(splitting: bool) -> dict:
    return {
        "image_processor_type": "Idefics2ImageProcessor",
        "do_image_splitting": splitting,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 32, "longest_edge": 48},
        "resample": 2,
    }


def tiny_idefics2(seed: int = 0):
    """A random Idefics2ForConditionalGeneration: a Mistral of hidden 64 in two layers, a
    SigLIP tower of hidden 32 in two layers, a resampler of LATENTS latents."""
    text = dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512 + len(TOKENS),
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    perceiver = dict(
        hidden_size=64,
        rms_norm_eps=1e-5,
        resampler_n_latents=LATENTS,
        resampler_depth=2,
        resampler_n_heads=2,
        resampler_head_dim=16,
        num_key_value_heads=1,
    )
    config = transformers.Idefics2Config(
        text_config=text, vision_config=vision, perceiver_config=perceiver, image_token_id=IMAGE
    )
    torch.manual_seed(seed)
    model = transformers.Idefics2ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():  # the latents as trained ones are: apart from each other
        model.model.connector.perceiver_resampler.latents.normal_(0, 1.0)
    return model


def processor_inputs(folder, images: list, question: str, splitting: bool = True) -> dict:
    """Idefics2Processor's inputs for one user message of `images` then `question`."""
    settings = processor_settings(splitting)
    del settings["image_processor_type"]
    processor = transformers.Idefics2Processor(
        image_processor=Idefics2ImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        image_seq_len=LATENTS,
        chat_template=TEMPLATE,
    )
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
    return user_message_inputs(processor, images, question, keys)


@pytest.fixture(scope="module")
def model():
    return tiny_idefics2()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("idefics2")
    return save_vision_dir(model, folder, TOKENS, TEMPLATE, processor_settings(True))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def check_ids_and_pixels(vision, ids, images, reference) -> None:
    """The prompt ids and each picture's pixels (the padded batch's corner) are the
    processor's."""
    assert ids == reference["input_ids"][0].tolist()
    padded = reference["pixel_values"][0]
    ours = [p for image in images for p in idefics2_images.pixel_values(vision, image)]
    assert len(ours) == len(padded)
    for pixels, expected, mask in zip(
        ours, padded, reference["pixel_attention_mask"][0], strict=True
    ):
        height, width = pixels.shape[1:]
        assert mask.sum() == height * width
        torch.testing.assert_close(pixels, expected[:, :height, :width], atol=1e-6, rtol=0)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(
            reference["pixel_values"], reference["pixel_attention_mask"]
        )
    return torch.cat(out.pooler_output)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "Idefics2"
    ids, prompt_images = prompt
    check_ids_and_pixels(engine.vision, ids, images, reference)
    # Each image: 5 pictures of LATENTS tokens, fake tokens between them, inside its span.
    for start, embeds, image in zip(
        prompt_images.starts, prompt_images.embeds, images, strict=True
    ):
        span = ids[start - 1 : start + len(embeds) + 1]
        assert span == ([FAKE] + [IMAGE] * LATENTS) * 5 + [FAKE]
        assert idefics2_images.image_tokens(engine.vision, image) == len(span)
    runs = zip(prompt_images.starts, prompt_images.embeds, strict=True)
    ours = torch.cat([e[torch.tensor(ids[s : s + len(e)]) == IMAGE] for s, e in runs])
    torch.testing.assert_close(ours, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_without_splitting_the_prompt_and_pixels_are_the_processors(model, tmp_path, images):
    folder = save_vision_dir(model, tmp_path / "whole", TOKENS, TEMPLATE, processor_settings(False))
    engine = api.load(str(folder), device="cpu", vision=True)
    ids, prompt_images = engine.image_prompt(engine.prompt_text(QUESTION, images=2), images)
    check_ids_and_pixels(
        engine.vision, ids, images, processor_inputs(folder, images, QUESTION, False)
    )
    assert [len(e) for e in prompt_images.embeds] == [LATENTS, LATENTS]


def test_patch_positions_with_rows_and_columns_swapped_fail(
    model, engine, images, reference, monkeypatch
):
    """Planted: each patch's position bucketed as if the image's rows were its columns."""
    positions = idefics2_vision.position_ids
    monkeypatch.setattr(
        idefics2_vision, "position_ids", lambda rows, columns, side: positions(columns, rows, side)
    )
    ours = torch.cat([e.flatten(0, 1) for e in idefics2_images.encode(engine.vision, images)])
    assert (ours - image_features(model, reference)).abs().max() > 1e-2


def test_places_must_match_the_images_and_there_is_no_mmproj(engine, images, tmp_path):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2"):
        engine.image_prompt("User:<image>two?<end_of_utterance>\nAssistant:", images)
    with pytest.raises(UnsupportedError, match="no Idefics2 projector"):
        idefics2_loading.from_mmproj(tmp_path / "mmproj.gguf", 64)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    assert len(expected) == 8 and len(set(expected)) > 1
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "Idefics2")


def test_a_processor_size_without_both_edges_is_one_error(folder, tmp_path):
    import shutil

    from in_process import llmrun

    other = shutil.copytree(folder, tmp_path / "odd")
    settings = {**processor_settings(True), "size": {"height": 32, "width": 32}}
    (other / "preprocessor_config.json").write_text(json.dumps(settings))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(20, 30, seed=7))
    result = llmrun("run", str(other), "--image", str(image), "hi", "-n", "1")
    assert result.returncode != 0
    assert (
        result.stderr.startswith("error: ") and "not a shortest and longest edge" in result.stderr
    )

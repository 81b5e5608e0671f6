"""Granite 4 Vision (SigLIP tower, Window Q-Former projectors whose streams enter six
decoder layers, Granite text) with images against transformers: a tiny random
Granite4VisionForConditionalGeneration (granite4_vision_helpers: text hidden 64 in 6
layers, SigLIP hidden 64 in 6 layers on 32-pixel tiles, LLaVA-NeXT's pinpoints) whose
Granite4VisionProcessor (Pillow image processor) makes the reference inputs. Two images,
50x90 and 100x40. The prompt ids, the pixel values, the image features (each projector's
packed stream), the logits (whole, and a chunked prefill through a KV cache) and 8 greedy
tokens match; so does the same model as a text GGUF and an mmproj laid out as llama.cpp's
converter writes them. Swapped spatial corners fail; two projectors aimed at one decoder
layer are refused.

Tolerances: 1e-4 on f32 image features and logits (about ±4); pixels 1e-5.
"""

import pytest
import torch
from granite4_vision_helpers import (
    image_streams,
    processor_inputs,
    save_granite4_vision_dir,
    tiny_granite4_vision,
    write_mmproj,
    write_text_gguf,
)
from llava_helpers import IMAGE, greedy_tokens
from vision_helpers import picture

from llmrun import api, granite4_vision_images, llava_images
from llmrun.errors import UnsupportedError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.models import granite4_vision
from llmrun.sampling import SamplingParams

pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_granite4_vision()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_granite4_vision_dir(model, tmp_path_factory.mktemp("granite4_vision"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(50, 90, 1)), open_image(picture(100, 40, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def generated(engine, ids, prompt_images) -> list[int]:
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def check_images(engine, images, reference, model, prompt_images) -> None:
    """Pixels as the processor's (its tiles of each image, without its batch padding) and
    image features as transformers'."""
    tiles = [llava_images.pixel_values(engine.vision, image) for image in images]
    expected = torch.cat(
        [p[: len(t)] for p, t in zip(reference["pixel_values"], tiles, strict=True)]
    )
    torch.testing.assert_close(torch.cat(tiles), expected, atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_streams(model, reference), atol=1e-4, rtol=0)


def test_folder_matches_transformers(model, engine, images, reference):
    ids, prompt_images = prompt(engine, images)
    assert ids == reference["input_ids"][0].tolist()
    # the base tile's 4x4, then the unpadded grid's rows with their newlines:
    # 50x90 in 64x64 (8x8 features, 4 rows kept), 100x40 in 64x32 (8x4)
    lengths = [len(e) for e in prompt_images.embeds]
    assert lengths == [16 + 4 * (8 + 1), 16 + 8 * (4 + 1)]
    assert lengths == [engine.image_tokens(image) for image in images]
    assert [ids[s] for s in prompt_images.starts] == [IMAGE, IMAGE]
    check_images(engine, images, reference, model, prompt_images)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    assert len(tokens) == 8
    assert generated(engine, ids, prompt_images) == tokens


def test_swapped_spatial_corners_fail(model, engine, images, reference, monkeypatch):
    monkeypatch.setattr(granite4_vision, "CORNERS", granite4_vision.CORNERS[::-1])
    features = torch.cat(granite4_vision_images.encode(engine.vision, images))
    assert (features - image_streams(model, reference)).abs().max() > 1e-2


def test_projectors_aimed_at_one_decoder_layer_are_refused(model):
    """transformers keeps the last one there, llama.cpp's converter another."""
    config = {**model.config.to_dict(), "spatial_target_layers": [1, 3, 4, 5]}
    with pytest.raises(UnsupportedError, match=r"decoder layers \[0, 1, 1, 3, 4, 5\]"):
        granite4_vision.streams(config)


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    """The GGUF's tokenizer puts a space after <image>, so transformers runs on its ids."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = prompt(engine, images)
    check_images(engine, images, reference, model, prompt_images)
    inputs = {**reference, "input_ids": torch.tensor([ids])}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, inputs)

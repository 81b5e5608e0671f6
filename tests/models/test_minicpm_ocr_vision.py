"""MiniCPM-OCR with images against transformers: a tiny random
MiniCPMOcrForConditionalGeneration (MiniCPM-V 4.6's SigLIP tower and merger, Qwen3.5
text; minicpmv_helpers) in 4x mode, which its folder's config.json leaves to
MiniCPMOcrConfig's default, and MiniCPMOcrProcessor make the reference inputs. The image
processor is MiniCPMV4_6ImageProcessorPil with the folder's settings: MiniCPM-OCR's own
(MiniCPMOcrImageProcessor) has only a torchvision backend, which the tests go without; its
default small_image_upsize ("always") resizes and slices as 4.6's. Two images, 64x64 (the
whole image and 2x2 slices) and 30x90 (1x3 slices): the prompt ids and pixel values equal
the processor's; the image features, the logits (whole, and prefilled in chunks) and 8
greedy tokens match; so do the logits of a text-only prompt. `run --image`, `chat`'s
/image and serve's image parts reply with transformers' tokens; the text alone runs with a
note. The folder read as MiniCPM-V 4.6's (16x mode by default) fails.

Tolerances: ids and pixels exact; features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from exaone4_5_helpers import greedy_tokens
from minicpmv_helpers import IMAGE_PAD, reference_inputs, save_minicpmv_dir, tiny_minicpmv
from test_minicpmv_vision import packed  # tests/models, beside this file
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
)
from vision_helpers import picture

from llmrun import api, minicpmv_images, vision_families
from llmrun.errors import UnsupportedError
from llmrun.images import open_image
from llmrun.loading import minicpmv_vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model():
    return tiny_minicpmv(version="ocr", downsample_mode="4x")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = save_minicpmv_dir(model, tmp_path_factory.mktemp("minicpm_ocr"))
    config = json.loads((folder / "config.json").read_text())
    del config["downsample_mode"]  # MiniCPMOcrConfig's default: 4x
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(64, 64, 1)), open_image(picture(30, 90, 2))]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return reference_inputs(folder, images, engine.prompt_text(QUESTION, images=len(images)))


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


@pytest.fixture(scope="module")
def expected_logits(model, reference):
    with torch.no_grad():
        return model(**reference).logits[0]


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["target_sizes"])
    return torch.cat(out.pooler_output)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert vision_families.of_vision(engine.vision).name == "MiniCPM-OCR"
    assert not engine.vision.encoder.args.window_merge  # 4x, config.json saying nothing
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    tiles = []
    for image in images:
        whole, slices = minicpmv_images.pixel_values(engine.vision, image)
        tiles += [whole, *slices]
    assert len(tiles) == 5 + 4
    assert torch.equal(packed(tiles), reference["pixel_values"][0])
    pads = torch.cat(
        [
            e[[ids[s + i] == IMAGE_PAD for i in range(len(e))]]
            for s, e in zip(prompt_images.starts, prompt_images.embeds, strict=True)
        ]
    )
    torch.testing.assert_close(pads, image_features(model, reference), atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_the_folder_read_as_minicpmv4_6_fails(folder, images, reference, tmp_path):
    """4.6's default downsample mode (16x) where MiniCPM-OCR's config.json gives none:
    the window merger runs, and the image tokens are not the processor's. There is no
    mmproj to read; an image processor that upsizes small images otherwise than "always"
    is refused."""
    as_4_6 = tmp_path / "as-4.6"
    as_4_6.mkdir()
    for file in folder.iterdir():
        (as_4_6 / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    (as_4_6 / "config.json").unlink()
    (as_4_6 / "config.json").write_text(json.dumps({**config, "model_type": "minicpmv4_6"}))
    (as_4_6 / "preprocessor_config.json").unlink()
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    del settings["downsample_mode"]
    (as_4_6 / "preprocessor_config.json").write_text(json.dumps(settings))
    engine = api.load(str(as_4_6), device="cpu", vision=True)
    assert engine.vision.encoder.args.window_merge
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)
    assert ids != reference["input_ids"][0].tolist()
    with pytest.raises(UnsupportedError, match="no MiniCPM-OCR projector"):
        minicpmv_vision.from_mmproj_ocr(tmp_path / "mmproj.gguf", 64)
    adaptive = {**settings, "small_image_upsize": "adaptive"}  # OpenCV's glyph measure
    (as_4_6 / "preprocessor_config.json").write_text(json.dumps(adaptive))
    with pytest.raises(UnsupportedError, match="small_image_upsize is 'adaptive'"):
        minicpmv_vision.from_hf_dir(as_4_6, 64)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, engine, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts
    from the folder; the folder's text alone with its usual note."""
    image = tmp_path / "photo.png"
    image.write_bytes(picture(50, 80, seed=4))
    text = engine.prompt_text(QUESTION, images=1)
    reference = reference_inputs(folder, [open_image(image.read_bytes())], text)
    expected = greedy_tokens(model, reference)
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "MiniCPM-OCR")

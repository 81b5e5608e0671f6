"""MiniCPM-V 4.6 with images against transformers: a tiny random
MiniCPMV4_6ForConditionalGeneration (SigLIP tower with its window merger, the merger,
Qwen3.5 text) and MiniCPMV4_6Processor make the reference inputs. The prompt ids and
pixel values equal the processor's for images of several shapes, sliced and not; the
image features, the logits of a prompt with two images of other grids and 8 greedy tokens
match, in 16x mode and in 4x (without image numbers); so does the same model as a text GGUF and an mmproj GGUF
laid out as llama.cpp's converter writes them (benchmarks/llama_cpp_minicpmv.py checks
that layout against the converter). Patches placed on the position table without
bucketing, and slices taken column by column, fail.

Tolerances: ids and pixels exact; features and logits 1e-4 (logits within about ±6).
"""

import json

import pytest
import torch
from minicpmv_helpers import (
    IMAGE_PAD,
    PATCH,
    greedy_tokens,
    reference_inputs,
    save_minicpmv_dir,
    tiny_minicpmv,
    write_mmproj,
    write_text_gguf,
)
from vision_checks import (
    check_mmproj_refusals,
    check_prompt_logits,
    greedy_ids,
    logits,
    soft_rows,
)
from vision_helpers import picture

from llmrun import api, minicpmv_images, vision_families
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading.minicpmv_vision import from_mmproj
from llmrun.models import minicpmv_vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
PIXEL_VALUES = minicpmv_images.pixel_values
# (height, width) -> slice grid: over 32x32 pixels an image is sliced near its aspect.
SHAPES = {(40, 64): (1, 2), (100, 17): (3, 1), (64, 64): (2, 2), (20, 20): (0, 0)}


@pytest.fixture(scope="module")
def model():
    return tiny_minicpmv()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_minicpmv_dir(model, tmp_path_factory.mktemp("minicpmv"))


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


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["target_sizes"])
    return torch.cat(out.pooler_output)


def packed(tiles: list[torch.Tensor]) -> torch.Tensor:
    """Tiles [3, H, W] in the processor's layout: each one's patches row by row, side by
    side [3, PATCH, patches * PATCH] (reshape_by_patch), the tiles one after another."""
    out = []
    for tile in tiles:
        c, h, w = tile.shape
        grid = tile.reshape(c, h // PATCH, PATCH, w // PATCH, PATCH)
        out.append(grid.permute(0, 2, 1, 3, 4).reshape(c, PATCH, -1))
    return torch.cat(out, dim=-1)


def test_the_prompt_and_pixels_are_the_processors(engine, folder):
    vision = engine.vision
    for (height, width), grid in SHAPES.items():
        image = open_image(picture(height, width, 3))
        text = engine.prompt_text(QUESTION, images=1)
        expected = reference_inputs(folder, [image], text)
        ids, prompt_images = engine.image_prompt(text, [image])
        assert ids == expected["input_ids"][0].tolist(), (height, width)
        whole, slices = minicpmv_images.pixel_values(vision, image)
        assert len(slices) == grid[0] * grid[1]
        assert torch.equal(packed([whole, *slices]), expected["pixel_values"][0])
        (start,), (embeds,) = prompt_images.starts, prompt_images.embeds
        assert ids[start] == ids[start + len(embeds) - 1] == IMAGE_PAD
        # Known before encoding: <image_id>0</image_id> to the last </slice> or </image>.
        rendered = engine.tokenizer.encode(text)
        assert minicpmv_images.image_tokens(vision, image) == len(ids) - len(rendered) + 1


def test_image_features_match_transformers(model, prompt, reference):
    features = soft_rows(*prompt, IMAGE_PAD)
    expected = image_features(model, reference)
    # 64x64: 4 + 4 slices of 4 tokens; 30x90: 3 + 3 slices of 4
    assert features.shape == (35, 64)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=0)
    # The text tokens inside a span are the language model's own embeddings.
    ids, prompt_images = prompt
    table = model.model.language_model.embed_tokens.weight.detach()
    start, embeds = prompt_images.starts[0], prompt_images.embeds[0]
    for i in range(len(embeds)):
        if ids[start + i] != IMAGE_PAD:
            assert torch.equal(embeds[i], table[ids[start + i]])


def bucketed_as_pixels(rows, columns, side):
    """Each patch at its own row and column of the table, not spread over it."""
    return (torch.arange(rows)[:, None] * side + torch.arange(columns)[None, :]).flatten()


def slices_by_columns(vision, image):
    whole, slices = PIXEL_VALUES(vision, image)
    rows, columns = minicpmv_images._grid(vision, image)
    return whole, [slices[c * rows + r] for r in range(rows) for c in range(columns)]


@pytest.mark.parametrize(
    "module, name, planted",
    [
        (minicpmv_vision, "position_ids", bucketed_as_pixels),
        (minicpmv_images, "pixel_values", slices_by_columns),
    ],
)
def test_a_planted_bug_fails(engine, model, images, reference, monkeypatch, module, name, planted):
    monkeypatch.setattr(module, name, planted)
    features = torch.cat([e.soft for e in minicpmv_images.encode(engine.vision, images)])
    assert (features - image_features(model, reference)).abs().max() > 1e-2


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    expected = check_prompt_logits(model, engine, prompt, reference, chunk=7, context=256)
    assert expected.abs().max() < 8


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert greedy_ids(engine, *prompt) == expected


def test_4x_mode_without_image_ids_matches_transformers(images, tmp_path):
    """downsample_mode 4x: no window merger, a token per 2x2 patches (sides rounded to
    8 pixels, not 16); use_image_id false: no <image_id>N</image_id> before an image."""
    model = tiny_minicpmv(downsample_mode="4x")
    folder = save_minicpmv_dir(model, tmp_path / "4x", image_ids=False)
    engine = api.load(str(folder), device="cpu", vision=True)
    text = engine.prompt_text(QUESTION, images=len(images))
    reference = reference_inputs(folder, images, text)
    ids, prompt_images = engine.image_prompt(text, images)
    assert ids == reference["input_ids"][0].tolist()
    assert engine.tokenizer.token_id("<image_id>") not in ids
    features = soft_rows(ids, prompt_images, IMAGE_PAD)
    assert features.shape == (142, 64)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    assert vision_families.of_mmproj(mmproj).name == "MiniCPM-V 4.6"
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    features = soft_rows(ids, prompt_images, IMAGE_PAD)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert greedy_ids(engine, ids, prompt_images) == greedy_tokens(model, reference)
    check_mmproj_refusals(text, mmproj, from_mmproj)


def test_image_places_must_match_the_images(engine, images):
    text = f"<|im_start|>user\n{'<|image_pad|>'}two?<|im_end|>\n"
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image_pad\|>\) for 2"):
        engine.image_prompt(text, images)


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file."""
    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(50, 80, seed=4))
    text = f"<|im_start|>user\n<|image_pad|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    reference = reference_inputs(folder, [Image.open(image).convert("RGB")], text)
    expected = greedy_tokens(model, reference)
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    for model_args in ([str(folder)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected


def test_a_processor_at_odds_with_the_tower_is_one_error_line(folder, tmp_path):
    import shutil

    from in_process import llmrun

    other = shutil.copytree(folder, tmp_path / "odd-patches")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    settings["patch_size"] = 14
    (other / "preprocessor_config.json").write_text(json.dumps(settings))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(40, 64, seed=1))
    result = llmrun("run", str(other), "--image", str(image), "Hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1] == (
        f"error: {other / 'preprocessor_config.json'}: patch_size is 14, but the model's is 4"
    )

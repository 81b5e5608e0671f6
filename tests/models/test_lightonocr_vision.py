"""LightOnOCR with images against transformers: a tiny random
LightOnOcrForConditionalGeneration (Pixtral tower, patch merger, Qwen3 text) and
LightOnOcrProcessor (PixtralImageProcessor's Pillow backend) make the reference inputs.
The image processor resizes in sides of 14 pixels (LightOnOCR-1B-1025's patch_size), half
a merged token's: the test images have an odd row or column of patches, which the tower
sees and the merger leaves out. The prompt ids, the pixel values, the image features, the
logits of a prompt with two images of other shapes and 8 greedy tokens match; so does the
same model as a qwen3 text GGUF and an mmproj GGUF laid out as llama.cpp's converter
writes them, and LightOnOCR-1B's first config.json (model_type mistral3). Encoding without
the odd row fails.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json
import shutil

import pytest
import torch
from lighton_ocr_helpers import (
    IMAGE,
    LONGEST_EDGE,
    greedy_tokens,
    processor_inputs,
    save_lighton_ocr_dir,
    tiny_lighton_ocr,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.lighton_ocr_vision import LightOnOcrVision
from llmrun.pixtral_images import pixel_values
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is written here?"
# Sides rounded up to 14 pixels within 84: 70x84 is 5 x 6 patches, 2 rows of 3 tokens (the
# fifth patch row left out); 84x40 is 84x42, 6 x 3 patches, 3 rows of 1 (the third
# column left out).
SIZES = [(70, 84), (84, 40)]
TOKENS = [6, 3]


@pytest.fixture(scope="module")
def model():
    return tiny_lighton_ocr()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_lighton_ocr_dir(model, tmp_path_factory.mktemp("lighton_ocr"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


def user_text(engine, images: int) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": QUESTION}]
    return engine.render([{"role": "user", "content": content}])


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(user_text(engine, len(images)), images)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_sizes"])
    return torch.cat(out.pooler_output)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt, reference):
    assert isinstance(engine.vision, LightOnOcrVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start : start + count] == [IMAGE] * count
    vision = engine.vision
    sizes = reference["image_sizes"].tolist()
    assert sizes == [[70, 84], [84, 42]]
    for image, expected, (h, w) in zip(images, reference["pixel_values"], sizes, strict=True):
        ours = pixel_values(image, LONGEST_EDGE, vision.unit, vision.mean, vision.std)
        assert ours.shape == (3, h, w)
        torch.testing.assert_close(ours, expected[:, :h, :w], atol=1e-5, rtol=0)


def test_image_features_match_transformers(model, prompt, reference):
    features = torch.cat(prompt[1].embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)


def test_encoding_without_the_odd_patches_fails(model, engine, images, reference):
    """The tower attends over every patch, the merger's unfold drops the odd ones after:
    pixels cropped to whole merged tokens first give other features."""
    vision = engine.vision
    planted = []
    for image in images:
        pixels = pixel_values(image, LONGEST_EDGE, vision.unit, vision.mean, vision.std)
        height, width = (side // 28 * 28 for side in pixels.shape[1:])
        with torch.no_grad():
            planted.append(vision.encoder(pixels[:, :height, :width]).flatten(0, 1))
    expected = image_features(model, reference)
    assert torch.cat(planted).shape == expected.shape
    assert (torch.cat(planted) - expected).abs().max() > 1e-2


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 5, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_gguf_with_mmproj_matches_transformers(model, folder, tmp_path):
    """llama.cpp resizes to sides of a merged token's (28 pixels): images whose sides the
    processor's resize leaves at multiples of 28 (56x84; 100x60 fits 84 as 84x56) are
    the same either way."""
    images = [open_image(picture(56, 84, 3)), open_image(picture(100, 60, 4))]
    reference = processor_inputs(folder, images, QUESTION)
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32, as the converter's --outtype f32 writes it.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)
    assert vision_families.of_mmproj(mmproj).name == "LightOnOCR"
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    assert engine.vision.unit == 28
    ids, prompt_images = engine.image_prompt(user_text(engine, len(images)), images)
    assert ids == reference["input_ids"][0].tolist()
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)


def test_lighton_ocr_1b_s_first_config_loads_the_same_model(engine, folder, prompt, tmp_path):
    """LightOnOCR-1B-1025's config.json as first published: model_type mistral3,
    architecture LightOnOCRForConditionalGeneration, the same keys."""
    old = shutil.copytree(folder, tmp_path / "lighton-1b")
    config = json.loads((old / "config.json").read_text())
    config.update(model_type="mistral3", architectures=["LightOnOCRForConditionalGeneration"])
    (old / "config.json").write_text(json.dumps(config))
    assert vision_families.of_folder(old).name == "LightOnOCR"
    text_only = api.load(str(old), device="cpu")  # its note named Mistral 3
    assert text_only.checkpoint.notes[0].startswith(f"{old}: a multimodal LightOnOCR; ")
    loaded = api.load(str(old), device="cpu", vision=True)
    ids, prompt_images = prompt
    torch.testing.assert_close(
        logits(loaded, ids, prompt_images), logits(engine, ids, prompt_images), atol=0, rtol=0
    )
    encoder, expected = loaded.vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert all(torch.equal(encoder[k], expected[k]) for k in expected)


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image_pad\|>\) for 2"):
        engine.image_prompt("<|im_start|>user\n<|image_pad|>two?<|im_end|>", images)
    with pytest.raises(UsageError, match="too thin"):
        engine.image_tokens(open_image(picture(8, 84, 5)))


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file (F16 matrices, as the converter writes them by default)."""
    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "page.png"
    image.write_bytes(picture(50, 80, seed=6))  # 50x80 resized up to 56x84: 2 rows of 3
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    for model_args in ([str(folder)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected

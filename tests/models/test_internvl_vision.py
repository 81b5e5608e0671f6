"""InternVL (3 / 3.5: InternViT, pixel shuffle, MLP projector, Qwen2 text) with images
against transformers: a tiny random InternVLForConditionalGeneration (text hidden 64 in 2
layers; vision hidden 32 in 2 layers on 64-pixel tiles of 8-pixel patches, 16 tokens a tile,
up to 4 tiles) whose InternVLProcessor (chat template, <IMG_CONTEXT> expanded,
GotOcr2ImageProcessor's Pillow tiles) makes the reference inputs. Two images, 48x150 (3
tiles in a row and a thumbnail) and 100x60 (2 tiles in a column and a thumbnail). The tiles,
the prompt ids, the image features, the logits (whole, and a chunked prefill through a KV
cache) and 8 greedy tokens match; so does the same model as a text GGUF and an mmproj GGUF
laid out as llama.cpp's converter writes them from an original InternVL repo. A pixel
shuffle of another order, or a dropped thumbnail, fails. The 6B ViT's RMSNorm and q/k norms,
and position embeddings interpolated to another grid, match InternVLVisionModel.

Tolerances: 1e-4 on f32 image features and logits (about ±8); tiles 1e-5 (both exact here).
"""

import json

import pytest
import torch
from in_process import llmrun
from internvl_helpers import (
    IMG_CONTEXT,
    IMG_END,
    IMG_START,
    TOKENS_PER_TILE,
    greedy_tokens,
    processor_inputs,
    save_internvl_dir,
    tiny_internvl,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, internvl_images
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.internvl_vision import from_mmproj
from llmrun.models import internvl_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_internvl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_internvl_dir(model, tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(48, 150, 1)), open_image(picture(100, 60, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def image_features(model, pixels) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(pixels).pooler_output.flatten(0, 1)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_the_prompt_and_tiles_are_the_processors(engine, images, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    # 3 tiles and a thumbnail, then 2 tiles and a thumbnail: a span of their tokens each,
    # between <img> and </img>.
    assert [len(e) for e in prompt_images.embeds] == [4 * TOKENS_PER_TILE, 3 * TOKENS_PER_TILE]
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start - 1] == IMG_START and ids[start + len(embeds)] == IMG_END
        assert set(ids[start : start + len(embeds)]) == {IMG_CONTEXT}
    tiles = torch.cat([internvl_images.pixel_values(engine.vision, image) for image in images])
    torch.testing.assert_close(tiles, reference["pixel_values"], atol=1e-5, rtol=0)
    assert [engine.image_tokens(image) for image in images] == [4 * 16 + 2, 3 * 16 + 2]


def test_image_features_match_transformers(model, prompt, reference):
    features = torch.cat(prompt[1].embeds)
    expected = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=0)


def test_a_pixel_shuffle_of_another_order_fails(model, engine, images, reference, monkeypatch):
    """Each 2x2 block's patches taken column by column instead of row by row."""

    def transposed(grid, merge):
        return internvl_vision_shuffle(grid.transpose(1, 2), merge).transpose(1, 2)

    internvl_vision_shuffle = internvl_vision.pixel_shuffle
    monkeypatch.setattr(internvl_vision, "pixel_shuffle", transposed)
    features = torch.cat(internvl_images.encode(engine.vision, images))
    assert (features - image_features(model, reference["pixel_values"])).abs().max() > 1e-2


def test_a_dropped_thumbnail_fails(engine, images, reference, monkeypatch):
    """Tiles without the thumbnail of a many-tile image: the prompt is no longer the
    processor's."""
    tiles = internvl_images.pixel_values
    monkeypatch.setattr(internvl_images, "pixel_values", lambda v, image: tiles(v, image)[:-1])
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)
    assert ids != reference["input_ids"][0].tolist()


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_internvl_3_5_s_qwen3_text_matches_transformers(images, tmp_path):
    """InternVL 3.5's language model is Qwen3's (q/k norms): the images reach it too."""
    model = tiny_internvl(text_type="qwen3")
    folder = save_internvl_dir(model, tmp_path / "internvl3.5")
    engine = api.load(str(folder), device="cpu", vision=True)
    reference = processor_inputs(folder, images, QUESTION)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    """The text GGUF (arch qwen2) and the mmproj GGUF (projector internvl, each qkv split,
    the original repo's names) as llama.cpp's converter writes them."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    expected_features = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(
        torch.cat(prompt_images.embeds), expected_features, atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_a_quantized_mmproj_stays_close(model, engine, images, tmp_path):
    """Q8_0 tower matrices (the converter's --outtype q8_0): features near the exact ones."""
    import gguf

    vision = from_mmproj(
        write_mmproj(model, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0), 64
    )
    features = torch.cat(internvl_images.encode(vision, images))
    exact = torch.cat(internvl_images.encode(engine.vision, images))
    assert 0 < (features - exact).abs().max() < 0.05 * exact.abs().max()


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<IMG_CONTEXT>\) for 2 images"):
        engine.image_prompt("<|im_start|>user\n<IMG_CONTEXT>\ntwo?", images)
    with pytest.raises(UsageError, match="of its own"):
        engine.image_prompt("<|im_start|>user\n<img><IMG_CONTEXT>\none?", images[:1])


@pytest.mark.parametrize(
    ("size", "mode"), [((1000, 600), "RGBA"), ((333, 1600), "RGB"), ((300, 400), "L")]
)
def test_tiles_match_got_ocr2_image_processor(size, mode):
    """InternVL 3's settings: 448-pixel tiles, 1 to 12 of them, ImageNet's mean and std."""
    import io

    from PIL import Image
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    from llmrun.loading.internvl_vision import InternVLVision

    data = picture(*size, seed=3, mode=mode)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    processor = GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, image_mean=mean, image_std=std
    )
    expected = processor(
        images=Image.open(io.BytesIO(data)), crop_to_patches=True, return_tensors="pt"
    )
    vision = InternVLVision(None, 448, 1, 12, mean, std)
    image = open_image(data)
    ours = internvl_images.pixel_values(vision, image)
    assert len(ours) == expected.num_patches[0] == internvl_images.tile_count(vision, *size)
    torch.testing.assert_close(ours, expected.pixel_values, atol=1e-5, rtol=0)


def test_tile_grids_match_transformers():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        get_optimal_tiled_canvas,
    )

    sizes = [(h, w) for h in (1, 37, 200, 448, 449, 900, 1333) for w in (1, 60, 448, 700, 2000)]
    for min_tiles, max_tiles in ((1, 12), (1, 6), (2, 9)):
        for h, w in sizes:
            expected = get_optimal_tiled_canvas((h, w), (448, 448), min_tiles, max_tiles)
            assert internvl_images.tile_grid(h, w, 448, min_tiles, max_tiles) == expected


@pytest.mark.parametrize("pixels", [(48, 48), (48, 32)])
def test_rms_norm_q_k_norms_and_interpolated_positions_match(pixels):
    """The 6B ViT's kind of layer (RMSNorm, q/k RMS norms, no q/k/v biases) on a grid other
    than the trained 4x4 patches: bicubically interpolated position embeddings."""
    from helpers import randomize

    config = transformers.InternVLVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        norm_type="rms_norm",
        use_qk_norm=True,
        attention_bias=False,
    )
    torch.manual_seed(0)
    reference = transformers.InternVLVisionModel(config).eval()
    randomize(reference)
    ours = internvl_vision.VisionModel(internvl_vision.VisionArgs.from_config(config.to_dict()))
    ours.load_state_dict(reference.state_dict())
    tiles = torch.randn(2, 3, *pixels)
    with torch.no_grad():
        expected = reference(pixel_values=tiles).last_hidden_state
        torch.testing.assert_close(ours(tiles), expected, atol=1e-4, rtol=0)


def test_a_config_s_settings_are_checked(folder, tmp_path):
    import shutil

    other = shutil.copytree(folder, tmp_path / "other")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(
        json.dumps({**settings, "size": {"height": 60, "width": 60}})
    )
    with pytest.raises(ModelFormatError, match="not whole tokens of 16"):
        api.load(str(other), device="cpu", vision=True)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2}))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(64, 64, seed=5))
    result = llmrun("run", str(other), "--image", str(image), "hi")
    assert result.returncode != 0 and "vision_feature_layer -2" in result.stderr


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(90, 70, seed=4))
    reference = processor_inputs(folder, [Image.open(image).convert("RGB")], QUESTION)
    expected = greedy_tokens(model, reference)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    for model_args in ([str(folder)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected

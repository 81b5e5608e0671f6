"""Gemma 4 with images against transformers: a tiny random Gemma4ForConditionalGeneration
(gemma4_vision_helpers) whose Gemma4Processor (Gemma 4's chat template, <|image> and
<image|> around an image's soft tokens, their number following the image's shape, patches
with their positions) makes the reference inputs. The patches, the image features, the
logits of a prompt with two images (whose tokens attend to each other both ways on the
sliding layer, through a window of 8; whose per-layer inputs are the pad token's) and 8
greedy tokens match; so does the same model as a text GGUF and an mmproj GGUF laid out
as llama.cpp's converter writes them (benchmarks/llama_cpp_gemma4_vision.py checks that
layout against the converter's own file), also one holding an audio encoder.
Planted bugs (the 2D RoPE's axes swapped, the linears unclipped, the per-layer inputs of
the placeholder id) move the features or logits far past the tolerance. The resizing
matches Gemma4ImageProcessor on real-size images.

Tolerances: features and f32 logits 1e-4 max abs (measured ~1e-6); pixels 1e-6; an F16
mmproj's features 1e-2 (measured 3.4e-3).
"""

import io

import pytest
import torch
from gemma4_vision_helpers import (
    IMAGE,
    greedy_tokens,
    processor_inputs,
    save_gemma4_vl_dir,
    tiny_gemma4_vl,
    write_mmproj,
    write_text_gguf,
)
from helpers import needs_templates
from vision_helpers import picture

from llmrun import api, gemma4_images
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.gemma4_vision import Gemma4Vision, from_mmproj
from llmrun.models import gemma4_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytestmark = needs_templates
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")
F16_TOLERANCE = 1e-2  # features of an F16 mmproj (within about ±5): measured 3.4e-3


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma4_vl_dir(model, tmp_path_factory.mktemp("gemma4-vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    # 48x80 and 100x60 pixels: 6x10 and 10x6 tokens of 3x3 patches of 4 pixels.
    return [open_image(picture(48, 80, 1)), open_image(picture(100, 60, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    text = engine.prompt_text(QUESTION, images=len(images))
    return engine.image_prompt(text, images)


def features(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model.model.get_image_features(inputs.pixel_values, inputs.image_position_ids)
    return list(out.pooler_output)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def test_the_prompt_and_patches_are_the_processors(engine, images, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference.input_ids[0].tolist()
    soft = [i for i, t in enumerate(ids) if t == IMAGE]
    assert prompt_images.starts == [soft[0], soft[60]]
    assert [engine.image_tokens(image) for image in images] == [60, 60]
    for image, pixels, positions in zip(
        images, reference.pixel_values, reference.image_position_ids, strict=True
    ):
        patches, ours = gemma4_images.patches(engine.vision, image)
        real = (positions != -1).all(-1)
        assert torch.equal(ours, positions[real])
        torch.testing.assert_close(patches, pixels[real], atol=1e-6, rtol=0)


def test_image_features_match_transformers(model, prompt, reference):
    for ours, expected in zip(prompt[1].embeds, features(model, reference), strict=True):
        assert expected.abs().max() > 1
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        inputs = {k: v for k, v in reference.items() if k != "mm_token_type_ids"}
        causal = model(**inputs).logits[0]
    # The image tokens' attention both ways matters: without it the logits move.
    assert (causal - expected).abs().max() > 1e-2
    length, first = len(ids), prompt_images.first
    tokens = torch.tensor([ids])
    with torch.no_grad():
        # Through a KV cache whose sliding layer keeps a ring of 8: the text before the
        # first image, then the rest (both images) in one forward.
        cache = engine.model.new_cache(1, 256, torch.float32, "cpu")
        head = engine.model(tokens[:, :first], torch.arange(first)[None], cache)
        tail = engine.model(
            tokens[:, first:],
            torch.arange(first, length)[None],
            cache,
            images=prompt_images.tokens(first, length, CPU),
        )
        # generate's prefill in chunks of 16, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=16, images=prompt_images)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([head, tail], 1)[0], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_planted_bugs_fail(model, engine, prompt, reference, monkeypatch):
    """Each detail the tests check is one a bug would break: the 2D RoPE's axes swapped,
    the linears' clipping dropped, the soft tokens' per-layer inputs taken from the
    placeholder id instead of the pad token's."""
    ids, prompt_images = prompt
    images = [open_image(picture(48, 80, 1))]
    expected = features(model, reference)[0]
    rope = gemma4_vision.axial_rope
    monkeypatch.setattr(gemma4_vision, "axial_rope", lambda args, pos: rope(args, pos.flip(-1)))
    swapped = engine.encode_images(images)[0]
    monkeypatch.undo()
    assert (swapped - expected).abs().max() > 1e-2
    for module in engine.vision.encoder.modules():
        if isinstance(module, gemma4_vision.ClippableLinear):
            monkeypatch.setattr(module, "clipped", False)
    unclipped = engine.encode_images(images)[0]
    monkeypatch.undo()
    assert (unclipped - expected).abs().max() > 1e-2
    with torch.no_grad():
        truth = model(**reference).logits[0]
    monkeypatch.setattr(engine.model.args, "pad_token_id", IMAGE)
    assert (logits(engine, ids, prompt_images) - truth).abs().max() > 1e-2


@pytest.fixture(scope="module")
def reference_280(folder, images):
    """The processor's inputs with its default budget, 280 tokens an image: an mmproj's
    (it holds none)."""
    return processor_inputs(folder, images, QUESTION, tokens=280)


def test_gguf_with_mmproj_matches_transformers(model, images, reference_280, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    reference = reference_280
    assert ids == reference.input_ids[0].tolist()
    for ours, expected in zip(prompt_images.embeds, features(model, reference), strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_a_prompt_must_mark_each_image(engine, images):
    text = engine.prompt_text(QUESTION, images=1)
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image\|>\) for 2 images"):
        engine.image_prompt(text, images)


@pytest.mark.parametrize(
    ("size", "mode"), [((600, 1000), "RGBA"), ((768, 768), "RGB"), ((4, 1200), "RGB")]
)
def test_preprocessing_matches_gemma4_image_processor(size, mode):
    """The default processor (patches of 16, pooled 3x3, 280 tokens): a wide image shrunk,
    a square one, and one so thin that its short side would round to nothing (one token
    high, as long as the budget allows)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    data = picture(*size, seed=3, mode=mode)
    expected = Gemma4ImageProcessorPil()(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    with torch.device("meta"):  # the sizes alone: Gemma4VisionConfig's defaults
        encoder = gemma4_vision.ImageEncoder(
            gemma4_vision.EncoderArgs(gemma4_vision.VisionArgs(), 64)
        )
    vision = Gemma4Vision(encoder, max_soft_tokens=280)
    patches, positions = gemma4_images.patches(vision, open_image(data))
    real = (expected.image_position_ids[0] != -1).all(-1)
    assert torch.equal(positions, expected.image_position_ids[0][real])
    torch.testing.assert_close(patches, expected.pixel_values[0][real], atol=1e-6, rtol=0)
    tokens = expected.num_soft_tokens_per_image[0]
    assert gemma4_images.image_tokens(vision, open_image(data)) == tokens


def test_an_audio_tower_is_left_with_a_note(folder, tmp_path):
    """Gemma 4 E2B's and E4B's folders hold an audio tower too, which llmrun does not
    run: the images still load, and the note that stays says so."""
    import json
    import shutil

    copy = shutil.copytree(folder, tmp_path / "with-audio")
    config = json.loads((copy / "config.json").read_text())
    config["audio_config"] = {"model_type": "gemma4_audio"}
    (copy / "config.json").write_text(json.dumps(config))
    engine = api.load(str(copy), device="cpu", vision=True)
    assert engine.checkpoint.notes == [
        f"{copy}: Gemma 4's audio tower is not run until a clip is given (--audio, /audio)"
    ]
    assert engine.vision is not None


def test_the_token_budget_is_the_image_processors(folder, tmp_path):
    """transformers 5 saves the image processor's settings in processor_config.json, under
    "image_processor"; a budget Gemma4ImageProcessor refuses is refused."""
    import json
    import shutil

    from llmrun.loading.gemma4_vision import from_hf_dir

    copy = shutil.copytree(folder, tmp_path / "processor")
    settings = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").unlink()
    settings["max_soft_tokens"] = 140
    (copy / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    assert from_hf_dir(copy, 64).max_soft_tokens == 140
    settings["max_soft_tokens"] = 100
    (copy / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    with pytest.raises(ModelFormatError, match="max_soft_tokens 100; Gemma 4 takes one of"):
        from_hf_dir(copy, 64)


def test_the_converters_default_f16_mmproj_matches_transformers(
    model, images, reference_280, tmp_path
):
    """convert_hf_to_gguf.py --mmproj writes F16 matrices by default."""
    vision = from_mmproj(write_mmproj(model, tmp_path / "mmproj-f16.gguf", f16=True), 64)
    ours = gemma4_images.encode(vision, images)
    for got, expected in zip(ours, features(model, reference_280), strict=True):
        assert 0 < (got - expected).abs().max() < F16_TOLERANCE


def test_an_mmproj_with_an_audio_encoder_loads_its_vision_part(model, engine, tmp_path):
    """E2B's and E4B's mmproj files hold the audio encoder (a.*, mm.a.*) beside the
    vision one: it is left out."""
    vision = from_mmproj(write_mmproj(model, tmp_path / "mmproj.gguf", audio=True), 64)
    loaded, expected = vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)

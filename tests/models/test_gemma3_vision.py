"""Gemma 3 with images against transformers: a tiny random Gemma3ForConditionalGeneration
whose processor (Gemma3Processor: chat template, image tokens, pixel values) makes the
reference inputs. The image features, the logits of a prompt with two images (whose
tokens attend to each other both ways, through a window of 6) and 8 greedy tokens match;
so does the same model converted to a text GGUF and an mmproj GGUF. The preprocessing
matches Gemma3ImageProcessor on real-size images."""

import io

import pytest
import torch
from vision_helpers import (
    greedy_tokens,
    picture,
    processor_inputs,
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
    write_mmproj,
    write_text_gguf,
)

from llmrun import api
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image, pixel_values
from llmrun.loading.vision import from_hf_dir, from_mmproj
from llmrun.multimodal import encode
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_gemma3_vl_dir(model, tmp_path_factory.mktemp("gemma3-vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(48, 80, 1)), open_image(picture(100, 60, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    text = engine.prompt_text(QUESTION, images=len(images))
    return engine.image_prompt(text, images)


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == 516][::4]
    vision = engine.vision
    for image, expected in zip(images, reference.pixel_values, strict=True):
        ours = pixel_values(image, vision.image_size, vision.mean, vision.std)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_image_features_match_transformers(model, engine, prompt, reference):
    with torch.no_grad():
        expected = model.model.get_image_features(reference.pixel_values).pooler_output
    ours = torch.stack(prompt[1].embeds)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        inputs = {k: v for k, v in reference.items() if k != "token_type_ids"}
        causal = model(**inputs).logits[0]
    # The image tokens' attention both ways matters: without it the logits move.
    assert (causal - expected).abs().max() > 1e-2
    tokens = torch.tensor([ids])
    length = len(ids)
    with torch.no_grad():
        whole = engine.model(
            tokens,
            torch.arange(length)[None],
            images=prompt_images.tokens(0, length, torch.device("cpu")),
        )[0]
        # Through a KV cache whose window layer keeps a ring of 6: the text before the
        # first image, then the rest (both images) in one forward.
        cache = engine.model.new_cache(1, 64, torch.float32, "cpu")
        first = prompt_images.first
        head = engine.model(tokens[:, :first], torch.arange(first)[None], cache)
        tail = engine.model(
            tokens[:, first:],
            torch.arange(first, length)[None],
            cache,
            images=prompt_images.tokens(first, length, torch.device("cpu")),
        )
        # generate's prefill in chunks of 5, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 64, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([head, tail], 1)[0], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference.input_ids[0].tolist()
    with torch.no_grad():
        expected = model.model.get_image_features(reference.pixel_values).pooler_output
    # The converter stores the input projection in F16.
    torch.testing.assert_close(torch.stack(prompt_images.embeds), expected, atol=5e-3, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_a_quantized_mmproj_matches_its_dequantized_weights(model, engine, images, tmp_path):
    """Q8_0 encoder layers, as `llama-quantize` or the converter's --outtype q8_0 write
    them: the features of gguf's dequantization of the same blocks."""
    import gguf

    path = write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    vision = from_mmproj(path, 64)
    state = vision.encoder.state_dict()
    q = state["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"]
    original = model.model.vision_tower.encoder.layers[0].self_attn.q_proj.weight.detach()
    blocks = gguf.quants.quantize(original.numpy(), gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(q, torch.from_numpy(expected))
    features = torch.stack(encode(vision, images))
    exact = torch.stack(encode(engine.vision, images))
    assert 0 < (features - exact).abs().max() < 0.05


def test_the_hubs_key_names_load_the_same_encoder(folder, engine, tmp_path):
    """The Hub's files name the tower vision_tower.vision_model.*, transformers 5's
    save_pretrained vision_tower.* (the folder above)."""
    import shutil

    from safetensors.torch import load_file, save_file

    hub = shutil.copytree(folder, tmp_path / "hub")
    state = load_file(hub / "model.safetensors")
    prefix = "vision_tower."
    renamed = {
        (prefix + "vision_model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in state.items()
    }
    assert renamed != state
    save_file(renamed, hub / "model.safetensors", metadata={"format": "pt"})
    loaded = from_hf_dir(hub, 64).encoder.state_dict()
    expected = engine.vision.encoder.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_model_without_vision_is_refused():
    with pytest.raises(UsageError, match="images go to Gemma 3"):
        api.load(None, device="cpu", vision=True)


@pytest.mark.parametrize(("size", "mode"), [((896, 896), "RGB"), ((600, 1000), "RGBA")])
def test_preprocessing_matches_gemma3_image_processor(size, mode):
    data = picture(*size, seed=3, mode=mode)
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    expected = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    ours = pixel_values(open_image(data), 896, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    torch.testing.assert_close(ours, expected.pixel_values[0], atol=1e-5, rtol=0)

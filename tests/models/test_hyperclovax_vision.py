"""HyperCLOVA X SEED Vision with images against transformers: a tiny random
HyperCLOVAXVisionV2ForConditionalGeneration (Qwen2.5-VL's tower, windows of 4x4 merged
tokens, its merger's 48 features projected by a Linear to the language model's 64; a
HyperCLOVA X SEED with every muP scalar away from 1) and HyperCLOVAXVisionV2Processor
(Qwen2VLImageProcessor's Pillow backend) make the reference inputs. Two images whose sides
the processor rounds (140x168 -> 5x6 merged tokens in four windows, 150x60 -> 140x56, 5x2
in two): the prompt ids, the pixel values, the image features, the logits of the prompt
(whole, and prefilled in chunks) and 8 greedy tokens match, every token turned by its
place; so do the logits of a text-only prompt. The folder as the Hub lays it out ("vlm",
the language model's keys under model.language_model.model.) loads as transformers loads
it. `run --image` and `chat --image` reply with transformers' tokens; the text alone runs
with a note. Image tokens not scaled by embedding_multiplier (transformers scales the
placed embeddings), or every block attending to the whole image, move the logits or
features.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json

import pytest
import torch
from exaone4_5_helpers import IMAGE
from hyperclovax_vision_helpers import (
    processor_inputs,
    save_hyperclovax_vision_dir,
    tiny_hyperclovax_vision,
)
from in_process import llmrun
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_and_chat_with_an_image,
    check_text_only_prompt,
    image_features,
    logits,
)
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.images import open_image
from llmrun.loading import safetensors_io
from llmrun.loading.hyperclovax_vision import HyperclovaxVision
from llmrun.models import hyperclovax, hyperclovax_vision
from llmrun.qwen2_vl_images import pixel_patches

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
SIZES = [(140, 168), (150, 60)]
TOKENS = [30, 10]


@pytest.fixture(scope="module")
def model():
    return tiny_hyperclovax_vision()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_hyperclovax_vision_dir(model, tmp_path_factory.mktemp("hyperclovax_vision"))


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


@pytest.fixture(scope="module")
def expected_logits(model, reference):
    with torch.no_grad():
        return model(**reference).logits[0]


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference, expected_logits
):
    assert isinstance(engine.vision, HyperclovaxVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1 : start + count + 1] == [IMAGE - 2, *[IMAGE] * count, IMAGE - 1]
    assert reference["image_grid_thw"].tolist() == [[1, 10, 12], [1, 10, 4]]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_move_the_logits_or_features(
    model, engine, images, prompt, reference, expected_logits, monkeypatch
):
    """Image tokens left unscaled by embedding_multiplier (2 here), or every block over
    the whole image instead of the windowed blocks within their windows."""
    with monkeypatch.context() as patch:
        patch.setattr(hyperclovax, "replace", lambda images, embeds: images)
        assert (logits(engine, *prompt) - expected_logits).abs().max() > 1e-2
    vision = engine.vision
    args = vars(vision.encoder.args) | {"fullatt_block_indexes": (0, 1, 2)}
    whole = hyperclovax_vision.VisionModel(hyperclovax_vision.EncoderArgs(**args))
    whole.load_state_dict(vision.encoder.state_dict())
    without_windows = HyperclovaxVision(
        whole, vision.mean, vision.std, vision.min_pixels, vision.max_pixels
    )
    family = vision_families.of_vision(vision)
    features = torch.cat(family.encode(without_windows, images))
    assert (features - image_features(model, reference)).abs().max() > 1e-2


def test_the_hubs_layout_loads_as_transformers_loads_it(folder, images, tmp_path):
    """The Hub's config.json says "vlm" (its vision_config qwen2_5_vl) and its files name
    the language model's weights model.language_model.model.*, its head
    model.language_model.lm_head.*: transformers' conversion mapping reads them so."""
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "vlm"
    config["vision_config"]["model_type"] = "qwen2_5_vl"
    config["tie_word_embeddings"] = False
    weights = {}
    for name, tensor in safetensors_io.load_tensors(folder / "model.safetensors").items():
        if name.startswith("model.language_model."):
            name = "model.language_model.model." + name[len("model.language_model.") :]
        weights[name] = tensor.contiguous()
    head = torch.randn(weights["model.language_model.model.embed_tokens.weight"].shape)
    weights["model.language_model.lm_head.weight"] = head * 0.2
    hub = tmp_path / "hub"
    hub.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (hub / file.name).write_bytes(file.read_bytes())
    (hub / "config.json").write_text(json.dumps(config))
    save_file(weights, hub / "model.safetensors", metadata={"format": "pt"})
    cls = transformers.HyperCLOVAXVisionV2ForConditionalGeneration
    model = cls.from_pretrained(hub, config=transformers.HyperCLOVAXVisionV2Config(**config))
    reference = processor_inputs(hub, images[1:], QUESTION)
    with torch.no_grad():
        expected = model.eval()(**reference).logits[0]
    loaded = api.load(str(hub), device="cpu", vision=True)
    ids, prompt_images = loaded.image_prompt(loaded.prompt_text(QUESTION, images=1), images[1:])
    assert ids == reference["input_ids"][0].tolist()
    torch.testing.assert_close(logits(loaded, ids, prompt_images), expected, atol=1e-4, rtol=0)
    # "vlm" names no family: one whose text is not HyperCLOVA X's is refused.
    config["text_config"]["model_type"] = "llama"
    (hub / "config.json").write_text(json.dumps(config))
    result = llmrun("run", str(hub), QUESTION, "-n", "1")
    assert result.returncode != 0
    assert "a 'vlm' config.json with a language model of type 'llama'" in result.stderr


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` and `llmrun chat MODEL --image PATH` from the
    folder; the folder's text alone with its usual note."""
    check_run_and_chat_with_an_image(
        model, folder, tmp_path, processor_inputs, QUESTION, "HyperCLOVA X SEED Vision"
    )

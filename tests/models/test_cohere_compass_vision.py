"""Cohere Compass with images against transformers: a tiny random
CohereCompassForConditionalGeneration (Qwen3-VL's tower: hidden 32 in 2 blocks, a 4x4 grid
of learned positions resampled to each image, the first block's features deepstacked into
the first decoder layer; a Cohere 2 language model of hidden 64: a sliding-window layer
(16) turned by interleaved M-RoPE over uneven sections [3, 3, 2], a global layer without RoPE,
logit_scale 0.5) and CohereCompassProcessor (CohereCompassImageProcessorPil, its chat
template's <|VISION_START|><|IMAGE_PAD|><|VISION_END|>) make the reference inputs. Two
images, 64x96 (2x3 merged tokens) and 96x160 (3x5): the prompt ids, the patches, the image
features, the logits of the prompt (whole, and prefilled in chunks) and 8 greedy tokens
match; so do the logits of a text-only prompt. `run --image`, `chat`'s /image and serve's
image parts reply with transformers' tokens; the text alone runs with a note. Planted bugs
fail: the M-RoPE sections taken in blocks instead of interleaved, the deepstack features
left out, the global layer turned by RoPE, the sliding window (16) ignored.

Tolerances: patches 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
from chat_processor import images_only, user_message_inputs
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
    image_features,
    logits,
)
from vision_helpers import picture

from llmrun import api
from llmrun.images import open_image
from llmrun.loading.cohere_compass_vision import CompassVision
from llmrun.models import mrope
from llmrun.qwen2_vl_images import pixel_patches

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
TOKENS = ("<|VISION_START|>", "<|IMAGE_PAD|>", "<|VISION_END|>", "<|VIDEO_PAD|>")
VISION_START, IMAGE, VISION_END, VIDEO = 512, 513, 514, 515
# Cohere's turns, an image as <|VISION_START|><|IMAGE_PAD|><|VISION_END|>.
TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROCESSOR = {
    "image_processor_type": "CohereCompassImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 4096,
    "max_pixels": 16777216,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
TEXT = dict(
    vocab_size=520,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=16,
    rope_parameters={
        "sliding_attention": {**ROPE, "mrope_interleaved": True},
        "full_attention": None,
    },
    logit_scale=0.5,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0],
)
SIZES = [(64, 96), (96, 160)]
MERGED = [6, 15]


def tiny_cohere_compass(seed: int = 0):
    """A random transformers CohereCompassForConditionalGeneration (TEXT, VISION)."""
    config = transformers.CohereCompassConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(seed)
    model = transformers.CohereCompassForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "layernorm.weight", "norm.weight")):
                p.normal_(1.0, 0.1)
    return model


def processor_inputs(folder, images: list, question: str) -> dict:
    """CohereCompassProcessor's inputs for one user message of `images` then `question`."""
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = images_only(transformers.CohereCompassProcessor)(
        image_processor=transformers.CohereCompassImageProcessorPil(**settings),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    return user_message_inputs(made, images, question, keys)


@pytest.fixture(scope="module")
def model():
    return tiny_cohere_compass()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cohere_compass")
    return save_vision_dir(model, folder, TOKENS, TEMPLATE, PROCESSOR)


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
    assert isinstance(engine.vision, CompassVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert reference["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 10]]
    for start, count in zip(prompt_images.starts, MERGED, strict=True):
        assert ids[start - 1 : start + count + 1] == [VISION_START, *[IMAGE] * count, VISION_END]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    # Each token's embedding, then its deepstack feature: transformers' two outputs.
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(
        features[:, :64], image_features(model, reference), atol=1e-4, rtol=0
    )
    (deepstack,) = out.deepstack_features  # one layer's, per image
    torch.testing.assert_close(features[:, 64:], torch.cat(deepstack), atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_move_the_logits(engine, prompt, expected_logits, monkeypatch):
    """The M-RoPE sections in blocks (Qwen2-VL's) instead of interleaved; the deepstack
    features left out; the global layer turned by RoPE; the sliding layer's window of 16
    ignored."""
    angles = mrope.angles
    planted = [
        (mrope, "angles", lambda *args, **kwargs: angles(*args[:4], interleaved=False)),
        (mrope.MRopeImages, "add_deepstack", lambda self, x, layer: x),
        (engine.model.model.layers[1].self_attn, "rotary", True),
        (engine.model.args, "sliding_window", None),
    ]
    for target, name, value in planted:
        with monkeypatch.context() as patch:
            patch.setattr(target, name, value)
            assert (logits(engine, *prompt) - expected_logits).abs().max() > 1e-2, name


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, engine, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts
    from the folder; the folder's text alone with its usual note."""
    from PIL import Image

    image = tmp_path / "photo.png"
    image.write_bytes(picture(64, 96, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    check_run_chat_and_serve_with_an_image(
        engine, folder, image, QUESTION, expected, "Cohere Compass"
    )

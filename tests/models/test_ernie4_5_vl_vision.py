"""ERNIE 4.5 VL with images against transformers: a tiny random
Ernie4_5_VLMoeForConditionalGeneration (Qwen2-VL's blocks of hidden 32 on single frames,
the resampler; ERNIE 4.5's attention with a dense layer, then a layer of 4 text and 4
narrower vision experts, top 2, a shared expert; 3D RoPE over sections [3, 3, 2]) saved as
save_pretrained writes it (the Hub's names: routers [hidden, experts], the vision experts
after the text ones) and Ernie4_5_VLMoeProcessor (Ernie4_5_VLMoeImageProcessorPil) make the
reference inputs. Two images, 56x84 (2x3 merged tokens) and 112x140 (4x5): the prompt ids,
the patches, the image features, the logits of the prompt (whole, and prefilled in chunks)
and 8 greedy tokens match; so do the logits of a text-only prompt. `run --image`, `chat`'s
/image and serve's image parts reply with transformers' tokens; the text alone runs with a
note. Planted bugs fail: the image markers routed to the text experts, the 3D RoPE's height
and width swapped, the image routed through the text experts.

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
from llmrun.loading.ernie4_5_vl_vision import Ernie45VLVision
from llmrun.models import ernie4_5_vl_moe_text
from llmrun.qwen2_vl_images import pixel_patches

transformers = pytest.importorskip("transformers")
# Ernie4_5_VLMoeProcessor's np.array of its input ids, numpy 2's warning.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
TOKENS = (
    "<|IMAGE_START|>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|IMAGE_END|>",
    "<|VIDEO_START|>",
    "<|VIDEO_PLACEHOLDER|>",
    "<|VIDEO_END|>",
)
IMAGE_START, IMAGE, IMAGE_END, VIDEO_START, VIDEO, VIDEO_END = range(512, 518)
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PROCESSOR = {
    "image_processor_type": "Ernie4_5_VLMoeImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 4842768,
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
}
TEXT = dict(
    vocab_size=520,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_num_experts=4,
    moe_k=2,
    moe_num_shared_experts=1,
    moe_intermediate_size=[32, 16],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14)
SIZES = [(56, 84), (112, 140)]
MERGED = [6, 20]


def tiny_ernie4_5_vl(seed: int = 0):
    """A random transformers Ernie4_5_VLMoeForConditionalGeneration (TEXT, VISION)."""
    config = transformers.Ernie4_5_VLMoeConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_start_token_id=IMAGE_START,
        image_token_id=IMAGE,
        image_end_token_id=IMAGE_END,
        video_start_token_id=VIDEO_START,
        video_token_id=VIDEO,
        video_end_token_id=VIDEO_END,
    )
    torch.manual_seed(seed)
    model = transformers.Ernie4_5_VLMoeForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", ".ln.weight", "after_norm.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
    return model


def processor_inputs(folder, images: list, question: str) -> dict:
    """Ernie4_5_VLMoeProcessor's inputs for one user message of `images` then `question`."""
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    for name, token in zip(
        ("image_start", "image", "image_end", "video_start", "video", "video_end"),
        TOKENS,
        strict=True,
    ):
        setattr(tokenizer, f"{name}_token", token)
        setattr(tokenizer, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    made = images_only(transformers.Ernie4_5_VLMoeProcessor)(
        image_processor=transformers.Ernie4_5_VLMoeImageProcessorPil(**settings),
        tokenizer=tokenizer,
        chat_template=TEMPLATE,
    )
    keys = (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        "mm_token_type_ids",
        "moe_mm_token_type_ids",
    )
    return user_message_inputs(made, images, question, keys)


@pytest.fixture(scope="module")
def model():
    return tiny_ernie4_5_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ernie4_5_vl")
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
    assert isinstance(engine.vision, Ernie45VLVision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert reference["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 10]]
    for start, count in zip(prompt_images.starts, MERGED, strict=True):
        assert ids[start - 1 : start + count + 1] == [IMAGE_START, *[IMAGE] * count, IMAGE_END]
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_move_the_logits(engine, prompt, expected_logits, monkeypatch):
    """The image markers routed to the text experts; the height and width of the 3D RoPE
    swapped; every token routed through the text experts."""
    angles, routed = ernie4_5_vl_moe_text.angles, ernie4_5_vl_moe_text.MoeBlock.routed

    def swapped(rotary, rope, sections, capacity):
        return angles(rotary, rope[[0, 2, 1]], sections, capacity)

    planted = [
        (engine.model, "vision_markers", ()),
        (ernie4_5_vl_moe_text, "angles", swapped),
        (ernie4_5_vl_moe_text.MoeBlock, "routed", lambda self, x, modality: routed(self, x, 0)),
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
    image.write_bytes(picture(56, 84, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    check_run_chat_and_serve_with_an_image(
        engine, folder, image, QUESTION, expected, "ERNIE 4.5 VL"
    )

"""VideoLLaMA3 with images against transformers: a tiny random
VideoLlama3ForConditionalGeneration (a SigLIP of hidden 32 in 2 layers with a 2D RoPE and
no position table, patches of 14 pixels each a token, a Linear-GELU-Linear projector; Qwen2
text of hidden 64) and VideoLlama3Processor (VideoLlama3ImageProcessorPil) make the
reference inputs. Two images, 56x84 (4x6 patches) and 70x112 (5x8): the prompt ids, the
patches, the image features, the logits of the prompt (whole, and prefilled in chunks) and
8 greedy tokens match; so do the logits of a text-only prompt. `run --image`, `chat`'s
/image and serve's image parts reply with transformers' tokens; the text alone runs with a
note. Planted bugs fail: the 2D RoPE's rows and columns swapped, the tower's final
LayerNorm left out.

Tolerances: patches 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import pytest
import torch
from chat_processor import images_only, user_message_inputs
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from qwen2_vl_helpers import QWEN_TOKENS  # ids 512 on, after stories260K's 512
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
    logits,
)
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.images import open_image
from llmrun.models import video_llama_3_vision
from llmrun.qwen2_vl_images import pixel_patches

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTION = "What is in these pictures?"
IMAGE, VIDEO = 516, 517
# Qwen's ChatML, an image as <|image_pad|>.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image_pad|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {
    "image_processor_type": "VideoLlama3ImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 3136,
    "max_pixels": 1003520,
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 1,
}
TEXT = dict(
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=520,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=14
)
SIZES = [(56, 84), (70, 112)]
TOKENS = [24, 40]


def tiny_video_llama_3(seed: int = 0):
    """A random transformers VideoLlama3ForConditionalGeneration (TEXT, VISION)."""
    config = transformers.VideoLlama3Config(
        text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO
    )
    torch.manual_seed(seed)
    model = transformers.VideoLlama3ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
                p.normal_(1.0, 0.1)
    return model


def processor_inputs(folder, images: list, question: str) -> dict:
    """VideoLlama3Processor's inputs for one user message of `images` then `question`."""
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = images_only(transformers.VideoLlama3Processor)(
        image_processor=transformers.VideoLlama3ImageProcessorPil(**settings),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "image_merge_sizes")
    return user_message_inputs(made, images, question, keys)


@pytest.fixture(scope="module")
def model():
    return tiny_video_llama_3()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("video_llama_3")
    return save_vision_dir(model, folder, QWEN_TOKENS, TEMPLATE, PROCESSOR)


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
    assert vision_families.of_vision(engine.vision).name == "VideoLLaMA3"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert reference["image_grid_thw"].tolist() == [[1, 4, 6], [1, 5, 8]]
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    ours = torch.cat([pixel_patches(image, engine.vision)[0] for image in images])
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-5, rtol=0)
    with torch.no_grad():
        out = model.model.get_image_features(
            reference["pixel_values"], reference["image_grid_thw"], reference["image_merge_sizes"]
        )
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, torch.cat(out.pooler_output), atol=1e-4, rtol=0)
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_move_the_logits(engine, images, expected_logits, monkeypatch):
    """The 2D RoPE's rows and columns swapped; the tower's final LayerNorm left out (each
    image encoded again, under the bug)."""
    angles = video_llama_3_vision.rotary_angles
    planted = [
        (video_llama_3_vision, "rotary_angles", lambda args, h, w: swapped(angles, args, h, w)),
        (engine.vision.encoder.vision_model, "post_layernorm", torch.nn.Identity()),
    ]
    for target, name, value in planted:
        with monkeypatch.context() as patch:
            patch.setattr(target, name, value)
            prompt = engine.image_prompt(engine.prompt_text(QUESTION, images=2), images)
            assert (logits(engine, *prompt) - expected_logits).abs().max() > 1e-2, name


def swapped(angles, args, grid_h: int, grid_w: int):
    """rotary_angles with each patch's row and column exchanged."""
    cos, sin = angles(args, grid_w, grid_h)
    # [w * h, D] by (column, row) -> by (row, column)
    order = torch.arange(grid_w * grid_h).view(grid_w, grid_h).T.flatten()
    return cos[order], sin[order]


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, engine, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts
    from the folder; the folder's text alone with its usual note."""
    from PIL import Image

    image = tmp_path / "photo.png"
    image.write_bytes(picture(56, 84, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "VideoLLaMA3")

"""LLaVA's kin with images against transformers, through llmrun's LLaVA code: tiny random
VipLlavaForConditionalGeneration (CLIP hidden states of three layers, -2, -4 and 1, each
without its class token, concatenated, through a LayerNorm and the two-layer MLP),
VideoLlavaForConditionalGeneration (its image tower; the video tower, another CLIP, not
read) and LlavaNextVideoForConditionalGeneration (LLaVA-NeXT's tiles and image_newline),
each with Llama text of hidden 64 in 2 layers and a CLIP of hidden 32 on 32-pixel tiles
(llava_helpers), saved as save_pretrained writes them. Their processors (LlavaProcessor
with LlavaImageProcessorPil, as vip-llava-7b-hf's; VideoLlavaProcessor with
VideoLlavaImageProcessor; LlavaNextVideoProcessor with LlavaNextImageProcessorPil) make the
reference inputs for two images, 40x64 and 70x50: the prompt ids, the pixels, the image
features, the logits (whole, and prefilled in chunks) and 8 greedy tokens match; so do a
text-only prompt's logits. `run --image`, `chat`'s /image and serve's image parts reply
with transformers' tokens; the text alone runs with a note. Planted: VipLLaVA's projector
norm skipped, Video-LLaVA's video tower read for images, and LLaVA-NeXT-Video read as a
LLaVA 1.5 each fail. Videos are not taken.

Tolerances: ids exact; pixels 1e-5; features and logits 1e-4 (absolute); tokens exact.
"""

import pytest
import torch
from chat_processor import images_only
from helpers import randomize
from llava_helpers import (
    IMAGE,
    LLAVA_TEMPLATE,
    PATCH,
    PINPOINTS,
    TEXT,
    VISION,
    processor_settings,
    save_llava_dir,
)
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
)
from vision_helpers import picture

from llmrun import api, llava_images, vision_families
from llmrun.errors import ModelFormatError
from llmrun.images import open_image
from llmrun.loading import llava_vision as llava_loading
from llmrun.models import llava_vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

QUESTION = "What is in these pictures?"
SIZES = [(40, 64), (70, 50)]
VIDEO = 514  # an unused id: no video is given
NAMES = {
    "vipllava": "VipLLaVA",
    "video_llava": "Video-LLaVA",
    "llava_next_video": "LLaVA-NeXT-Video",
}


def tiny_model(kind: str, seed: int = 0):
    """A random transformers model of `kind` (its model_type)."""
    outer = dict(text_config=TEXT, image_token_index=IMAGE, tie_word_embeddings=False)
    if kind == "vipllava":
        vision = {**VISION, "num_hidden_layers": 4}
        config = transformers.VipLlavaConfig(
            **outer, vision_config=vision, vision_feature_layer=[-2, -4, 1]
        )
        model_class = transformers.VipLlavaForConditionalGeneration
    elif kind == "video_llava":
        config = transformers.VideoLlavaConfig(
            **outer, vision_config=VISION, video_token_index=VIDEO, vision_feature_layer=-2
        )
        model_class = transformers.VideoLlavaForConditionalGeneration
    else:
        config = transformers.LlavaNextVideoConfig(
            **outer,
            vision_config=VISION,
            video_token_index=VIDEO,
            image_grid_pinpoints=PINPOINTS,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )
        model_class = transformers.LlavaNextVideoForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "layrnorm.weight")):
                p.normal_(1.0, 0.1)
    return model


def save_folder(model, path):
    kind = model.config.model_type
    settings = processor_settings(kind == "llava_next_video")
    if kind == "video_llava":
        settings["image_processor_type"] = "VideoLlavaImageProcessor"
    return save_llava_dir(model, path, **settings)


def processor_inputs(kind: str, folder, images: list, question: str) -> dict:
    """The kind's processor's inputs for one user message of `images` then `question`, with
    the generation prompt (the tokenizer's BOS first)."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )
    from transformers.models.video_llava.image_processing_video_llava import (
        VideoLlavaImageProcessor,
    )

    settings = processor_settings(kind == "llava_next_video")
    del settings["image_processor_type"]
    common = dict(
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    if kind == "vipllava":
        made = transformers.LlavaProcessor(
            image_processor=LlavaImageProcessorPil(**settings), **common
        )
    elif kind == "video_llava":
        made = images_only(transformers.VideoLlavaProcessor)(
            image_processor=VideoLlavaImageProcessor(**settings), video_processor=None, **common
        )
    else:
        made = images_only(transformers.LlavaNextVideoProcessor)(
            image_processor=LlavaNextImageProcessorPil(**settings), video_processor=None, **common
        )
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(made(text=text, images=images, return_tensors="pt"))


def image_features(model, inputs: dict) -> torch.Tensor:
    """transformers' soft tokens of the inputs' images, all images' in order."""
    with torch.no_grad():
        if "pixel_values_images" in inputs:  # Video-LLaVA's
            out = model.model.get_image_features(inputs["pixel_values_images"]).pooler_output
        elif "image_sizes" in inputs:
            out = model.model.get_image_features(
                inputs["pixel_values"], image_sizes=inputs["image_sizes"]
            ).pooler_output
        else:
            out = model.model.get_image_features(inputs["pixel_values"]).pooler_output
    return torch.cat(list(out)) if isinstance(out, list | tuple) else out.flatten(0, 1)


@pytest.fixture(scope="module", params=list(NAMES))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def model(kind):
    return tiny_model(kind)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_folder(model, tmp_path_factory.mktemp(model.config.model_type))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(h, w, seed)) for seed, (h, w) in enumerate(SIZES, start=1)]


@pytest.fixture(scope="module")
def reference(kind, folder, images):
    return processor_inputs(kind, folder, images, QUESTION)


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    kind, model, engine, images, reference
):
    assert vision_families.of_vision(engine.vision).name == "LLaVA 1.5/NeXT"
    prompt = engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert ids.count(IMAGE) == sum(len(e) for e in prompt_images.embeds)
    assert [engine.image_tokens(image) for image in images] == [
        len(e) for e in prompt_images.embeds
    ]
    pixels = reference.get("pixel_values_images", reference.get("pixel_values"))
    for i, image in enumerate(images):
        ours = llava_images.pixel_values(engine.vision, image)
        expected = pixels[i][: len(ours)] if pixels.dim() == 5 else pixels[i : i + 1]
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_planted_bugs_fail(kind, model, folder, engine, images, reference, monkeypatch):
    """VipLLaVA's projector norm skipped; Video-LLaVA's video tower read for its images;
    LLaVA-NeXT-Video's tiles read as LLaVA 1.5's (no image_newline, one tile)."""
    expected = image_features(model, reference)
    if kind == "llava_next_video":
        monkeypatch.setattr(llava_loading, "NEWLINE_MODEL_TYPES", ("llava_next",))
        monkeypatch.setattr(llava_vision, "NEWLINE_MODEL_TYPES", ("llava_next",))
        with pytest.raises(ModelFormatError):
            llava_loading.from_hf_dir(folder, TEXT["hidden_size"])
        return
    if kind == "vipllava":
        monkeypatch.setattr(
            engine.vision.encoder.multi_modal_projector, "projector_layernorm", None
        )
        vision = engine.vision
    else:
        prefixes = {
            k.replace("image_tower", "video_tower"): v
            for k, v in llava_loading._HF_PREFIXES.items()
            if "vision_tower" not in k
        }
        monkeypatch.setattr(llava_loading, "_HF_PREFIXES", prefixes)
        vision = llava_loading.from_hf_dir(folder, TEXT["hidden_size"])
    ours = torch.cat(llava_images.encode(vision, images))
    assert (ours - expected).abs().max() > 1e-2


def test_run_chat_and_serve_with_an_image_reply_as_transformers(
    kind, model, folder, engine, tmp_path
):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(60, 90, seed=6))
    inputs = processor_inputs(kind, folder, [Image.open(image)], QUESTION)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(expected) == 8 and len(set(expected)) > 1
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, NAMES[kind])


def test_vipllava_s_feature_layers_under_either_name_or_none():
    """The Hub's vip-llava-7b-hf names them vision_feature_layers; VipLlavaConfig's default
    is [-2, -5, -8, -11, 6]: hidden states 11, 8, 5, 2 and 6 of a 12-layer tower."""
    config = {
        "model_type": "vipllava",
        "vision_config": {**VISION, "num_hidden_layers": 12},
        "text_config": TEXT,
    }
    expected = [11, 8, 5, 2, 6]
    assert llava_vision.EncoderArgs.from_config(config).feature_layers == expected
    hub = {**config, "vision_feature_layers": [-2, -5, -8, -11, 6]}
    assert llava_vision.EncoderArgs.from_config(hub).feature_layers == expected
    reference = transformers.VipLlavaConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    assert list(reference.vision_feature_layer) == [-2, -5, -8, -11, 6]

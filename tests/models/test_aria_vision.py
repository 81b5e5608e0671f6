"""Aria (Idefics3's SigLIP tower, a cross-attention projector of learned queries; a mixture
of experts in every text layer, run as llmrun's DeepSeek V1) with images against
transformers: a tiny random AriaForConditionalGeneration (text hidden 64 in 2 layers of 4
experts, top 2, 2 shared; vision hidden 32 in 2 layers of 14-pixel patches on 490-pixel
squares, 8 queries a crop) and AriaProcessor (AriaImageProcessorPil, max_image_size 490,
min_image_size 336) make the reference inputs. Two images, 40x64 and 300x250 (490x408 once
resized: 29 whole patches across and a part), and with split_image one 150x400 (two
tiles of 490): the prompt ids, the real patches' pixels, the image features, the logits
(whole, and prefilled in chunks) and 8 greedy tokens match; so do a text-only prompt's
logits. `run --image`, `chat`'s /image and serve's image parts reply with transformers'
tokens; the text alone runs with a note. Partial patches left out, or the routing weights
not renormalized over the chosen experts, fail. llama.cpp has no Aria converter: no mmproj.

Tolerances: ids exact; pixels 1e-6; features and logits 1e-4 (absolute); tokens exact.
"""

import dataclasses
import json

import pytest
import torch
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from vision_checks import (
    check_logits_chunks_and_greedy,
    check_run_chat_and_serve_with_an_image,
    check_text_only_prompt,
)
from vision_helpers import picture

from llmrun import api, aria_images, vision_families
from llmrun.errors import UnsupportedError
from llmrun.images import open_image
from llmrun.loading import aria_vision as aria_loading
from llmrun.loading import vl_text

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from transformers.models.aria.image_processing_pil_aria import AriaImageProcessorPil  # noqa: E402

QUESTION = "What is in these pictures?"
# Ids 512 on, after stories260K's 512 tokens.
TOKENS = ("<fim_prefix>", "<|img|>", "<fim_suffix>", "<|im_start|>", "<|im_end|>")
IMAGE = 513
QUERIES = 8
# rhymes-ai/Aria's chat template, for an image part and text.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% elif item['type'] == 'image' %}<fim_prefix><|img|><fim_suffix>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SIZES = [(40, 64), (300, 250)]


def processor_settings(split: bool = False) -> dict:
    return {
        "image_processor_type": "AriaImageProcessor",
        "max_image_size": 490,
        "min_image_size": 336,
        "split_image": split,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
    }


def tiny_aria(seed: int = 0):
    """A random AriaForConditionalGeneration: an Aria text model of hidden 64 in two layers
    of 4 experts (top 2) and 2 shared ones, a SigLIP tower of hidden 32 in two layers."""
    text = dict(
        model_type="aria_text",
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512 + len(TOKENS),
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        moe_num_experts=4,
        moe_topk=2,
        moe_num_shared_experts=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=490,
        patch_size=14,
    )
    config = transformers.AriaConfig(
        text_config=text,
        vision_config=vision,
        projector_patch_to_query_dict={1225: QUERIES, 4900: 2 * QUERIES},
        image_token_id=IMAGE,
    )
    torch.manual_seed(seed)
    model = transformers.AriaForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "norm_kv.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith(("layer_norm.weight", "post_layernorm.weight")):
                p.normal_(1.0, 0.1)
    return model


def save_folder(model, path, split: bool = False):
    save_vision_dir(model, path, TOKENS, TEMPLATE, processor_settings(split))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["extra_special_tokens"] = {"image_token": "<|img|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def processor_inputs(folder, images: list, question: str, split: bool = False) -> dict:
    """AriaProcessor's inputs for one user message of `images` then `question`."""
    settings = processor_settings(split)
    del settings["image_processor_type"]
    processor = transformers.AriaProcessor(
        image_processor=AriaImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
        size_conversion={490: QUERIES, 980: 2 * QUERIES},
    )
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # AriaProcessor's own defaults (max_image_size 980) win over its image processor's.
    sizes = {"max_image_size": settings["max_image_size"], "split_image": split}
    inputs = processor(
        text=text, images=images, return_tensors="pt", add_special_tokens=False, **sizes
    )
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_mask")}


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["pixel_mask"])
    return out.pooler_output.flatten(0, 1)


def check_pixels(vision, images, reference) -> None:
    """Each crop's real patches are the processor's (its padded square's corner)."""
    ours = [p for image in images for p in aria_images.pixel_values(vision, image)]
    assert len(ours) == len(reference["pixel_values"])
    for pixels, expected in zip(ours, reference["pixel_values"], strict=True):
        height, width = pixels.shape[1:]
        torch.testing.assert_close(pixels, expected[:, :height, :width], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def model():
    return tiny_aria()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_folder(model, tmp_path_factory.mktemp("aria"))


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


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, images, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "Aria"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert [len(e) for e in prompt_images.embeds] == [QUERIES, QUERIES]
    assert [engine.image_tokens(image) for image in images] == [QUERIES, QUERIES]
    check_pixels(engine.vision, images, reference)
    # The second: 29 whole patches and a part across, all 35 down.
    assert aria_images.pixel_values(engine.vision, images[1])[0].shape[1:] == (490, 420)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 20
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)


def test_a_text_only_prompt_is_transformers(model, engine):
    check_text_only_prompt(model, engine, QUESTION)


def test_split_images_are_the_processors(model, tmp_path):
    folder = save_folder(model, tmp_path / "split", split=True)
    engine = api.load(str(folder), device="cpu", vision=True)
    image = open_image(picture(150, 400, 3))
    reference = processor_inputs(folder, [image], QUESTION, split=True)
    ids, prompt_images = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])
    assert ids == reference["input_ids"][0].tolist()
    assert len(prompt_images.embeds[0]) == 2 * QUERIES == engine.image_tokens(image)
    check_pixels(engine.vision, [image], reference)
    expected = image_features(model, reference)
    torch.testing.assert_close(prompt_images.embeds[0], expected, atol=1e-4, rtol=0)


def test_planted_bugs_fail(model, folder, engine, images, reference, monkeypatch):
    """The crops' partial patches left out (whole patches only, as Idefics2 and Idefics3
    take them); the chosen experts' weights a softmax over all experts, not renormalized."""
    expected = image_features(model, reference)
    whole = aria_images.math.floor
    monkeypatch.setattr(aria_images.math, "ceil", whole)
    ours = torch.cat(aria_images.encode(engine.vision, images))
    assert (ours - expected).abs().max() > 1e-2
    monkeypatch.undo()
    aria = vl_text.FAMILIES[vl_text.ARIA]

    def unrenormalized(config):
        return {**aria.from_outer(config), "norm_topk_prob": False}

    monkeypatch.setitem(
        vl_text.FAMILIES, vl_text.ARIA, dataclasses.replace(aria, from_outer=unrenormalized)
    )
    planted = api.load(str(folder), device="cpu")
    ids = planted.tokenizer.encode(planted.prompt_text(QUESTION))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
        ours = planted.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    assert (ours - expected).abs().max() > 1e-2


def test_there_is_no_mmproj(tmp_path):
    with pytest.raises(UnsupportedError, match="no Aria projector"):
        aria_loading.from_mmproj(tmp_path / "mmproj.gguf", 64)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    assert len(expected) == 8 and len(set(expected)) > 1
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "Aria")


def test_the_hub_s_layout_loads_alike(model, folder, engine, images, prompt, tmp_path):
    """rhymes-ai/Aria's names (language_model.model.*, experts fc1/fc2, vision_tower.*,
    multi_modal_projector.*), which transformers renames on loading, give the same
    weights, prompt and image features."""
    import shutil

    from safetensors.torch import load_file, save_file

    hub = shutil.copytree(folder, tmp_path / "hub")
    (file,) = hub.glob("*.safetensors")
    renames = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        (".mlp.experts.gate_up_proj", ".mlp.experts.fc1.weight"),
        (".mlp.experts.down_proj", ".mlp.experts.fc2.weight"),
    )
    tensors = {}
    for name, tensor in load_file(file).items():
        for old, new in renames:
            name = name.replace(old, new) if old in name else name
        tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})
    loaded = transformers.AriaForConditionalGeneration.from_pretrained(hub)
    expected = model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.state_dict().items())
    other = api.load(str(hub), device="cpu", vision=True)
    ids, prompt_images = prompt
    ours = other.image_prompt(other.prompt_text(QUESTION, images=len(images)), images)
    assert ours[0] == ids
    assert torch.equal(torch.cat(ours[1].embeds), torch.cat(prompt_images.embeds))
    theirs, ours_ = other.model.state_dict(), engine.model.state_dict()
    assert theirs.keys() == ours_.keys()
    assert all(torch.equal(t, ours_[k]) for k, t in theirs.items())

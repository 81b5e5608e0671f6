"""Command A Vision (cohere2_vision: SigLIP, pixel shuffle, SwiGLU projector, Cohere2 text)
with images against transformers: a tiny random Cohere2VisionForConditionalGeneration (text
hidden 64 in 2 layers, one sliding and one global; SigLIP hidden 32 in 2 layers on 32-pixel
tiles of 8-pixel patches, 2x2 shuffled: 4 tokens a tile, up to 4 tiles). Three images:
48x150 (4 tiles in a row and a thumbnail), 70x60 (2x2 tiles and a thumbnail) and 20x25 (one
tile, upscaled). The prompt ids and tiles are Cohere2VisionProcessor's (stored in
tests/data/cohere2_vision_processor.json: its image processor needs torchvision; checked
live where torchvision is installed); the image features, the logits and 8 greedy tokens
are Cohere2VisionForConditionalGeneration's on those tiles. A pixel shuffle of another
order, or InternVL's tiling (the nearest aspect), fails.

transformers' Cohere2VisionForConditionalGeneration leaves out the text model's logit_scale
(Cohere2ForCausalLM's, vLLM's and llmrun's apply it): its logits are compared times the
scale (0.5 here); greedy tokens are the same either way.

Tolerances: tiles 1e-5 (sums of the stored ones to 1e-6 relative); f32 image features and
logits 1e-4.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import STORIES_HF, randomize
from image_serving import check_reply_is_run_s
from in_process import llmrun
from serving import chat_reply, served
from vision_helpers import picture

from llmrun import api, cohere2_vision_images, internvl_images
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.models import cohere2_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

STORED = Path(__file__).parent.parent / "data" / "cohere2_vision_processor.json"
# Ids 512 on, after stories260K's 512 tokens.
COHERE_TOKENS = (
    "<|START_OF_TURN_TOKEN|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|START_OF_IMG|>",
    "<|END_OF_IMG|>",
    "<|IMG_PATCH|>",
    "<|IMG_LINE_BREAK|>",
)
IMG_START, IMG_END, IMG_PATCH, LINE_BREAK = 516, 517, 518, 519
TILE, PATCH, TOKENS_PER_TILE = 32, 8, 4
# Command A's turns; each image part an <|IMG_PATCH|>, as the processor expands it.
TEMPLATE = (
    "{% for message in messages %}<|START_OF_TURN_TOKEN|>"
    "{% if message['role'] == 'user' %}<|USER_TOKEN|>{% else %}<|CHATBOT_TOKEN|>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|IMG_PATCH|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
)
QUESTION = "What is in these pictures?"
IMAGES = ((48, 150, 1), (70, 60, 2), (20, 25, 3))  # height, width, seed
GREEDY = SamplingParams(temperature=0.0)
LOGIT_SCALE = 0.5


def tiny_model():
    config = transformers.Cohere2VisionConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=TILE,
            patch_size=PATCH,
        ),
        text_config=dict(
            model_type="cohere2",
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=520,
            max_position_embeddings=512,
            logit_scale=LOGIT_SCALE,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            bos_token_id=1,
            eos_token_id=2,
        ),
        downsample_factor=2,
        alignment_intermediate_size=48,
        image_token_id=IMG_PATCH,
    )
    torch.manual_seed(0)
    model = transformers.Cohere2VisionForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_folder(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with stories260K's tokenizer plus
    COHERE_TOKENS (the processor's image tokens named in extra_special_tokens), TEMPLATE
    and Cohere2VisionImageProcessor's settings for TILE-pixel tiles."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(COHERE_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
        "extra_special_tokens": {
            "image_token": "<|IMG_PATCH|>",
            "boi_token": "<|START_OF_IMG|>",
            "eoi_token": "<|END_OF_IMG|>",
            "img_line_break_token": "<|IMG_LINE_BREAK|>",
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor = {
        "image_processor_type": "Cohere2VisionImageProcessor",
        "crop_to_patches": True,
        "max_patches": 4,
        "min_patches": 1,
        "patch_size": 2,  # the soft tokens of a tile's side
        "resample": 3,
        "size": {"height": TILE, "width": TILE},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Sums that a wrong pixel, tile or order changes: the plain sum, and one weighted by
    each value's place."""
    flat = pixels.double().flatten()
    weights = torch.cos(torch.arange(len(flat), dtype=torch.float64) * 0.01)
    return [flat.sum().item(), (flat * weights).sum().item()]


def processor_record(folder: Path) -> dict:
    """Cohere2VisionProcessor's input_ids and tiles for one user message of IMAGES then
    QUESTION (needs torchvision)."""
    processor = transformers.Cohere2VisionProcessor(
        image_processor=transformers.Cohere2VisionImageProcessor.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    content = [{"type": "image"}] * len(IMAGES) + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [open_image(picture(*image)) for image in IMAGES]
    inputs = processor(
        text=text, images=images, return_tensors="pt", add_special_tokens=False, padding=False
    )
    return {
        "input_ids": inputs["input_ids"][0].tolist(),
        "tiles": len(inputs["pixel_values"]),
        "pixel_sums": pixel_sums(inputs["pixel_values"]),
    }


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_folder(model, tmp_path_factory.mktemp("cohere2_vision"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(*image)) for image in IMAGES]


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


@pytest.fixture(scope="module")
def tiles(engine, images):
    return torch.cat([cohere2_vision_images.pixel_values(engine.vision, i) for i in images])


def image_features(model, tiles) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(tiles).pooler_output.flatten(0, 1)


def test_the_prompt_and_tiles_are_the_processors(engine, images, prompt, tiles):
    stored = json.loads(STORED.read_text())
    ids, prompt_images = prompt
    assert ids == stored["input_ids"]
    assert len(tiles) == stored["tiles"] == 11
    assert pixel_sums(tiles) == pytest.approx(stored["pixel_sums"], rel=1e-6, abs=1e-3)
    assert [engine.image_tokens(i) for i in images] == [5 * 5 + 2, 5 * 5 + 2, 5 + 2]
    # Each image's span: its tiles' soft tokens, each tile closed by a line break.
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start - 1] == IMG_START and ids[start + len(embeds)] == IMG_END
        assert ids[start + TOKENS_PER_TILE] == LINE_BREAK


def test_the_stored_inputs_are_the_processors_own(folder):
    pytest.importorskip("torchvision")
    live, stored = processor_record(folder), json.loads(STORED.read_text())
    assert (live["input_ids"], live["tiles"]) == (stored["input_ids"], stored["tiles"])
    assert live["pixel_sums"] == pytest.approx(stored["pixel_sums"], rel=1e-6, abs=1e-3)


def test_features_logits_and_greedy_tokens_match_transformers(model, engine, prompt, tiles):
    ids, prompt_images = prompt
    features = torch.cat(
        [e.view(-1, TOKENS_PER_TILE + 1, e.shape[1])[:, :-1] for e in prompt_images.embeds]
    )
    expected = image_features(model, tiles)
    torch.testing.assert_close(features.flatten(0, 1), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
        theirs = model(input_ids=torch.tensor([ids]), pixel_values=tiles).logits[0]
    torch.testing.assert_close(ours, theirs * LOGIT_SCALE, atol=1e-4, rtol=0)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), pixel_values=tiles, max_new_tokens=8, do_sample=False
        )
    expected_tokens = out[0, len(ids) :].tolist()
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected_tokens
    assert len(expected_tokens) == 8


def test_a_pixel_shuffle_of_another_order_or_internvls_tiling_fails(
    model, engine, images, tiles, monkeypatch
):
    shuffle = cohere2_vision.pixel_shuffle

    def transposed(states, scale):
        side = int(states.shape[1] ** 0.5)
        grid = states.view(states.shape[0], side, side, -1).transpose(1, 2)
        return shuffle(grid.reshape(states.shape), scale)

    with monkeypatch.context() as patch:
        patch.setattr(cohere2_vision, "pixel_shuffle", transposed)
        features = torch.cat(cohere2_vision_images.encode(engine.vision, images)).flatten(0, 1)
    assert (features - image_features(model, tiles)).abs().max() > 1e-2
    monkeypatch.setattr(
        cohere2_vision_images,
        "tile_grid",
        lambda h, w, tile, most: internvl_images.tile_grid(h, w, tile, 1, most),
    )
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)
    assert ids != json.loads(STORED.read_text())["input_ids"]


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|IMG_PATCH\|>\) for 3"):
        engine.image_prompt("<|USER_TOKEN|><|IMG_PATCH|>three?", images)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    image = tmp_path / "cat.png"
    image.write_bytes(picture(*IMAGES[1]))
    opened = [open_image(image.read_bytes())]
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=1), opened)
    tiles = cohere2_vision_images.pixel_values(engine.vision, opened[0])
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), pixel_values=tiles, max_new_tokens=8, do_sample=False
        )
    expected = out[0, len(ids) :].tolist()
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, "--image", image, QUESTION, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", folder, *options, input=f"/image {image}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    for client in served(engine, "cohere2_vision"):
        served_reply = chat_reply(client, image.read_bytes(), QUESTION)
        check_reply_is_run_s(served_reply, engine, (image.read_bytes(), QUESTION), expected, len(ids))  # fmt: skip
    text = llmrun("run", folder, QUESTION, "-n", "2", "--temperature", "0")
    assert text.returncode == 0, text.stderr
    assert "a multimodal Command A Vision; running its language model" in text.stderr


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [("size", {"height": 40, "width": 40}, "not square tiles of the vision tower's 32"),
     ("patch_size", 3, "the encoder makes 4 tokens a tile")],
)  # fmt: skip
def test_a_processor_that_does_not_fit_the_tower_is_one_error_line(
    folder, tmp_path, setting, value, message
):
    import shutil

    other = shutil.copytree(folder, tmp_path / "odd")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**settings, setting: value}))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(*IMAGES[2]))
    result = llmrun("run", other, "--image", image, "hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

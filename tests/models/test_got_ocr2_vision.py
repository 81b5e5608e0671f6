"""GOT-OCR 2.0 with an image against transformers: a tiny random
GotOcr2ForConditionalGeneration (SAM ViT with windowed and global layers, the widening
convolutions and linear projector, Qwen2 text) and GotOcr2Processor (GotOcr2ImageProcessor's
Pillow backend, its own fixed OCR conversation) make the reference inputs. The folder's chat
template writes that conversation for an image then a text part. The prompt ids, the pixel
values, the image features, the logits and 8 greedy tokens match; `run --image` replies as
generate does. Features with the relative positions left out differ.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json
from pathlib import Path

import pytest
import torch
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from vision_helpers import picture

from llmrun import api
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.got_ocr2_images import pixel_values
from llmrun.images import open_image
from llmrun.loading.got_ocr2_vision import GotOcr2Vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (  # noqa: E402
    GotOcr2ImageProcessorPil,
)

GREEDY = SamplingParams(temperature=0.0)
# Ids 512 on, after stories260K's 512 tokens.
GOT_TOKENS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>")
IMAGE = 516
VOCAB = 520
SIZE = 128  # 8x8 patches of 16, downsampled to 2x2: 4 tokens
TOKENS = 4
# GotOcr2Processor's fixed query for plain OCR, its leading space included.
QUESTION = " OCR: "
# The conversation GotOcr2Processor writes, as a chat template.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You should follow the instructions carefully and explain your answers in detail."
    "<|im_end|>{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<img><imgpad></img>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {
    "image_processor_type": "GotOcr2ImageProcessor",
    "size": {"height": SIZE, "width": SIZE},
    "crop_to_patches": False,
}


def tiny_got_ocr2(seed: int = 0):
    """A random GotOcr2ForConditionalGeneration: a Qwen2 of hidden 64 in two layers (its
    head tied, GotOcr2Config's default), SAM of hidden 32 in two layers (a window of 4,
    then a global one) on 128-pixel images."""
    text = dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        hidden_size=32,
        output_channels=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=16,
        mlp_dim=48,
        window_size=4,
        global_attn_indexes=[1],
    )
    config = transformers.GotOcr2Config(
        text_config=text, vision_config=vision, image_token_index=IMAGE
    )
    torch.manual_seed(seed)
    model = transformers.GotOcr2ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def processor_inputs(folder: Path, image) -> dict:
    """GotOcr2Processor's inputs for one image, with its own OCR prompt."""
    processor = transformers.GotOcr2Processor(
        image_processor=GotOcr2ImageProcessorPil(size={"height": SIZE, "width": SIZE}),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
    )
    # Without stories260K's BOS: GOT-OCR 2.0's Qwen tokenizer adds none.
    inputs = processor(
        images=image, num_image_tokens=TOKENS, return_tensors="pt", add_special_tokens=False
    )
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


@pytest.fixture(scope="module")
def model():
    return tiny_got_ocr2()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("got_ocr2")
    return save_vision_dir(model, folder, GOT_TOKENS, TEMPLATE, PROCESSOR)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def image():
    return open_image(picture(90, 70, seed=1))


@pytest.fixture(scope="module")
def reference(folder, image):
    return processor_inputs(folder, image)


@pytest.fixture(scope="module")
def prompt(engine, image):
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    return engine.image_prompt(engine.render([{"role": "user", "content": content}]), [image])


def test_the_prompt_and_pixels_are_the_processors(engine, image, prompt, reference):
    assert isinstance(engine.vision, GotOcr2Vision)
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert prompt_images.starts == [ids.index(IMAGE)]
    assert ids.count(IMAGE) == TOKENS == engine.image_tokens(image)
    ours = pixel_values(engine.vision, image)
    torch.testing.assert_close(ours, reference["pixel_values"][0], atol=1e-5, rtol=0)


def test_features_logits_and_tokens_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        features = model.model.get_image_features(reference["pixel_values"]).pooler_output[0]
        expected = model(**reference).logits[0]
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    torch.testing.assert_close(prompt_images.embeds[0], features, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    assert len(tokens) == 8
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == tokens


def test_features_without_relative_positions_differ(engine, image, prompt):
    """The relative-position bias is what the windowed and global layers add to the
    attention: zeroing it must show."""
    encoder = engine.vision.encoder
    saved = {k: v.clone() for k, v in encoder.state_dict().items() if "rel_pos" in k}
    try:
        with torch.no_grad():
            for name in saved:
                encoder.get_parameter(name).zero_()
            planted = encoder(pixel_values(engine.vision, image)[None])[0]
    finally:
        encoder.load_state_dict(saved, strict=False)
    assert (planted - prompt[1].embeds[0]).abs().max() > 1e-2


def test_image_places_must_match_the_images(engine, image):
    with pytest.raises(UsageError, match=r"marks 0 image places \(<imgpad>\) for 1"):
        engine.image_prompt("<|im_start|>user\nOCR: <|im_end|>", [image])


def test_run_with_an_image_replies_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` from the folder; with --raw and the
    processor's whole conversation, for files whose template writes no image place; and
    `chat` with /image."""
    from in_process import llmrun
    from PIL import Image

    path = tmp_path / "page.png"
    path.write_bytes(picture(60, 100, seed=2))
    image = open_image(path.read_bytes())
    expected = greedy_tokens(model, processor_inputs(folder, Image.open(path)))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    conversation = engine.render([{"role": "user", "content": content}])
    for prompt_args in ([QUESTION], ["--raw", conversation]):
        args = [str(folder), "--image", str(path), *prompt_args, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    stream = engine.tokenizer.stream(after=engine.image_prompt(conversation, [image])[0])
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", str(folder), "-n", "8", "--temperature", "0", input=f"/image {path}\n{QUESTION}")  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"


def test_serve_replies_to_an_image_part_and_to_text_alone(engine):
    """/v1/chat/completions with an image_url part replies as the single-sequence loop
    does; a text-only message to the same served model too."""
    from serving import alone, chat_reply, served

    page = picture(80, 60, seed=3)
    ids = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hello"}]))
    text_only = list(engine.generate(ids, GREEDY, 8))
    for client in served(engine, "got"):
        text, tokens = alone(engine, page, QUESTION)
        reply = chat_reply(client, page, QUESTION)
        assert reply["choices"][0]["message"]["content"] == text
        assert reply["usage"]["completion_tokens"] == len(tokens)
        reply = chat_reply(client, "Hello")
        assert reply["choices"][0]["message"]["content"] == "".join(r.text for r in text_only)

"""LLaVA-OneVision-1.5 with images against transformers: a tiny random
LlavaOnevision15ForConditionalGeneration (RICE-ViT: Qwen2-VL-style blocks with a class
token, Qwen3-VL's merger; Qwen3 text) and its processor (Exaone4_5_Processor, as
transformers' auto classes give it, over Qwen2VLImageProcessor's Pillow backend with
temporal_patch_size 1) make the reference inputs. Two images whose sides the processor
rounds: the prompt ids, the pixel values, the image features, the logits of the prompt
(whole, and prefilled in chunks) and 8 greedy tokens match; `run --image`, `chat` and
`serve` (an image part, and text alone) reply as the single-sequence loop does. Features
without the class token differ.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens exact.
"""

import json
from pathlib import Path

import pytest
import torch
from chat_processor import images_only, user_message_inputs
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from qwen2_vl_helpers import QWEN_TOKENS  # ids 512 on, after stories260K's 512
from vision_checks import image_features
from vision_helpers import picture

from llmrun import api
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.llava_onevision1_5_vision import LlavaOnevision15Vision
from llmrun.models.qwen2_vl_vision import rotary_angles
from llmrun.qwen2_vl_images import pixel_patches
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What is in these pictures?"
IMAGE, VIDEO = 516, 517
VOCAB = 520
# Qwen's ChatML, an image as <|vision_start|><|image_pad|><|vision_end|>.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
}
# 140x168 -> 5x6 merged tokens; 150x60 -> 140x56, 5x2.
SIZES = [(140, 168), (150, 60)]
TOKENS = [30, 10]


def tiny_llava_onevision1_5(seed: int = 0):
    """A random LlavaOnevision15ForConditionalGeneration: a Qwen3 of hidden 64 in two
    layers, RICE-ViT of hidden 32 in two blocks (2 heads of 16) on patches of 14."""
    text = dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
    config = transformers.LlavaOnevision15Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO
    )
    torch.manual_seed(seed)
    model = transformers.LlavaOnevision15ForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm1", "norm2", "norm", "pre_layernorm"):
                if name.endswith("weight"):
                    p.normal_(1.0, 0.1)
    return model


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """Exaone4_5_Processor's inputs for one user message of `images` then `question`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    made = images_only(transformers.Exaone4_5_Processor)(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    return user_message_inputs(
        made, images, question, ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")
    )


@pytest.fixture(scope="module")
def model():
    return tiny_llava_onevision1_5()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava_onevision1_5")
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


def test_the_prompt_pixels_features_and_logits_are_transformers(
    model, engine, images, prompt, reference
):
    assert isinstance(engine.vision, LlavaOnevision15Vision)
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
    with torch.no_grad():
        expected = model(**reference).logits[0]
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    stream = engine.generate(*prompt[:1], GREEDY, 8, images=prompt[1])
    assert [r.token for r in stream if r.token is not None] == expected


def test_features_without_the_class_token_differ(model, engine, images, reference):
    """The class token is attended to by every patch, then dropped: leaving it out
    must show."""
    encoder = engine.vision.encoder
    patches, grid_h, grid_w = pixel_patches(images[0], engine.vision)
    with torch.no_grad():
        x = encoder.pre_layernorm(encoder.patch_embed(patches))
        cos, sin = rotary_angles(encoder.args, grid_h, grid_w)
        for block in encoder.blocks:
            x = block(x, cos, sin)
        planted = encoder.merger(x)
    expected = image_features(model, reference)[: TOKENS[0]]
    assert planted.shape == expected.shape
    assert (planted - expected).abs().max() > 1e-2


def test_run_chat_and_serve_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat` with /image, and serve's
    /v1/chat/completions with an image part and with text alone."""
    from in_process import llmrun
    from PIL import Image
    from serving import alone, chat_reply, served

    path = tmp_path / "photo.png"
    path.write_bytes(picture(60, 100, seed=3))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    options = ("-n", "8", "--temperature", "0")
    result = llmrun("run", str(folder), "--image", str(path), QUESTION, *options, "--json", "--logprobs", "0")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    image = open_image(path.read_bytes())
    ids = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])[0]
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", str(folder), *options, input=f"/image {path}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    text_ids = engine.tokenizer.encode(engine.render([{"role": "user", "content": "Hello"}]))
    text_only = "".join(r.text for r in engine.generate(text_ids, GREEDY, 8))
    for client in served(engine, "llava_onevision1_5"):
        text, tokens = alone(engine, path.read_bytes(), QUESTION)
        served_reply = chat_reply(client, path.read_bytes(), QUESTION)
        assert served_reply["choices"][0]["message"]["content"] == text
        assert served_reply["usage"]["completion_tokens"] == len(tokens)
        served_reply = chat_reply(client, "Hello")
        assert served_reply["choices"][0]["message"]["content"] == text_only

"""Kosmos-2 with an image against transformers: a tiny random Kosmos2ForConditionalGeneration
(a CLIP tower of hidden 32 in 2 layers on 32-pixel images of 8-pixel patches, 8 latent
queries; a text decoder of hidden 64 in 2 layers) and Kosmos2Processor (CLIPImageProcessor's
Pillow backend, no crop; its 11 tag tokens and 1024 <patch_index_XXXX> tokens added to the
tokenizer) make the reference inputs. The tokenizer: stories260K's BPE with its ids moved to
XLM-RoBERTa's order (<s> 0, <pad> 1, </s> 2, <unk> 3), as Kosmos-2's, so that the image's
placeholders (the ids after <unk>'s) and the positions (row p + pad + 1) are the real
model's. The prompt ids, the pixels, the image features, the logits (whole and prefilled in
chunks), 8 greedy tokens and a text-only prompt match; `run --image` with a <grounding>
prompt prints what processor.decode(skip_special_tokens=True) gives of generate()'s tokens,
tag and patch tokens included; `show` names it. Features not L2-normalized before the
projection, or positions read a row early, differ.

Tolerances: pixels 1e-5, features and logits 1e-4 (absolute), tokens and text exact.
"""

import json

import pytest
import torch
from blip2_helpers import random_model
from exaone4_5_helpers import greedy_tokens
from helpers import STORIES_HF
from in_process import llmrun
from serving import chat_reply, served
from vision_checks import check_logits_chunks_and_greedy, check_text_only_prompt, logits
from vision_helpers import picture

from llmrun import api, kosmos2_images, vision_families
from llmrun.chat_template import plain_transcript
from llmrun.images import open_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

QUESTION = "<grounding>An image of"
SIZE, PATCH, QUERIES = 32, 8, 8
PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"height": SIZE, "width": SIZE},
    "do_center_crop": False,
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# XLM-RoBERTa's first four ids, as Kosmos-2's tokenizer has them.
FAIRSEQ = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}


def xlmr_ordered_tokenizer(folder) -> None:
    """stories260K's tokenizer.json with <s>, <pad>, </s>, <unk> first and every other
    token one id later."""
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    vocab = {t: i + 1 for t, i in tok["model"]["vocab"].items() if i > 2}
    tok["model"]["vocab"] = {**FAIRSEQ, **vocab}
    tok["added_tokens"] = [
        dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False,
             special=True)
        for t, i in FAIRSEQ.items()
    ]  # fmt: skip
    tok["post_processor"]["special_tokens"]["<s>"]["ids"] = [0]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def kosmos2_processor(folder):
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.Kosmos2Processor(
        transformers.CLIPImageProcessorPil(**settings),
        transformers.AutoTokenizer.from_pretrained(folder),
    )


def reference_inputs(folder, images: list, text: str) -> dict:
    inputs = kosmos2_processor(folder)(
        images=images, text=text, return_tensors="pt", num_image_tokens=QUERIES
    )
    keys = ("input_ids", "attention_mask", "pixel_values", "image_embeds_position_mask")
    return {k: inputs[k] for k in keys}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The folder: its tokenizer with Kosmos2Processor's added tokens (as the Hub's has
    them), the random model, CLIPImageProcessor's settings."""
    folder = tmp_path_factory.mktemp("kosmos2")
    xlmr_ordered_tokenizer(folder)
    tokenizer = kosmos2_processor(folder).tokenizer
    tokenizer.save_pretrained(folder)
    text = dict(
        vocab_size=len(tokenizer),
        embed_dim=64,
        layers=2,
        ffn_dim=128,
        attention_heads=4,
        max_position_embeddings=256,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=PATCH,
    )
    config = transformers.Kosmos2Config(
        text_config=text, vision_config=vision, latent_query_num=QUERIES
    )
    model = random_model(transformers.Kosmos2ForConditionalGeneration, config, 1)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return folder


@pytest.fixture(scope="module")
def model(folder):
    return transformers.Kosmos2ForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def image():
    return open_image(picture(50, 27, 1))


@pytest.fixture(scope="module")
def reference(folder, image):
    return reference_inputs(folder, [image], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, image):
    assert engine.template is None
    return engine.image_prompt(QUESTION, [image])


def image_features(model, pixels) -> torch.Tensor:
    with torch.no_grad():
        return model.get_image_features(pixels).pooler_output[0]


def test_the_prompt_pixels_features_logits_and_tokens_are_transformers(
    model, engine, image, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "Kosmos-2"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    mask = reference["image_embeds_position_mask"][0].tolist()
    assert prompt_images.starts == [mask.index(1)] == [2] and sum(mask) == QUERIES
    assert engine.image_tokens(image) == QUERIES + 2
    pixels = kosmos2_images.pixel_values(engine.vision, image)
    torch.testing.assert_close(pixels[None], reference["pixel_values"], atol=1e-5, rtol=0)
    expected = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(prompt_images.embeds[0], expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 50
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)
    check_text_only_prompt(model.text_model, engine, "<s>Once upon a time")


def test_unnormalized_features_and_positions_a_row_early_differ(
    model, engine, image, prompt, reference, monkeypatch
):
    """Planted: the tower's tokens projected without their L2 normalization; sinusoid
    rows p + pad (one early, as if the offset were padding_idx alone)."""
    expected = image_features(model, reference["pixel_values"])
    monkeypatch.setattr(torch.nn.functional, "normalize", lambda x, dim: x)
    raw = kosmos2_images.encode(engine.vision, [image])[0]
    assert (raw - expected).abs().max() > 1e-2
    monkeypatch.undo()
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    pad = engine.model.args.pad_token_id
    monkeypatch.setattr(engine.model.args, "pad_token_id", pad - 1)
    assert (logits(engine, *prompt) - expected_logits).abs().max() > 1e-2


def test_run_and_serve_print_the_grounded_text_as_the_processor_decodes_it(
    model, folder, engine, tmp_path
):
    from PIL import Image

    path = tmp_path / "snowman.png"
    path.write_bytes(picture(60, 90, seed=6))
    processor = kosmos2_processor(folder)
    inputs = reference_inputs(folder, [Image.open(path)], QUESTION)
    expected = greedy_tokens(model, inputs)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at </s>
    assert len(expected) >= 4
    args = (str(folder), "--image", str(path), QUESTION, "-n", "8", "--temperature", "0")
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    # The model card's text: the whole sequence decoded, after </image>
    # (post_process_generation); run prints what follows the prompt's.
    prompt_ids = inputs["input_ids"][0].tolist()
    caption = processor.decode(prompt_ids + expected, skip_special_tokens=True)
    caption = processor.post_process_generation(caption, cleanup_and_extract=False)
    asked = processor.decode(prompt_ids, skip_special_tokens=True)
    asked = processor.post_process_generation(asked, cleanup_and_extract=False)
    assert "<patch_index_" in caption and caption.startswith(asked)
    text = llmrun("run", *args)
    assert text.returncode == 0, text.stderr
    assert text.stdout == caption[len(asked) :]
    # --output-format json: the model card's parse of the whole sequence, boxes as lists.
    clean, entities = processor.post_process_generation(
        processor.decode(prompt_ids + expected, skip_special_tokens=True)
    )
    entities = [[name, list(span), [list(b) for b in boxes]] for name, span, boxes in entities]
    parsed = llmrun("run", *args, "--output-format", "json")
    assert parsed.returncode == 0, parsed.stderr
    assert json.loads(parsed.stdout) == {
        "text": text.stdout,
        "parsed": {"caption": clean, "entities": entities},
    }
    assert "architecture   kosmos-2" in llmrun("show", str(folder)).stdout
    # serve: no chat template, so the plain transcript after the image.
    transcript = plain_transcript([{"role": "user", "content": QUESTION}])
    expected = greedy_tokens(model, reference_inputs(folder, [Image.open(path)], transcript))
    expected = expected[: expected.index(2)] if 2 in expected else expected
    for client in served(engine, "model"):
        reply = chat_reply(client, path.read_bytes(), QUESTION)
        stream = engine.tokenizer.stream()
        text = "".join(stream.add(t) for t in expected) + stream.flush()
        assert reply["choices"][0]["message"]["content"] == text
        assert reply["usage"]["completion_tokens"] == len(expected)

"""Pix2Struct (a captioning one: no prompt) against transformers: a tiny random
Pix2StructForConditionalGeneration (a patch encoder of hidden 64 in 2 layers on 4-pixel
patches, at most 24 of them; T5's decoder of hidden 64 in 2 layers, 8 relative-position
buckets up to 20) with a real SentencePiece Unigram tokenizer (T5's ids: pad 0, eos 1)
and Pix2StructImageProcessor's Pillow backend. A 50 x 37 picture's flattened patches equal
the processor's (its padding patches aside, all zero), the encoder's states and the
decoder's logits (12 tokens: past the exact buckets) are transformers', and `run --image`
gives generate()'s greedy ids and text; `show` says image-to-text. Patch ids counted from
0, or an image left unstandardized, differ; a VQA folder (is_vqa: its question rendered in
Arial) and a prompt are refused in one line.

Tolerances: patches 1e-5; encoder states and logits 1e-4 (absolute); ids exact.
"""

import json
import shutil

import pytest
import torch
from blip2_helpers import random_model
from in_process import llmrun
from serving import chat_reply, served
from t5_helpers import tokenizer_folder
from vision_helpers import picture

from llmrun import api, pix2struct_images
from llmrun.images import open_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from transformers.models.pix2struct.image_processing_pil_pix2struct import (  # noqa: E402
    Pix2StructImageProcessorPil,
)

PATCH, MAX_PATCHES = 4, 24
PROCESSOR = {
    "image_processor_type": "Pix2StructImageProcessor",
    "max_patches": MAX_PATCHES,
    "patch_size": {"height": PATCH, "width": PATCH},
    "is_vqa": False,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tokenizer_folder(tmp_path_factory.mktemp("pix2struct"))
    text = dict(
        vocab_size=200,
        hidden_size=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
    )
    vision = dict(
        hidden_size=64,
        patch_embed_hidden_size=3 * PATCH * PATCH,
        d_ff=128,
        d_kv=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        seq_len=64,
    )
    config = transformers.Pix2StructConfig(text_config=text, vision_config=vision)
    model = random_model(transformers.Pix2StructForConditionalGeneration, config, 0)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return folder


@pytest.fixture(scope="module")
def model(folder):
    return transformers.Pix2StructForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), vision=True, text_to_text=True)


@pytest.fixture(scope="module")
def image(folder):
    path = folder / "picture.png"
    path.write_bytes(picture(37, 50, 1))
    return path


def reference_patches(image) -> dict:
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return Pix2StructImageProcessorPil(**settings)(images=open_image(image), return_tensors="pt")


def test_patches_states_logits_and_run_match_transformers(model, engine, image, folder):
    reference = reference_patches(image)
    ours = pix2struct_images.flattened_patches(engine.vision, open_image(image))
    count = len(ours)
    assert reference["attention_mask"][0].sum() == count < MAX_PATCHES
    torch.testing.assert_close(ours, reference["flattened_patches"][0, :count], atol=1e-5, rtol=0)
    assert not reference["flattened_patches"][0, count:].any()
    ids, images = engine.image_prompt("", [open_image(image)])
    decoder_ids = torch.tensor([[0, *range(20, 31)]])
    with torch.no_grad():
        expected = model(**reference, decoder_input_ids=decoder_ids)
        states = expected.encoder_last_hidden_state[0, :count]
        torch.testing.assert_close(images.embeds[0], states, atol=1e-4, rtol=0)
        encoded = engine.model.encode(torch.tensor([ids]), images)
        logits = engine.model.decoding(encoded)(decoder_ids, torch.arange(12)[None])
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        out = model.generate(**reference, do_sample=False, max_new_tokens=8)[0, 1:].tolist()
    out = out[: out.index(1)] if 1 in out else out  # run stops at </s>
    assert len(set(out)) >= 3
    result = llmrun("run", folder, "--image", image, "-n", "8", "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == out
    text = llmrun("run", folder, "--image", image, "-n", "8")
    assert text.returncode == 0 and text.stdout == engine.tokenizer.decode(out)
    assert "image-to-text (encoder-decoder)" in llmrun("show", folder).stdout
    for client in served(engine, "model"):
        reply = chat_reply(client, image.read_bytes())
        assert reply["choices"][0]["message"]["content"] == text.stdout


def test_patch_ids_from_zero_and_unstandardized_pixels_differ(engine, image, monkeypatch):
    """Planted: row and column ids counted from 0 (0 is the processor's padding), and the
    image left unstandardized (do_normalize false)."""
    picture_ = open_image(image)

    def states(patches: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return engine.vision.encoder(patches[None])[0]

    patches = pix2struct_images.flattened_patches(engine.vision, picture_)
    expected = states(patches)
    patches[:, :2] -= 1
    assert (states(patches) - expected).abs().max() > 1e-2
    monkeypatch.setattr(engine.vision, "normalize", False)
    raw = pix2struct_images.flattened_patches(engine.vision, picture_)
    assert (states(raw) - expected).abs().max() > 1e-2


def test_a_prompt_and_a_vqa_model_are_one_error_line(folder, image, tmp_path):
    prompted = llmrun("run", folder, "a question?", "--image", image)
    assert prompted.returncode != 0 and prompted.stderr.count("\n") == 1
    assert prompted.stderr.startswith("error: Pix2Struct's captioning models take no prompt")
    vqa = shutil.copytree(folder, tmp_path / "vqa")
    (vqa / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "is_vqa": True}))
    result = llmrun("run", vqa, "--image", image, "-n", "2")
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "a Pix2Struct VQA model (is_vqa)" in result.stderr

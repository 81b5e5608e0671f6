"""MiniCPM-V 4.7 with images against transformers: a tiny random
MiniCPMV4_7ForConditionalGeneration (MiniCPM-V 4.6's tower and merger, Qwen3.5 text whose
image tokens turn by canvas M-RoPE) and MiniCPMV4_7Processor make the reference inputs
(minicpmv_helpers). Two images, 64x64 (the whole image and 2x2 slices) and 30x90 (1x3
slices): the prompt ids and pixel values equal the processor's, every token's positions
equal get_rope_index's, the image features, the logits (whole, and a prefill in chunks
whose text after the images turns by the shift they leave) and 8 greedy tokens match, from
the folder and through `llmrun run --image` and `llmrun chat --image`; so do the logits in
4x mode with two images side by side (one canvas group). A thumbnail not spread over its
slices' canvas fails. llama.cpp has no MiniCPM-V 4.7 converter: no GGUF or mmproj.

Tolerances: ids, pixels and positions exact; features and logits 1e-4 (logits within
about ±6).
"""

import json

import pytest
import torch
from minicpmv_helpers import (
    IMAGE_PAD,
    MARKER_IDS,
    greedy_tokens,
    processor,
    reference_inputs,
    save_minicpmv_dir,
    tiny_minicpmv,
)
from test_minicpmv_vision import packed  # tests/models, beside this file
from vision_checks import logits
from vision_helpers import picture

from llmrun import api, minicpmv_canvas, minicpmv_images, vision_families
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.minicpmv_vision import from_hf_dir_4_7, from_mmproj_4_7
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model():
    return tiny_minicpmv(version="4.7")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_minicpmv_dir(model, tmp_path_factory.mktemp("minicpmv4_7"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(64, 64, 1)), open_image(picture(30, 90, 2))]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return reference_inputs(folder, images, engine.prompt_text(QUESTION, images=len(images)))


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def expected_logits(model, reference) -> torch.Tensor:
    with torch.no_grad():
        return model(**reference).logits[0]


def test_the_prompt_pixels_and_positions_are_transformers(engine, model, images, prompt, reference):
    assert vision_families.of_vision(engine.vision).name == "MiniCPM-V 4.7"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    whole, slices = minicpmv_images.pixel_values(engine.vision, images[0])
    assert len(slices) == 4
    first = packed([whole, *slices])
    assert torch.equal(first, reference["pixel_values"][0][..., : first.shape[-1]])
    expected, _ = model.model.get_rope_index(
        reference["input_ids"],
        mm_token_type_ids=reference["mm_token_type_ids"],
        target_sizes=reference["target_sizes"],
        attention_mask=reference["attention_mask"],
    )
    assert torch.equal(prompt_images.rope, expected[:, 0])
    # Each image's span: from its <image> to its last </slice>.
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start] == MARKER_IDS["image_start_id"]
        assert ids[start + len(embeds) - 1] == MARKER_IDS["slice_end_id"]


def test_image_features_logits_and_greedy_tokens_match_transformers(
    model, engine, prompt, reference
):
    ids, prompt_images = prompt
    pads = torch.cat(
        [
            e[[ids[s + i] == IMAGE_PAD for i in range(len(e))]]
            for s, e in zip(prompt_images.starts, prompt_images.embeds, strict=True)
        ]
    )
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["target_sizes"])
    torch.testing.assert_close(pads, torch.cat(out.pooler_output), atol=1e-4, rtol=0)
    expected = expected_logits(model, reference)
    assert 2 < expected.abs().max() < 8
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == greedy_tokens(model, reference)


def test_4x_mode_with_images_side_by_side_matches_transformers(images, tmp_path):
    """downsample_mode 4x (a token per 2x2 patches) and use_image_id false: nothing but
    markers between the two images, whose frames then share a canvas group."""
    model = tiny_minicpmv(downsample_mode="4x", version="4.7")
    folder = save_minicpmv_dir(model, tmp_path / "4x", image_ids=False)
    engine = api.load(str(folder), device="cpu", vision=True)
    text = engine.prompt_text(QUESTION, images=len(images))
    reference = reference_inputs(folder, images, text)
    ids, prompt_images = engine.image_prompt(text, images)
    assert ids == reference["input_ids"][0].tolist()
    (first, first_end), (second, _) = prompt_images.spans()
    assert first_end == second  # the first frame ends where the second's <image> is
    expected = expected_logits(model, reference)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        state = KVState(engine.model.new_cache(1, 512, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=16, images=prompt_images)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_a_thumbnail_not_spread_over_its_canvas_fails(
    model, engine, images, reference, monkeypatch
):
    """Planted: the whole image's tokens at their own grid's positions, as 4.6's slices'."""
    grid = minicpmv_canvas._grid
    monkeypatch.setattr(
        minicpmv_canvas,
        "_grid",
        lambda o, g, canvas=(0, 0), offset=(0, 0): grid(o, g, offset=offset),
    )
    ids, prompt_images = engine.image_prompt(engine.prompt_text(QUESTION, images=2), images)
    expected = expected_logits(model, reference)
    assert (logits(engine, ids, prompt_images) - expected).abs().max() > 1e-2


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` from the folder."""
    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(50, 80, seed=4))
    text = f"<|im_start|>user\n<|image_pad|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    reference = reference_inputs(folder, [Image.open(image).convert("RGB")], text)
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    expected = greedy_tokens(model, reference)
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected


def test_a_folder_without_marker_ids_and_an_mmproj_are_refused(folder, tmp_path):
    import shutil

    other = shutil.copytree(folder, tmp_path / "no-markers")
    config = json.loads((other / "config.json").read_text())
    del config["newline_id"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="no token id newline_id, which MiniCPM-V 4.7"):
        from_hf_dir_4_7(other, 64)
    with pytest.raises(UnsupportedError, match="no MiniCPM-V 4.7 projector"):
        from_mmproj_4_7(tmp_path / "mmproj.gguf", 64)


def test_a_chat_with_an_image_replies_as_transformers_in_every_turn(model, folder, tmp_path):
    """`llmrun chat MODEL --image PATH`: each reply is transformers' greedy one after the
    conversation so far (the first message's image seen in every turn)."""
    from in_process import llmrun
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    image = tmp_path / "cat.png"
    image.write_bytes(picture(50, 80, seed=4))
    tokenizer, made = load_tokenizer(folder), processor(folder)
    questions = (QUESTION, "And then?")
    messages, expected = [], ""
    for question in questions:
        first = [{"type": "image"}, {"type": "text", "text": question}]
        messages.append({"role": "user", "content": question if messages else first})
        text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = reference_inputs(folder, [Image.open(image).convert("RGB")], text)
        reply = tokenizer.decode(greedy_tokens(model, inputs))
        messages.append({"role": "assistant", "content": reply})
        expected += reply + "\n\n"
    options = ("-n", "8", "--temperature", "0")
    result = llmrun("chat", folder, "--image", image, *options, input="\n".join(questions))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected

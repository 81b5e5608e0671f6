"""SmolVLM (and Idefics3, the same model) with images against transformers: a tiny random
SmolVLMForConditionalGeneration (SigLIP tower, pixel-shuffle connector, Llama text) and
SmolVLMProcessor make the reference inputs. The prompt ids and pixel values equal the
processor's for images of several shapes, split into tiles and not; the image features,
the logits of a prompt with two images of other grids and 8 greedy tokens match; so does
the same model as a text GGUF and an mmproj GGUF laid out as llama.cpp's converter writes
them (benchmarks/llama_cpp_smolvlm.py checks that layout against the converter). The
tower's positions for a non-square input are Idefics3VisionEmbeddings'. A pixel shuffle
in another order fails.

Tolerances: ids and pixels exact (1e-6); features and logits 1e-4.
"""

import pytest
import torch
from smolvlm_helpers import (
    FAKE,
    IMAGE,
    TILE_TOKENS,
    greedy_tokens,
    reference_inputs,
    save_smolvlm_dir,
    tiny_smolvlm,
    write_mmproj,
    write_text_gguf,
)
from vision_checks import (
    check_mmproj_refusals,
    check_prompt_logits,
    greedy_ids,
    logits,
    soft_rows,
)
from vision_helpers import picture

from llmrun import api, idefics3_images, vision_families
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading.idefics3_vision import from_mmproj
from llmrun.models import idefics3_vision

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytest.importorskip("num2words")  # SmolVLMProcessor's
QUESTION = "What is in these pictures?"
# Resized to 64 pixels on the longest side, then cut into tiles of 32: 40x64 (height x
# width) makes 2x2 tiles, 100x17 2x1, 30x90 1x2.
SHAPES = {(40, 64): (2, 2), (100, 17): (2, 1), (30, 90): (1, 2), (500, 333): (2, 2)}


@pytest.fixture(scope="module")
def model():
    return tiny_smolvlm()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_smolvlm_dir(model, tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(40, 64, 1)), open_image(picture(30, 90, 2))]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return reference_inputs(folder, images, engine.prompt_text(QUESTION, images=len(images)))


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(
            reference["pixel_values"], reference["pixel_attention_mask"]
        )
    return torch.cat(out.pooler_output)


@pytest.mark.parametrize("splitting", [True, False])
def test_the_prompt_and_pixels_are_the_processors(model, engine, folder, tmp_path, splitting):
    if not splitting:
        folder = save_smolvlm_dir(model, tmp_path / "whole", splitting=False)
        engine = api.load(str(folder), device="cpu", vision=True)
    vision = engine.vision
    for (height, width), grid in SHAPES.items():
        image = open_image(picture(height, width, 3))
        text = engine.prompt_text(QUESTION, images=1)
        expected = reference_inputs(folder, [image], text, splitting)
        ids, prompt_images = engine.image_prompt(text, [image])
        assert ids == expected["input_ids"][0].tolist(), (height, width)
        pixels, ours = idefics3_images.pixel_values(vision, image)
        assert ours == (grid if splitting else (0, 0))
        torch.testing.assert_close(pixels, expected["pixel_values"][0], atol=1e-6, rtol=0)
        # The span: its first <image> to its last, inside the image's expansion.
        frames = ours[0] * ours[1] + 1
        (start,), (embeds,) = prompt_images.starts, prompt_images.embeds
        assert ids.count(IMAGE) == frames * TILE_TOKENS
        assert ids[start] == ids[start + len(embeds) - 1] == IMAGE
        assert ids[ids.index(FAKE) : start + len(embeds) + 1].count(IMAGE) == frames * TILE_TOKENS
        # Known before encoding: the whole expansion (each newline one token here).
        expansion = ids[ids.index(FAKE) : len(ids) - ids[::-1].index(FAKE)]
        assert idefics3_images.image_tokens(vision, image) == len(expansion)


def test_image_features_match_transformers(model, prompt, reference):
    features = soft_rows(*prompt, IMAGE)
    expected = image_features(model, reference)
    assert features.shape == (8 * TILE_TOKENS, 64)  # 2x2 tiles, 1x2 tiles, 2 wholes
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=0)
    # The text tokens inside a span are the language model's own embeddings.
    ids, prompt_images = prompt
    table = model.model.text_model.embed_tokens.weight.detach()
    start, embeds = prompt_images.starts[0], prompt_images.embeds[0]
    for i in range(len(embeds)):
        if ids[start + i] != IMAGE:
            assert torch.equal(embeds[i], table[ids[start + i]])


def test_the_tower_places_a_non_square_input_as_transformers(model, engine):
    """Idefics3VisionEmbeddings maps the patches of any grid onto its positions by
    fractions (boundaries in float32)."""
    torch.manual_seed(0)
    for height, width in ((24, 40), (56, 16), (104, 72)):
        pixels = torch.randn(2, 3, height, width)
        with torch.no_grad():
            expected = model.model.vision_model(pixel_values=pixels).last_hidden_state
        ours = engine.vision.encoder.patch_states(pixels)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_a_pixel_shuffle_in_another_order_fails(model, engine, images, reference, monkeypatch):
    def columns_first(x, scale):
        # each token a square of patches, but its scale² states gathered column by column
        batch, seq, dim = x.shape
        side = int(seq**0.5)
        x = x.view(batch, side // scale, scale, side // scale, scale, dim)
        return x.permute(0, 1, 3, 4, 2, 5).reshape(batch, seq // scale**2, dim * scale**2)

    monkeypatch.setattr(idefics3_vision, "pixel_shuffle", columns_first)
    encoded = idefics3_images.encode(engine.vision, images)
    features = torch.cat([torch.cat([e.tiles.flatten(0, 2), e.whole]) for e in encoded])
    assert (features - image_features(model, reference)).abs().max() > 1e-2


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    check_prompt_logits(model, engine, prompt, reference, chunk=7, context=256)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert greedy_ids(engine, *prompt) == expected


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32, as the converter's --outtype f32 writes it: exact.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)
    assert vision_families.of_mmproj(mmproj).name == "SmolVLM/Idefics3"
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    features = soft_rows(ids, prompt_images, IMAGE)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert greedy_ids(engine, ids, prompt_images) == greedy_tokens(model, reference)
    check_mmproj_refusals(text, mmproj, from_mmproj)


def test_a_quantized_mmproj_loads_gguf_dequantized_weights(model, engine, images, tmp_path):
    """Q8_0 tower matrices (the converter's --outtype q8_0): gguf's dequantization of
    the same blocks."""
    import gguf

    path = write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    vision = from_mmproj(path, 64)
    name = "vision_model.encoder.layers.0.self_attn.q_proj.weight"
    original = model.model.vision_model.encoder.layers[0].self_attn.q_proj.weight.detach()
    blocks = gguf.quants.quantize(original.numpy(), gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(vision.encoder.state_dict()[name], torch.from_numpy(expected))
    features = idefics3_images.encode(vision, images)[0].whole
    exact = idefics3_images.encode(engine.vision, images)[0].whole
    assert 0 < (features - exact).abs().max() < 0.1 * exact.abs().max()


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2 images"):
        engine.image_prompt("User:<image>two?<end_of_utterance>", images)


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file (F16 matrices, as the converter writes them by default)."""
    import json

    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(50, 80, seed=4))  # 2x2 tiles
    text = f"<|im_start|>User:<image>{QUESTION}<end_of_utterance>\nAssistant:"
    reference = reference_inputs(folder, [Image.open(image).convert("RGB")], text)
    expected = greedy_tokens(model, reference)
    assert len(expected) >= 4
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    for model_args in ([str(folder)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected


def test_a_chat_with_an_image_replies_as_transformers_in_every_turn(model, folder, tmp_path):
    """`llmrun chat FOLDER` with /image: each reply is transformers' greedy tokens (to
    <end_of_utterance>) after the conversation so far (the replies kept as text), the
    image in the first message."""
    from in_process import llmrun
    from PIL import Image
    from smolvlm_helpers import END_OF_UTTERANCE, SMOLVLM_TEMPLATE, processor

    from llmrun.tokenizer import load_tokenizer

    image = tmp_path / "cat.png"
    image.write_bytes(picture(90, 120, seed=5))
    questions = ("What is in this picture?", "And then?")
    tokenizer = load_tokenizer(folder)
    messages, expected = [], ""
    for question in questions:
        first = [{"type": "image"}, {"type": "text", "text": question}]
        messages.append({"role": "user", "content": question if messages else first})
        text = processor(folder).apply_chat_template(
            messages, add_generation_prompt=True, chat_template=SMOLVLM_TEMPLATE
        )
        inputs = reference_inputs(folder, [Image.open(image)], text)
        tokens = greedy_tokens(model, inputs)
        kept = tokens[: tokens.index(END_OF_UTTERANCE)] if END_OF_UTTERANCE in tokens else tokens
        # As the chat streams it, after the prompt (a first piece keeps its leading space).
        stream = tokenizer.stream(after=inputs["input_ids"][0].tolist())
        reply = "".join(stream.add(t) for t in kept) + stream.flush()
        messages.append({"role": "assistant", "content": reply})
        expected += reply + "\n\n"
    options = ("-n", "8", "--temperature", "0")
    command = llmrun("chat", folder, *options, input="\n".join([f"/image {image}", *questions]))
    assert command.returncode == 0, command.stderr
    assert command.stdout == expected


def test_a_folder_whose_tiles_do_not_fit_the_tower_is_one_error_line(model, folder, tmp_path):
    import json
    import shutil

    from in_process import llmrun

    other = shutil.copytree(folder, tmp_path / "odd-tiles")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    settings["max_image_size"] = {"longest_edge": 40}
    (other / "preprocessor_config.json").write_text(json.dumps(settings))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(40, 64, seed=1))
    result = llmrun("run", str(other), "--image", str(image), "Hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1] == (
        f"error: {other}: tiles of 40 pixels are not a multiple of 16 (patches of 8, "
        "pixel-shuffled by 2)"
    )

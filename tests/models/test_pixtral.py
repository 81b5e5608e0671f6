"""Mistral 3 (Mistral Small 3.1/3.2) with images against transformers: a tiny random
Mistral3ForConditionalGeneration (Pixtral tower, patch merger, projector) and
PixtralImageProcessor make the reference inputs; the expansion of [IMG] is written out
as PixtralProcessor writes it (which needs torchvision). The pixel values, the image
features, the logits of a prompt with two images of other shapes and 8 greedy tokens
match; so does the same model as a text GGUF and an mmproj GGUF laid out as llama.cpp's
converter writes them (benchmarks/llama_cpp_pixtral.py checks that layout against the
converter). A 1D RoPE in the tower, or no [IMG_BREAK] embedding, fails."""

import io

import pytest
import torch
from pixtral_helpers import (
    IMG,
    IMG_BREAK,
    IMG_END,
    LONGEST_EDGE,
    greedy_tokens,
    permute_heads,
    reference_inputs,
    save_mistral3_dir,
    tiny_mistral3,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.pixtral_vision import from_hf_dir, from_mmproj
from llmrun.models import pixtral
from llmrun.multimodal import PromptImages
from llmrun.pixtral_images import encode, pixel_values
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
# 56x84 pixels: 2 rows of 3 merged patches (patch 14, merged 2x2); 100x60 fits 84 as
# 84x50, rounded up to 84x56: 3 rows of 2.
EXPANSIONS = [
    "[IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_END]",
    "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]",
]


@pytest.fixture(scope="module")
def model():
    return tiny_mistral3()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_mistral3_dir(model, tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(56, 84, 1)), open_image(picture(100, 60, 2))]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    text = engine.prompt_text(QUESTION, images=len(images))
    return reference_inputs(folder, images, text, EXPANSIONS)


@pytest.fixture(scope="module")
def prompt(engine, images):
    text = engine.prompt_text(QUESTION, images=len(images))
    return engine.image_prompt(text, images)


def image_rows(embeds: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each image span's tokens less the [IMG_BREAK] after each row (the test images
    have 3 and 2 tokens a row)."""
    return [
        e[[i for i in range(len(e)) if i % (c + 1) != c]]
        for e, c in zip(embeds, (3, 2), strict=True)
    ]


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_sizes"])
    return torch.cat(out.pooler_output)


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    # A span per image: its [IMG]s and [IMG_BREAK]s, then [IMG_END].
    assert [len(e) for e in prompt_images.embeds] == [2 * 4 - 1, 3 * 3 - 1]
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert set(ids[start : start + len(embeds)]) == {IMG, IMG_BREAK}
        assert ids[start + len(embeds)] == IMG_END
    vision = engine.vision
    for image, expected, (h, w) in zip(
        images, reference["pixel_values"], reference["image_sizes"].tolist(), strict=True
    ):
        ours = pixel_values(image, LONGEST_EDGE, 28, vision.mean, vision.std)
        assert ours.shape == (3, h, w)
        torch.testing.assert_close(ours, expected[:, :h, :w], atol=1e-5, rtol=0)


def test_image_features_match_transformers(model, prompt, reference):
    embeds = prompt[1].embeds
    torch.testing.assert_close(
        torch.cat(image_rows(embeds)), image_features(model, reference), atol=1e-4, rtol=0
    )
    # [IMG_BREAK]'s embedding is the language model's own row.
    row = model.model.language_model.embed_tokens.weight[IMG_BREAK].detach()
    assert torch.equal(embeds[0][3], row) and torch.equal(embeds[1][5], row)


def test_a_1d_rope_in_the_tower_fails(model, engine, images, reference, monkeypatch):
    def rope_1d(args, rows, cols):
        # positions 0..P-1 along one axis, every frequency
        dim = args.head_dim
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.arange(rows * cols)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    monkeypatch.setattr(pixtral, "rope_2d", rope_1d)
    features = torch.cat([e.flatten(0, 1) for e in encode(engine.vision, images)])
    assert (features - image_features(model, reference)).abs().max() > 1e-2


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 5, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=5, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_no_image_break_fails(model, engine, prompt, reference):
    """The rows of each image one after the other, without [IMG_BREAK]s between: the
    answer's logits move."""
    ids, prompt_images = prompt
    kept = [i for i, t in enumerate(ids) if t != IMG_BREAK]
    starts = [kept.index(s) for s in prompt_images.starts]
    rows = image_rows(prompt_images.embeds)
    planted = logits(engine, [ids[i] for i in kept], PromptImages(rows, starts))
    with torch.no_grad():
        expected = model(**reference).logits[0]
    assert (planted[-1] - expected[-1]).abs().max() > 1e-2


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_gguf_with_mmproj_matches_transformers(model, images, reference, tmp_path):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32, as the converter's --outtype f32 writes it: exact.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == reference["input_ids"][0].tolist()
    features = torch.cat(image_rows(prompt_images.embeds))
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_a_quantized_mmproj_loads_gguf_dequantized_weights(model, engine, images, tmp_path):
    """Q8_0 tower matrices (the converter's --outtype q8_0), q/k rows unpermuted after
    dequantizing: gguf's dequantization of the same blocks."""
    import gguf

    path = write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    vision = from_mmproj(path, 64)
    ours = vision.encoder.state_dict()["vision_tower.transformer.layers.0.attention.q_proj.weight"]
    original = model.model.vision_tower.transformer.layers[0].attention.q_proj.weight.detach()
    stored = permute_heads(original.numpy(), 2)  # the rows as the file holds them
    blocks = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(torch.from_numpy(permute_heads(ours.numpy(), 2)), torch.from_numpy(expected))
    features = torch.cat([e.flatten(0, 1) for e in encode(vision, images)])
    exact = torch.cat([e.flatten(0, 1) for e in encode(engine.vision, images)])
    assert 0 < (features - exact).abs().max() < 0.1 * exact.abs().max()


def test_transformers_5s_key_names_load_the_same_encoder(folder, engine, tmp_path):
    """save_pretrained writes the Hub's names (language_model.model.*, vision_tower.*,
    multi_modal_projector.*: the folder above); transformers 5's own are under model.*."""
    import shutil

    from safetensors.torch import load_file, save_file

    renames = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    other = shutil.copytree(folder, tmp_path / "transformers-5")
    state = load_file(other / "model.safetensors")
    renamed = {}
    for key, value in state.items():
        old = next(old for old in renames if key.startswith(old))
        renamed[renames[old] + key[len(old) :]] = value
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    loaded = from_hf_dir(other, 64).encoder.state_dict()
    expected = engine.vision.encoder.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(\[IMG\]\) for 2 images"):
        engine.image_prompt("[INST][IMG]two?[/INST]", images)
    with pytest.raises(UsageError, match="of its own"):
        engine.image_prompt("[INST][IMG][IMG_END][/INST]", images[:1])


@pytest.mark.parametrize(("size", "mode"), [((1000, 600), "RGBA"), ((333, 1600), "RGB")])
def test_preprocessing_matches_pixtral_image_processor(size, mode):
    """Mistral Small 3.1's settings: images fit in 1540 pixels, sides of 28."""
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    data = picture(*size, seed=3, mode=mode)
    processor = PixtralImageProcessorPil(
        patch_size={"height": 28, "width": 28}, size={"longest_edge": 1540}
    )
    expected = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    mean, std = processor.image_mean, processor.image_std
    ours = pixel_values(open_image(data), 1540, 28, mean, std)
    torch.testing.assert_close(ours, expected.pixel_values[0], atol=1e-5, rtol=0)


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file (F16 matrices, as the converter writes them by default)."""
    import json

    from in_process import llmrun
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(50, 80, seed=4))  # resized up to 56x84: 2 rows of 3
    expansion = EXPANSIONS[0]
    text = f"<s>[INST][IMG]{QUESTION}[/INST]"
    reference = reference_inputs(folder, [Image.open(image)], text, [expansion])
    expected = greedy_tokens(model, reference)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    for model_args in ([str(folder)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected

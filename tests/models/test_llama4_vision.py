"""Llama 4 with images (its vision tower with 2D RoPE, pixel shuffle and adapter MLP, the
projector, the MoE text model) against transformers: a tiny random
Llama4ForConditionalGeneration (text hidden 64 in 4 layers, dense and of 2 experts in
turn, the last without RoPE; vision hidden 32 in 2 layers on 84-pixel tiles of 14-pixel
patches, 9 tokens a tile, up to 6 tiles and the whole image) whose Llama4Processor (chat template, <|image|>
expanded with <|patch|> tokens and tile separators, Llama4ImageProcessor's tiles) makes
the reference inputs. The image processor needs torchvision, which the suite goes without:
its prompt ids, tile grids and pixel checksums for seven images and settings are stored
(tests/data/llama4_vision_processor.json) and checked against it where torchvision is
installed, as are the tile grids of many image sizes. Two images, 100x260 (2 x 3 tiles)
and 200x90 (3 x 2), in one prompt: the image features, the logits (whole, and a chunked
prefill through a KV cache) and 8 greedy tokens match; so does the same model as a text
GGUF and an mmproj GGUF laid out as llama.cpp's converter writes them (but each layer's
second norm as ln2, which clip.cpp reads; the converter's attn_post_norm is refused). The
2D RoPE's axes swapped, or a pixel shuffle of another order, fails.

Tolerances: 1e-4 on f32 image features and logits; prompt ids and tile grids exact; pixel
checksums 1e-9 relative (the pixels are bit-equal); a Q8_0 mmproj's features within 5% of
their largest value.
"""

import dataclasses
import json

import pytest
import torch
from in_process import llmrun
from llama4_vision_helpers import (
    GOLDEN,
    GOLDEN_CASES,
    GOLDEN_QUESTION,
    MAX_TILES,
    PATCH,
    TILE,
    TOKENS_PER_TILE,
    greedy_tokens,
    model_inputs,
    pixel_sums,
    save_llama4_dir,
    tiny_llama4,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, llama4_images
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.llama4_vision import Llama4Vision, from_mmproj
from llmrun.models import llama4_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_llama4()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_llama4_dir(model, tmp_path_factory.mktemp("llama4"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(100, 260, 3)), open_image(picture(200, 90, 4))]


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


@pytest.fixture(scope="module")
def reference(engine, prompt, images):
    """transformers' inputs: llmrun's ids and pixel values, which match the processor's
    (test_prompts_and_tiles_are_the_stored_processors)."""
    return model_inputs(engine.vision, prompt[0], images)


def image_features(model, pixels) -> torch.Tensor:
    with torch.no_grad():
        return model.get_image_features(pixels).pooler_output.flatten(0, 1)


def patch_rows(ids, prompt_images) -> torch.Tensor:
    """The soft tokens of the prompt's <|patch|> places, in order (not the separators')."""
    rows = []
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        span = torch.tensor(ids[start : start + len(embeds)])
        rows.append(embeds[span == PATCH])
    return torch.cat(rows)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def with_settings(vision, settings: dict):
    names = {"max_patches": "max_tiles"}
    return dataclasses.replace(vision, **{names.get(k, k): v for k, v in settings.items()})


def test_prompts_and_tiles_are_the_stored_processors(engine):
    """Each GOLDEN_CASES image alone in a prompt: the ids, the tile grid and the pixels
    (their checksums) as transformers' Llama4Processor gives them."""
    records = json.loads(GOLDEN.read_text())
    assert len(records) == len(GOLDEN_CASES)
    for ((height, width, seed), settings), record in zip(GOLDEN_CASES, records, strict=True):
        vision = with_settings(engine.vision, settings)
        image = open_image(picture(height, width, seed))
        pixels, grid = llama4_images.pixel_values(vision, image)
        assert list(grid) == record["grid"] and len(pixels) == record["frames"]
        assert pixel_sums(pixels) == pytest.approx(record["pixel_sums"], rel=1e-9, abs=1e-6)
        encoded = [llama4_images.EncodedImage(torch.zeros(len(pixels), TOKENS_PER_TILE, 1), grid)]
        text = engine.prompt_text(GOLDEN_QUESTION, images=1)
        ids, _ = llama4_images.prompt(engine.tokenizer, text, encoded, lambda t: torch.zeros(1))
        assert ids == record["input_ids"]
        expanded = len(ids) - len(engine.tokenizer.encode(text)) + 1
        assert llama4_images.image_tokens(vision, image) == expanded


def test_the_stored_inputs_are_the_processors(folder):
    """GOLDEN is what transformers' processor gives (its image processor needs
    torchvision)."""
    pytest.importorskip("torchvision")
    from llama4_vision_helpers import processor_record

    for live, stored in zip(processor_record(folder), json.loads(GOLDEN.read_text()), strict=True):
        assert live["pixel_sums"] == pytest.approx(stored.pop("pixel_sums"), rel=1e-9)
        assert {k: live[k] for k in stored} == stored


def test_the_two_image_prompt_is_the_processors(folder, images, prompt, reference):
    pytest.importorskip("torchvision")
    from llama4_vision_helpers import processor_inputs

    expected = processor_inputs(folder, images, QUESTION)
    assert prompt[0] == expected["input_ids"][0].tolist()
    torch.testing.assert_close(reference["pixel_values"], expected["pixel_values"], atol=0, rtol=0)


def test_tile_grids_match_transformers():
    pytest.importorskip("torchvision")
    from transformers.image_utils import SizeDict
    from transformers.models.llama4.image_processing_llama4 import (
        find_supported_resolutions,
        get_best_fit,
    )

    vision = Llama4Vision(None, 336, 16, False, 1 / 255, (0.5,) * 3, (0.5,) * 3)
    sizes = [(h, w) for h in (1, 37, 200, 336, 337, 900, 1333) for w in (1, 60, 336, 700, 2000)]
    for max_tiles in (16, 6, 1):
        for canvas in (False, True):
            v = dataclasses.replace(vision, max_tiles=max_tiles, resize_to_max_canvas=canvas)
            grids = torch.tensor(
                find_supported_resolutions(max_tiles, SizeDict(height=336, width=336))
            )
            for h, w in sizes:
                best = get_best_fit((h, w), grids, resize_to_max_canvas=canvas)
                assert llama4_images.tile_grid(v, h, w) == (best[0] // 336, best[1] // 336)


def test_image_features_match_transformers(model, prompt, reference):
    ids, prompt_images = prompt
    # 2 x 3 tiles and the whole image, then 3 x 2 and the whole image: 7 tiles each.
    assert len(patch_rows(ids, prompt_images)) == 14 * TOKENS_PER_TILE
    expected = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(patch_rows(ids, prompt_images), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bug", ["rope axes swapped", "pixel shuffle transposed"])
def test_a_planted_bug_fails(model, engine, images, reference, monkeypatch, bug):
    if bug == "rope axes swapped":
        angles = llama4_vision.rope_angles

        def swapped(args):
            table = angles(args)
            half = table.shape[1] // 2
            return torch.cat([table[:, half:], table[:, :half]], dim=1)

        monkeypatch.setattr(llama4_vision, "rope_angles", swapped)
    else:
        shuffle = llama4_vision.pixel_shuffle
        # Each 2x2 block's patches taken column by column instead of row by row.
        monkeypatch.setattr(
            llama4_vision,
            "pixel_shuffle",
            lambda g, m: shuffle(g.transpose(1, 2), m).transpose(1, 2),
        )
    encoded = llama4_images.encode(engine.vision, images)
    features = torch.cat([e.tokens.flatten(0, 1) for e in encoded])
    assert (features - image_features(model, reference["pixel_values"])).abs().max() > 1e-2


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 512, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_gguf_with_mmproj_matches_transformers(model, images, prompt, reference, tmp_path):
    """The text GGUF (arch llama4) and the mmproj GGUF (projector llama4) as llama.cpp's
    converter writes them."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    # An mmproj holds no tiling settings: Llama4ImageProcessor's defaults, not the folder's.
    assert (engine.vision.max_tiles, engine.vision.tile) == (16, TILE)
    engine.vision = with_settings(engine.vision, {"max_patches": MAX_TILES})
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == prompt[0]
    expected_features = image_features(model, reference["pixel_values"])
    torch.testing.assert_close(patch_rows(ids, prompt_images), expected_features, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_a_quantized_mmproj_stays_close(model, engine, images, tmp_path):
    """Q8_0 tower matrices (the converter's --outtype q8_0): features near the exact ones."""
    import gguf

    vision = from_mmproj(
        write_mmproj(model, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0), 64
    )
    vision = with_settings(vision, {"max_patches": MAX_TILES})
    features = torch.cat([e.tokens for e in llama4_images.encode(vision, images)])
    exact = torch.cat([e.tokens for e in llama4_images.encode(engine.vision, images)])
    assert 0 < (features - exact).abs().max() < 0.05 * exact.abs().max()


def test_an_mmproj_with_attn_post_norm_is_refused(model, tmp_path, monkeypatch):
    """The converter's current name for each layer's second LayerNorm, which clip.cpp runs
    as a norm of the attention's output."""
    import llama4_vision_helpers

    monkeypatch.setitem(
        llama4_vision_helpers._GGUF_LAYER, "post_attention_layernorm", "attn_post_norm"
    )
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    with pytest.raises(UnsupportedError, match="attn_post_norm.*second LayerNorm is ln2"):
        from_mmproj(mmproj, 64)


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image\|>\) for 2 images"):
        engine.image_prompt("<|header_start|>user<|header_end|>\n\n<|image|>two?", images)
    with pytest.raises(UsageError, match="of its own"):
        engine.image_prompt("<|image|><|patch|>one?", images[:1])


def test_a_config_s_settings_are_checked(folder, tmp_path):
    import shutil

    other = shutil.copytree(folder, tmp_path / "other")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(
        json.dumps({**settings, "size": {"height": 2 * TILE, "width": 2 * TILE}})
    )
    with pytest.raises(
        ModelFormatError, match="tiles of 168 pixels, but the vision tower takes 84"
    ):
        api.load(str(other), device="cpu", vision=True)
    (other / "preprocessor_config.json").write_text(json.dumps({**settings, "resample": 3}))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(64, 64, seed=5))
    result = llmrun("run", str(other), "--image", str(image), "hi")
    assert result.returncode != 0 and "resample 3" in result.stderr


def test_run_with_an_image_replies_as_transformers(model, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file."""
    image = tmp_path / "cat.png"
    image.write_bytes(picture(120, 150, seed=4))
    opened = open_image(image.read_bytes())
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [opened])
    expected = greedy_tokens(model, model_inputs(engine.vision, ids, [opened]))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    for model_args in ([str(engine.path)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected

"""HunYuan-VL (HunyuanOCR) with images against transformers: a tiny random
HunYuanVLForConditionalGeneration (text hidden 64 in 2 layers, XD-RoPE over four axes in
uneven sections [1, 3, 2, 2]; vision hidden 32 in 3 layers, a learned 4x4 position table)
whose processor (HunYuanVLProcessor: chat template, the image pad expanded,
HunYuanVLImageProcessorPil's patches) makes the reference inputs. Two images, 64x96 (2x3
merged patches: 10 tokens with the newlines, begin and end) and 160x224 (5x7: 42). The
patches, the prompt ids, the XD-RoPE positions (get_rope_index), the image features, the
logits (whole, and a chunked prefill through a KV cache) and 8 greedy tokens match; so
does the model as llama.cpp's converter writes it, a hunyuan_vl text GGUF and the mmproj
GGUF the converter itself writes, and Tencent's flat config.json. transformers runs with
Tencent's XD-RoPE split (hunyuan_vl_helpers.tencents_recomposition: a pair's halves turned
by one axis, as vLLM and llama.cpp do), which transformers 5.25's own split is far from.
Image tokens turned by their places, or with rows and columns swapped, are far off.

Tolerances: 1e-4 on f32 image features (about ±3) and logits (about ±6); patches 1e-5."""

import json
import shutil

import llama_converter
import pytest
import torch
from helpers import needs_converter
from hunyuan_vl_helpers import (
    END,
    IMAGE,
    PAD,
    START,
    flatten_as_tencent,
    greedy_tokens,
    processor,
    processor_inputs,
    save_hunyuan_vl_dir,
    tencents_xd_rope,
    tiny_hunyuan_vl,
    write_text_gguf,
)
from in_process import llmrun
from vision_helpers import picture

from llmrun import api
from llmrun.errors import UsageError
from llmrun.generate import KVState, prefill
from llmrun.hunyuan_vl_images import image_tokens, pixel_patches
from llmrun.images import open_image
from llmrun.models.mrope import MRopeImages
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
ORIGINAL_RECOMPOSITION = transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLRotaryEmbedding.recomposition_frequencies
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def tencents_rope():
    with tencents_xd_rope():
        yield


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(transformers model, its folder, an engine with the vision tower)."""
    model = tiny_hunyuan_vl()
    folder = save_hunyuan_vl_dir(model, tmp_path_factory.mktemp("hunyuan_vl"))
    return model, folder, api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(64, 96, 1)), open_image(picture(160, 224, 2))]


@pytest.fixture(scope="module")
def reference(family, images):
    return processor_inputs(family[1], images, QUESTION)


@pytest.fixture(scope="module")
def prompt(family, images):
    engine = family[2]
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def test_the_prompt_positions_and_patches_are_the_processors(family, images, prompt, reference):
    model, _, engine = family
    ids, prompt_images = prompt
    assert ids == reference.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == IMAGE != ids[i - 1]]
    sizes = [len(e) for e in prompt_images.embeds]
    assert sizes == [10, 42] == [image_tokens(engine.vision, image) for image in images]
    patches = [pixel_patches(image, engine.vision) for image in images]
    assert [[1, *grid] for _, *grid in patches] == reference.image_grid_thw.tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference.pixel_values.flatten(1), atol=1e-5, rtol=0)
    rope, _ = model.model.get_rope_index(
        reference.input_ids, reference.mm_token_type_ids, reference.image_grid_thw
    )
    assert torch.equal(prompt_images.rope, rope[:, 0])


@pytest.mark.parametrize("size", [(20, 300), (600, 1000)])
def test_resizing_matches_the_image_processor(size, family):
    """Below the least pixels (scaled up) and above the most (down)."""
    image = open_image(picture(*size, seed=3, mode="RGBA"))
    expected = processor(family[1]).image_processor(images=image, return_tensors="pt")
    patches, grid_h, grid_w = pixel_patches(image, family[2].vision)
    assert [1, grid_h, grid_w] == expected.image_grid_thw[0].tolist()
    torch.testing.assert_close(patches, expected.pixel_values.flatten(1), atol=1e-5, rtol=0)


def test_image_features_and_logits_match_transformers(family, prompt, reference):
    model, _, engine = family
    ids, prompt_images = prompt
    length = len(ids)
    with torch.no_grad():
        features = model.model.get_image_features(
            reference.pixel_values, reference.image_grid_thw
        ).pooler_output
        expected = model(**reference).logits[0]
        soft = prompt_images.tokens(0, length, CPU)
        whole = engine.model(torch.tensor([ids]), torch.arange(length)[None], images=soft)[0]
        # generate's prefill in chunks of 7 (moved so that no image is split).
        state = KVState(engine.model.new_cache(1, 160, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
        # Planted bugs: image tokens turned by their places; rows and columns swapped.
        plain = MRopeImages(soft.embeds, soft.groups, torch.arange(length).expand(4, -1), 0)
        swapped = MRopeImages(soft.embeds, soft.groups, soft.rope[[0, 2, 1, 3]], 0)
        wrong = [
            engine.model(torch.tensor([ids]), torch.arange(length)[None], images=bug)[0]
            for bug in (plain, swapped)
        ]
    for ours, theirs in zip(prompt_images.embeds, features, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    assert all((bad - expected).abs().max() > 1e-2 for bad in wrong)
    # transformers 5.25's own split (a pair's halves by different axes) is far off.
    rotary = transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLRotaryEmbedding
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(rotary, "recomposition_frequencies", ORIGINAL_RECOMPOSITION)
        assert (model(**reference).logits[0] - expected).abs().max() > 1e-2


def generated(engine, ids, prompt_images, state=None) -> list[int]:
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images, state=state)
    return [r.token for r in stream if r.token is not None]


def test_greedy_tokens_match_transformers(family, prompt, reference):
    model, _, engine = family
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


@needs_converter
def test_gguf_with_the_converters_mmproj_matches_transformers(family, images, reference, tmp_path):
    """The text GGUF and the mmproj that llama.cpp's converter (--mmproj, F32) writes from
    the folder."""
    model, folder, _ = family
    mmproj = tmp_path / "mmproj.gguf"
    llama_converter.convert([[folder, "--mmproj", "--outtype", "f32", "--outfile", mmproj]])
    text = write_text_gguf(model, tmp_path / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    # stories260K's GGUF vocabulary splits the text around the image tokens otherwise than
    # its tokenizer.json: transformers runs on these ids.
    inputs = dict(
        input_ids=torch.tensor([ids]),
        pixel_values=reference.pixel_values,
        image_grid_thw=reference.image_grid_thw,
        mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int(),
    )
    assert [i for i in ids if i == IMAGE] == [i for i in reference.input_ids[0] if i == IMAGE]
    with torch.no_grad():
        features = model.model.get_image_features(
            reference.pixel_values, reference.image_grid_thw
        ).pooler_output
        logits = model(**inputs).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
    torch.testing.assert_close(torch.cat(prompt_images.embeds), torch.cat(features), atol=1e-4, rtol=0)  # fmt: skip
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert generated(engine, ids, prompt_images) == out[0, len(ids) :].tolist()
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)


def test_tencents_flat_config_takes_images_the_same(family, prompt, tmp_path):
    """HunyuanOCR's own config.json: the text fields at the top level, XD-RoPE as
    rope_scaling {"type": "xdrope", "xdrope_section"}."""
    folder, engine = family[1:]
    flat = shutil.copytree(folder, tmp_path / "flat")
    flatten_as_tencent(flat)
    loaded = api.load(str(flat), device="cpu", vision=True)
    ids, prompt_images = prompt
    tower, expected = loaded.vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert all(torch.equal(tower[k], expected[k]) for k in expected)
    forward = (torch.tensor([ids]), torch.arange(len(ids))[None])
    with torch.no_grad():
        ours = loaded.model(*forward, images=prompt_images.tokens(0, len(ids), CPU))[0]
        theirs = engine.model(*forward, images=prompt_images.tokens(0, len(ids), CPU))[0]
    assert torch.equal(ours, theirs)


def test_images_need_their_places(family, images):
    engine = family[2]
    with pytest.raises(UsageError, match=r"marks 1 image place \(.*\) for 2"):
        engine.image_prompt(START + PAD + END + "hi", images)
    with pytest.raises(UsageError, match="at most 200 times as long as they are wide"):
        pixel_patches(open_image(picture(10, 2100, seed=5)), engine.vision)


def test_run_with_an_image_replies_as_transformers(family, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"` prints transformers' greedy reply."""
    from PIL import Image

    model, folder, _ = family
    path = tmp_path / "page.png"
    path.write_bytes(picture(90, 120, seed=4))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], QUESTION))
    args = ("run", str(folder), "--image", str(path), QUESTION, "-n", "8", "--temperature", "0")
    result = llmrun(*args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected

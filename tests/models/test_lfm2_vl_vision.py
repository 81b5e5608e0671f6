"""LFM2-VL with images against transformers: a tiny random Lfm2VlForConditionalGeneration
(SigLIP2 NaFlex tower, pixel-unshuffle projector, LFM2 text with a convolution and an
attention layer). The prompt ids, patch grids and pixel values equal Lfm2VlProcessor's
for images of several shapes, tiled and not, with and without a thumbnail, with the
folder's settings and the processor's defaults (stored in tests/data, as its image
processor needs torchvision; checked against it where torchvision is installed); the
image features, the logits of a prompt with two images of other layouts and 8 greedy
tokens match transformers'; so does the same model as a text GGUF and an mmproj GGUF laid
out as llama.cpp's converter writes them (benchmarks/llama_cpp_lfm2_vl.py checks that
layout against the converter); `run --image` (folder, GGUFs) and `chat` with /image reply
with transformers' tokens. A tower cut at vision_feature_layer matches transformers'
tower with those layers. A pixel unshuffle in another order fails.

Tolerances: ids exact, pixel checksums 1e-6 relative; features and logits 1e-4.
"""

import copy
import dataclasses
import json

import pytest
import torch
from lfm2_vl_helpers import (
    GOLDEN,
    GOLDEN_CASES,
    GOLDEN_TEXT,
    IMAGE,
    case_settings,
    greedy_tokens,
    model_inputs,
    pixel_sums,
    save_lfm2_vl_dir,
    tiny_lfm2_vl,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, lfm2_vl_images, vision_families
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading import lfm2_vl_vision as loading
from llmrun.models import lfm2_vl_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def model():
    return tiny_lfm2_vl()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_lfm2_vl_dir(model, tmp_path_factory.mktemp("lfm2_vl"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    # One frame of 2 x 3 tokens; 2 x 2 tiles of 64 pixels and a thumbnail.
    return [open_image(picture(40, 64, 1)), open_image(picture(200, 300, 4))]


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


@pytest.fixture(scope="module")
def reference(engine, images, prompt):
    return model_inputs(engine.vision, prompt[0], images)


def soft_tokens(ids, prompt_images) -> torch.Tensor:
    """The embeddings of a prompt's <image> places, in order."""
    rows = [
        embeds[[ids[start + i] == IMAGE for i in range(len(embeds))]]
        for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True)
    ]
    return torch.cat(rows)


def image_features(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(
            inputs["pixel_values"], inputs["spatial_shapes"], inputs["pixel_attention_mask"]
        )
    return torch.cat(out.pooler_output)


def test_the_prompt_and_pixels_are_the_processors(engine):
    records = json.loads(GOLDEN.read_text())
    assert len(records) == len(GOLDEN_CASES)
    for record in records:
        height, width, seed = record["image"]
        vision = dataclasses.replace(engine.vision, **_fields(record["settings"]))
        image = open_image(picture(height, width, seed))
        pixels, layout = lfm2_vl_images.frames(vision, image)
        text = GOLDEN_TEXT.replace("<image>", lfm2_vl_images.expansion(vision, layout))
        ids = engine.tokenizer.encode(text)
        assert ids == record["input_ids"], record["image"]
        # The expansion's tokens in place of the one <image> token.
        expanded = len(ids) - len(engine.tokenizer.encode(GOLDEN_TEXT)) + 1
        assert lfm2_vl_images.image_tokens(vision, image) == expanded
        shapes = [[f.shape[1] // vision.patch, f.shape[2] // vision.patch] for f in pixels]
        assert shapes == record["spatial_shapes"], record["image"]
        ours = pixel_sums(torch.cat([lfm2_vl_images.patches(f, vision.patch) for f in pixels]))
        assert ours == pytest.approx(record["pixel_sums"], rel=1e-6, abs=1e-3), record["image"]


def _fields(settings) -> dict:
    """A GOLDEN_CASES settings entry as Lfm2VlVision's fields."""
    fields = case_settings(settings)
    out = {k: v for k, v in loading.DEFAULTS.items()}
    out.update({k: v for k, v in fields.items() if k in loading.DEFAULTS})
    if "image_mean" in fields:
        out.update(mean=tuple(fields["image_mean"]), std=tuple(fields["image_std"]))
    return out


def test_the_stored_inputs_are_the_processors_own(folder):
    """GOLDEN is what transformers' processor gives (its image processor needs
    torchvision)."""
    pytest.importorskip("torchvision")
    from lfm2_vl_helpers import processor_record

    for live, stored in zip(processor_record(folder), json.loads(GOLDEN.read_text()), strict=True):
        sums = live.pop("pixel_sums")
        # The sums of some 10⁶ values in float64, in whichever order torch adds them.
        assert sums == pytest.approx(stored.pop("pixel_sums"), rel=1e-9)
        assert live == stored


def test_image_features_match_transformers(model, engine, images, prompt, reference):
    features = soft_tokens(*prompt)
    assert features.shape == (6 + 4 * 4 + 12, 64)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)


def test_a_pixel_unshuffle_in_another_order_fails(model, engine, images, reference, monkeypatch):
    def columns_first(x, factor):
        # each token a square of patches, but its factor² states gathered column by column
        batch, rows, columns, dim = x.shape
        x = x.reshape(batch, rows // factor, factor, columns // factor, factor, dim)
        x = x.permute(0, 1, 3, 4, 2, 5)
        return x.reshape(batch, rows // factor, columns // factor, dim * factor**2)

    monkeypatch.setattr(lfm2_vl_vision, "pixel_unshuffle", columns_first)
    encoded = lfm2_vl_images.encode(engine.vision, images)
    features = torch.cat([e.tokens for e in encoded])
    assert (features - image_features(model, reference)).abs().max() > 1e-2


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            cache=engine.model.new_cache(1, len(ids), torch.float32, "cpu"),
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def test_logits_with_images_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    assert expected.abs().max() > 1
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def generated(engine, ids, prompt_images, tokens: int = 8) -> list[int]:
    stream = engine.generate(ids, GREEDY, tokens, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    assert generated(engine, *prompt) == expected


def test_gguf_with_mmproj_matches_transformers(model, engine, tmp_path):
    """The mmproj takes the image processor's defaults (64 to 256 tokens an image)."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32, as the converter's --outtype f32 writes it: exact.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", f16=False)
    assert vision_families.of_mmproj(mmproj).name == "LFM2-VL"
    gguf_engine = api.load(str(text), device="cpu", mmproj=mmproj)
    image = [open_image(picture(40, 64, 1))]
    ids, prompt_images = gguf_engine.image_prompt(
        gguf_engine.prompt_text(QUESTION, images=1), image
    )
    record = json.loads(GOLDEN.read_text())[8]  # this image, the processor's defaults
    assert record["settings"] == "defaults" and record["image"] == [40, 64, 1]
    assert ids.count(IMAGE) == record["input_ids"].count(IMAGE) == 7 * 11
    inputs = model_inputs(gguf_engine.vision, ids, image)
    features = soft_tokens(ids, prompt_images)
    torch.testing.assert_close(features, image_features(model, inputs), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    torch.testing.assert_close(logits(gguf_engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    assert generated(gguf_engine, ids, prompt_images) == greedy_tokens(model, inputs)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        loading.from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        loading.from_mmproj(mmproj, 32)


def test_a_quantized_mmproj_loads_gguf_dequantized_weights(model, engine, images, tmp_path):
    """Q8_0 tower matrices (the converter's --outtype q8_0): gguf's dequantization of
    the same blocks."""
    import gguf

    path = write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    vision = loading.from_mmproj(path, 64)
    name = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    original = model.model.vision_tower.encoder.layers[0].self_attn.q_proj.weight.detach()
    blocks = gguf.quants.quantize(original.numpy(), gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(vision.encoder.state_dict()[name], torch.from_numpy(expected))


def test_a_tower_cut_at_vision_feature_layer_is_transformers_shorter_tower(
    model, folder, images, tmp_path
):
    """vision_feature_layer -2 (as llama.cpp's converter counts it): the tower's last layer
    left out; transformers 5 runs whatever layers its config lists."""
    import shutil

    cut = shutil.copytree(folder, tmp_path / "cut")
    config = json.loads((cut / "config.json").read_text())
    config["vision_feature_layer"] = -2
    (cut / "config.json").write_text(json.dumps(config))
    vision = loading.from_hf_dir(cut, 64)
    assert vision.encoder.args.vision.num_hidden_layers == 1
    shorter = copy.deepcopy(model)
    del shorter.model.vision_tower.encoder.layers[1]
    ids = [IMAGE] * lfm2_vl_images.image_tokens(vision, images[1])
    inputs = model_inputs(vision, ids, images[1:])
    features = lfm2_vl_images.encode(vision, images[1:])[0].tokens
    torch.testing.assert_close(features, image_features(shorter, inputs), atol=1e-4, rtol=0)
    assert (features - image_features(model, inputs)).abs().max() > 1e-2


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2 images"):
        engine.image_prompt("<|im_start|>user\n<image>two?<|im_end|>\n", images)


def test_run_with_an_image_replies_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from a GGUF with its
    mmproj file (F16 matrices, as the converter writes them by default; the processor's
    default settings, which give this image more tokens)."""
    from in_process import llmrun

    image = tmp_path / "cat.png"
    image.write_bytes(picture(50, 80, seed=4))
    opened = [open_image(image.read_bytes())]
    gguf = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    gguf_engine = api.load(str(gguf), device="cpu", mmproj=mmproj)
    options = ("--image", str(image), QUESTION, "-n", "8", "--temperature", "0")
    for model_args, loaded in (
        ([str(folder)], engine),
        ([str(gguf), "--mmproj", str(mmproj)], gguf_engine),
    ):
        ids, _ = loaded.image_prompt(loaded.prompt_text(QUESTION, images=1), opened)
        expected = greedy_tokens(model, model_inputs(loaded.vision, ids, opened))
        assert len(expected) >= 4
        result = llmrun("run", *model_args, *options, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected


def test_a_folder_whose_tiles_do_not_fit_the_tower_is_one_error_line(folder, tmp_path):
    import shutil

    from in_process import llmrun

    other = shutil.copytree(folder, tmp_path / "odd-tiles")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    settings["tile_size"] = 40
    (other / "preprocessor_config.json").write_text(json.dumps(settings))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(40, 64, seed=1))
    result = llmrun("run", str(other), "--image", str(image), "Hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1] == (
        f"error: {other}: tiles of 40 pixels are not a multiple of 32 (patches of 16, "
        "unshuffled by 2)"
    )


def test_the_settings_of_a_processor_config_json_and_a_resample_refused(folder, tmp_path):
    """LFM2.5-VL's folders keep the image processor's fields in processor_config.json,
    under image_processor; a resampling filter other than bilinear is refused."""
    import shutil

    from llmrun.errors import UnsupportedError

    other = shutil.copytree(folder, tmp_path / "nested")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").unlink()
    nested = {"image_processor": {**settings, "max_image_tokens": 32, "min_tiles": 3}}
    (other / "processor_config.json").write_text(json.dumps(nested))
    vision = loading.from_hf_dir(other, 64)
    assert (vision.max_image_tokens, vision.min_tiles, vision.tile_size) == (32, 3, 64)
    nested["image_processor"]["resample"] = 3
    (other / "processor_config.json").write_text(json.dumps(nested))
    with pytest.raises(UnsupportedError, match="resample is 3; .* bilinearly only"):
        loading.from_hf_dir(other, 64)


def test_a_chat_with_an_image_replies_as_transformers(model, folder, engine, tmp_path):
    """`llmrun chat FOLDER` with /image: the reply is transformers' greedy tokens (to
    <|im_end|>) after the message with the image."""
    from in_process import llmrun
    from lfm2_vl_helpers import IM_END

    image = tmp_path / "cat.png"
    image.write_bytes(picture(200, 300, seed=5))  # 2 x 2 tiles and a thumbnail
    question = "What is in this picture?"
    opened = [open_image(image.read_bytes())]
    ids, _ = engine.image_prompt(engine.prompt_text(question, images=1), opened)
    tokens = greedy_tokens(model, model_inputs(engine.vision, ids, opened))
    kept = tokens[: tokens.index(IM_END)] if IM_END in tokens else tokens
    assert len(kept) >= 4
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in kept) + stream.flush()
    options = ("-n", "8", "--temperature", "0")
    command = llmrun("chat", folder, *options, input=f"/image {image}\n{question}")
    assert command.returncode == 0, command.stderr
    assert command.stdout == reply + "\n\n"

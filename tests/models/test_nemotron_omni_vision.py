"""Nemotron 3 Nano Omni with images against transformers: a tiny random
NemotronH_Omni_Reasoning_V3 (a RADIO tower of 2 blocks on patches of 8 with a 16 x 16
position table, the pixel shuffle and projector; a Nemotron-H of a Mamba-2 and an attention
layer), its folder as save_pretrained writes it (the Hub's tensor names).

The image processor needs torchvision, which the suite goes without: llmrun's patch grids
and pixels are held to what it gave for five images (GOLDEN; where torchvision is
installed, to the processor itself, every pixel) and then stand in for it. The prompt ids
(the chat template's <image> expanded by the processor's own code), the image features,
the logits of a prompt with two images (one grid under the position table, one wider
than it) and 8 greedy tokens match; `run --image` and `chat` with /image reply with
transformers' tokens; the folder's text alone runs with its note. Reading the position
table resized straight to the grid, or a 2x2 group's patches taken column by column,
fails.

Tolerances: ids and grids exact; pixels 1e-5 (checksums 1e-3 over thousands of values);
features and logits 1e-4 (absolute); tokens exact.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from in_process import llmrun
from nemotron_omni_helpers import (
    GOLDEN,
    GOLDEN_CASES,
    IM_END,
    IMAGE,
    IMG,
    IMG_END,
    greedy_tokens,
    pixel_sums,
    processor_inputs,
    processor_record,
    real_processor_pixels,
    save_nemotron_omni_dir,
    tiny_nemotron_omni,
)
from vision_helpers import picture

from llmrun import api, nemotron_omni_images, vision_families
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading import nemotron_omni_vision
from llmrun.models.nemotron_omni_vision import Embeddings, ImageEncoder
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
QUESTION = "What is in these pictures?"
# 12 x 8 patches (24 tokens), 2 x 30 (15 tokens; wider than the 16-position table).
CASES = [(200, 130, 1), (24, 300, 5)]
TOKENS = [24, 15]


@pytest.fixture(scope="module")
def model():
    return tiny_nemotron_omni()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_nemotron_omni_dir(model, tmp_path_factory.mktemp("nemotron_omni"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(*case)) for case in CASES]


@pytest.fixture(scope="module")
def reference(folder, engine, images):
    return processor_inputs(folder, engine.vision, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.get_image_features(reference["pixel_values"], reference["image_grid_hw"])
    return torch.cat(out.pooler_output)


def logits(engine, ids, prompt_images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]


def encode(vision, images) -> torch.Tensor:
    return torch.cat(vision_families.of_vision(vision).encode(vision, images))


def test_the_stored_pixels_are_the_processors(engine):
    """GOLDEN is the real processor's; where it runs, llmrun's pixels are its own to 1e-5."""
    pytest.importorskip("torchvision")
    assert processor_record() == json.loads(GOLDEN.read_text())
    for case in GOLDEN_CASES:
        real = real_processor_pixels(*case)
        ours, rows, columns = nemotron_omni_images.pixel_patches(
            open_image(picture(*case)), engine.vision
        )
        assert [[rows, columns]] == real["image_grid_hw"].tolist()
        torch.testing.assert_close(ours, real["pixel_values"], atol=1e-5, rtol=0)


def test_the_pixels_prompt_features_and_logits_are_transformers(
    model, engine, images, prompt, reference
):
    """Each GOLDEN image's grid and pixels; the prompt's ids, each image between <img> and
    </img>, one <image> per token; the features, and the logits whole and prefilled in
    chunks that never split an image."""
    assert isinstance(engine.vision, nemotron_omni_vision.NemotronOmniVision)
    for case, stored in zip(GOLDEN_CASES, json.loads(GOLDEN.read_text()), strict=True):
        image = open_image(picture(*case))
        patches, rows, columns = nemotron_omni_images.pixel_patches(image, engine.vision)
        assert [rows, columns] == stored["image_grid_hw"]
        assert pixel_sums(patches) == pytest.approx(stored["pixel_sums"], abs=1e-3, rel=0)
        assert nemotron_omni_images.image_tokens(engine.vision, image) == rows * columns // 4
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    assert reference["image_grid_hw"].tolist() == [[12, 8], [2, 30]]
    assert [len(e) for e in prompt_images.embeds] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1 : start + count + 1] == [IMG, *[IMAGE] * count, IMG_END]
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    stream = engine.generate(*prompt[:1], GREEDY, 8, images=prompt[1])
    assert [r.token for r in stream if r.token is not None] == expected


def test_planted_bugs_give_other_features(engine, images, monkeypatch):
    """The position table is resized to a square of the grid's longer side and cropped,
    and each 2x2 group of patches concatenated row by row: the table resized straight to
    the grid, or a group's patches taken column by column, moves the features."""
    expected = encode(engine.vision, images)

    def straight(self, grid_h, grid_w):
        side = self.args.table_side
        table = self.position_embedding.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        table = F.interpolate(table, size=(grid_h, grid_w), mode="bilinear", align_corners=False)
        return table.flatten(2)[0].T

    def by_columns(self, features, grid_h, grid_w):
        # [h/2, 2 rows, w/2, 2 columns, C] -> [h/2, w/2, 2 columns, 2 rows, C]
        x = features.reshape(grid_h // 2, 2, grid_w // 2, 2, -1).permute(0, 2, 3, 1, 4)
        return x.reshape(grid_h * grid_w // 4, -1)

    bugs = ((Embeddings, "positions", straight), (ImageEncoder, "shuffled", by_columns))
    for cls, name, bug in bugs:
        with monkeypatch.context() as patch:
            patch.setattr(cls, name, bug)
            assert (encode(engine.vision, images) - expected).abs().max() > 1e-2


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2"):
        engine.image_prompt("<|im_start|>user\n<image>two?<|im_end|>\n", images)


def test_the_hubs_config_json_loads_as_transformers_5s(model, folder, tmp_path):
    """The Hub's config.json (its own model_type, llm_config, vit_hidden_size, a
    sound_config) gives the same tower and language model; its audio tower is noted, and
    `show` reads its text model's context and KV cache from llm_config."""
    import shutil

    other = shutil.copytree(folder, tmp_path / "hub")
    config = json.loads((other / "config.json").read_text())
    renames = {
        "text_config": "llm_config",
        "vision_hidden_size": "vit_hidden_size",
        "audio_config": "sound_config",
    }
    hub = {renames.get(k, k): v for k, v in config.items()}
    hub["model_type"] = "NemotronH_Nano_Omni_Reasoning_V3"
    (other / "config.json").write_text(json.dumps(hub))
    loaded = api.load(str(other), device="cpu", vision=True)
    assert loaded.vision.encoder.args == nemotron_omni_vision.from_hf_dir(folder, 64).encoder.args
    state, expected = loaded.model.state_dict(), api.load(str(folder), device="cpu").model
    assert all(torch.equal(state[k], v) for k, v in expected.state_dict().items())
    text = llmrun("run", str(other), QUESTION, "-n", "1", "--temperature", "0")
    assert text.returncode == 0, text.stderr
    assert "Nemotron 3 Nano Omni's audio tower is not run" in text.stderr
    shown = llmrun("show", str(other))
    assert shown.returncode == 0, shown.stderr
    assert "NemotronH_Nano_Omni_Reasoning_V3\n" in shown.stdout  # not an embedding model
    assert "context length 512" in shown.stdout and "256 bytes a token" in shown.stdout


def test_settings_llmrun_does_not_follow_are_refused(folder, tmp_path):
    """The Hub's older names of the processor's mean and std are read; a budget that would
    depend on the count of images, another resampling filter or another patch size is
    refused."""
    import shutil

    other = shutil.copytree(folder, tmp_path / "other")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    hub = {**settings, "norm_mean": [0.5, 0.5, 0.5], "norm_std": [0.25, 0.25, 0.25]}
    (other / "preprocessor_config.json").write_text(json.dumps(hub))
    vision = nemotron_omni_vision.from_hf_dir(other, 64)
    assert (vision.mean, vision.std, vision.max_patches) == ((0.5,) * 3, (0.25,) * 3, 96)
    for change, error, match in (
        ({"max_model_len": 20}, UnsupportedError, "how many images"),
        ({"resample": 2}, UnsupportedError, "resample 2"),
        ({"patch_size": 16}, ModelFormatError, "patch_size 16, the tower's is 8"),
    ):
        (other / "preprocessor_config.json").write_text(json.dumps({**settings, **change}))
        with pytest.raises(error, match=match):
            nemotron_omni_vision.from_hf_dir(other, 64)


def test_run_and_chat_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"` and `llmrun chat FOLDER` with /image reply
    with transformers' greedy tokens; the folder's text alone runs with its note."""
    image = tmp_path / "photo.png"
    image.write_bytes(picture(56, 72, 4))
    opened = [open_image(image.read_bytes())]
    expected = greedy_tokens(model, processor_inputs(folder, engine.vision, opened, QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    kept = expected[: expected.index(IM_END)] if IM_END in expected else expected
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=1), opened)
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in kept) + stream.flush()
    chat = llmrun(
        "chat", folder, "-n", "8", "--temperature", "0", input=f"/image {image}\n{QUESTION}"
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    text = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert text.returncode == 0, text.stderr
    assert "a multimodal Nemotron 3 Nano Omni; running its language model" in text.stderr

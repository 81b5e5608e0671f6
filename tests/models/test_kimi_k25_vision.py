"""Kimi K2.5 with images against transformers: a tiny random Kimi_K25ForConditionalGeneration
(DeepSeek-V3 text of hidden 64 in 2 layers, 4 routed experts; MoonViT of hidden 32 in 3
layers with a learned 4x4 position table) in a folder laid out as the Hub's (kimi_k25_helpers),
which transformers reads back to the same weights and which is the reference here. The
prompt ids, grids and pixels of Kimi_K25Processor (stored in GOLDEN: its image processor
needs torchvision; checked live where it is installed) match; so do the image features, the
logits (whole, and a chunked prefill through a KV cache) and 8 greedy tokens; and the same
with the text as a deepseek2 GGUF and the mmproj that llama.cpp's converter writes.

Tolerances: 1e-4 on f32 image features (about ±15) and logits (about ±7), measured ~8e-6;
pixel checksums 1e-6 relative (sums of ~5·10⁴ values), the first 64 pixels exactly.
"""

import json

import llama_converter
import pytest
import torch
from helpers import needs_converter
from in_process import llmrun
from kimi_k25_helpers import (
    GOLDEN,
    GOLDEN_QUESTION,
    IMAGE,
    greedy_tokens,
    pixel_sums,
    reference_inputs,
    save_kimi_k25_dir,
    tiny_kimi_k25,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, kimi_k25_images
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.kimi_k25_vision import from_mmproj
from llmrun.models import kimi_k25_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
RECORDS = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(transformers' model as it reads the Hub-laid-out folder, the folder, an engine
    with the vision tower)."""
    made = tiny_kimi_k25()
    folder = save_kimi_k25_dir(made, tmp_path_factory.mktemp("kimi_k25"))
    model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(folder).eval()
    read, expected = model.state_dict(), made.state_dict()
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[k], expected[k]) for k in expected)
    return model, folder, api.load(str(folder), device="cpu", vision=True)


def images_of(record: dict) -> list:
    return [open_image(picture(h, w, seed)) for h, w, seed in record["images"]]


@pytest.fixture(scope="module")
def prompt(family):
    engine = family[2]
    images = images_of(RECORDS[0])
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(GOLDEN_QUESTION, images=len(images)), images
    )
    return ids, prompt_images, reference_inputs(engine, ids, images)


def test_the_prompt_and_pixels_are_the_processors(family):
    """Two images (40x60 as it is, 100x150 shrunk to 10 patches a side), one of 64 patches
    at most, one with a side shorter than a patch, padded with zeros to whole 2x2 groups."""
    engine = family[2]
    for record in RECORDS:
        images = images_of(record)
        text = engine.prompt_text(GOLDEN_QUESTION, images=len(images))
        ids, prompt_images = engine.image_prompt(text, images)
        assert ids == record["input_ids"], record["images"]
        tokens = [kimi_k25_images.image_tokens(engine.vision, image) for image in images]
        assert [len(e) for e in prompt_images.embeds] == tokens
        assert ids.count(IMAGE) == sum(tokens)
        inputs = reference_inputs(engine, ids, images)
        assert inputs["image_grid_thw"].tolist() == record["image_grid_thw"], record["images"]
        pixels = inputs["pixel_values"]
        assert pixel_sums(pixels) == pytest.approx(record["pixel_sums"], rel=1e-6)
        assert pixels.flatten()[:64].tolist() == record["first_pixels"]


def test_the_stored_inputs_are_the_processors_own(family):
    """GOLDEN is what transformers' processor gives (its image processor needs
    torchvision)."""
    pytest.importorskip("torchvision")
    from kimi_k25_helpers import processor_record

    for live, stored in zip(processor_record(family[1]), RECORDS, strict=True):
        # The sums of some 10⁴ values in float64, in whichever order torch adds them.
        assert live.pop("pixel_sums") == pytest.approx(stored["pixel_sums"], rel=1e-9)
        assert live == {k: v for k, v in stored.items() if k != "pixel_sums"}


def image_features(model, inputs: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output


def test_image_features_and_logits_match_transformers(family, prompt):
    """Whole, and through generate's prefill in chunks of 7 (moved so that no image is
    split) into a KV cache."""
    model, _, engine = family
    ids, prompt_images, inputs = prompt
    for ours, theirs in zip(prompt_images.embeds, image_features(model, inputs), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        whole = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
        state = KVState(engine.model.new_cache(1, 128, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_a_2d_rope_turning_rows_for_columns_fails(family, prompt, monkeypatch):
    """A planted bug: each head's pairs turned by the patch's row where transformers turns
    them by its column, and the other way round."""
    model, _, engine = family
    _, _, inputs = prompt

    def swapped(args, grid_h, grid_w):
        cos, sin = rotary_angles(args, grid_w, grid_h)
        # the transposed grid's angles, back in row-by-row order of this grid's patches
        order = torch.arange(grid_h * grid_w).view(grid_w, grid_h).T.flatten()
        return cos[order], sin[order]

    rotary_angles = kimi_k25_vision.rotary_angles
    monkeypatch.setattr(kimi_k25_vision, "rotary_angles", swapped)
    images = images_of(RECORDS[0])
    wrong = torch.cat(kimi_k25_images.encode(engine.vision, images))
    assert (wrong - torch.cat(image_features(model, inputs))).abs().max() > 1e-2


def generated(engine, ids, prompt_images) -> list[int]:
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    return [r.token for r in stream if r.token is not None]


def test_greedy_tokens_match_transformers(family, prompt):
    model, _, engine = family
    ids, prompt_images, inputs = prompt
    expected = greedy_tokens(model, inputs)
    assert len(expected) == 8
    assert generated(engine, ids, prompt_images) == expected


@needs_converter
def test_gguf_with_the_converters_mmproj_matches_transformers(family, tmp_path):
    """The text as a deepseek2 GGUF and the mmproj that llama.cpp's converter (--mmproj,
    F32) writes from the folder: its queries and keys reordered for its own 2D RoPE, its
    limit of 16384 patches a image (no side limit: the 100x150 image is not shrunk)."""
    model, folder, _ = family
    mmproj = tmp_path / "mmproj.gguf"
    llama_converter.convert([[folder, "--mmproj", "--outtype", "f32", "--outfile", mmproj]])
    text = write_text_gguf(model, tmp_path / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    assert (engine.vision.max_patches, engine.vision.max_side) == (16384, 512)
    images = images_of(RECORDS[0])
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(GOLDEN_QUESTION, images=len(images)), images
    )
    # stories260K's GGUF vocabulary splits the text otherwise than its tokenizer.json:
    # transformers runs on these ids.
    inputs = reference_inputs(engine, ids, images)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 12]]
    with torch.no_grad():
        logits = model(**inputs).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
    features = torch.cat(image_features(model, inputs))
    torch.testing.assert_close(torch.cat(prompt_images.embeds), features, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, inputs)
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(str(text), device="cpu", vision=True)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_the_hubs_first_config_names_take_images_the_same(family, tmp_path):
    """moonshotai/Kimi-K2.5's config.json names the tower's sizes vt_* and init_pos_emb_*
    and its text model kimi_k2; its preprocessor_config.json holds media_proc_cfg."""
    import shutil

    _, folder, engine = family
    hub = shutil.copytree(folder, tmp_path / "hub")
    config = json.loads((hub / "config.json").read_text())
    vision = config.pop("vision_config")
    config["vision_config"] = {
        "patch_size": vision["patch_size"],
        "init_pos_emb_height": vision["pos_emb_height"],
        "init_pos_emb_width": vision["pos_emb_width"],
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": vision["num_attention_heads"],
        "vt_num_hidden_layers": vision["num_hidden_layers"],
        "vt_hidden_size": vision["hidden_size"],
        "vt_intermediate_size": vision["intermediate_size"],
        "merge_kernel_size": [2, 2],
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": vision["hidden_size"],
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
    }
    for name in ("projection_hidden_size", "projection_layer_norm_eps"):
        config.pop(name)
    config["text_config"]["model_type"] = "kimi_k2"
    (hub / "config.json").write_text(json.dumps(config))
    processor = {
        "media_proc_cfg": {
            "in_patch_limit": 64,
            "patch_limit_on_one_side": 10,
            "patch_size": 14,
            "merge_kernel_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
    }
    (hub / "preprocessor_config.json").write_text(json.dumps(processor))
    loaded = api.load(str(hub), device="cpu", vision=True)
    assert loaded.vision.encoder.args == engine.vision.encoder.args
    assert (loaded.vision.max_patches, loaded.vision.max_side) == (64, 10)
    tower, expected = loaded.vision.encoder.state_dict(), engine.vision.encoder.state_dict()
    assert all(torch.equal(tower[k], expected[k]) for k in expected)
    ids = loaded.tokenizer.encode("<|im_user|>user<|im_middle|>Hi<|im_end|>")
    with torch.no_grad():
        forward = (torch.tensor([ids]), torch.arange(len(ids))[None])
        torch.testing.assert_close(loaded.model(*forward), engine.model(*forward), atol=0, rtol=0)


def test_images_need_their_places(family):
    engine = family[2]
    images = images_of(RECORDS[0])
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|media_pad\|>\) for 2"):
        engine.image_prompt("<|media_pad|>hi", images)
    text = engine.prompt_text(GOLDEN_QUESTION, images=1) + "<|media_pad|>"
    with pytest.raises(UsageError, match="marks 2 image places"):
        engine.image_prompt(text, images[:1])


def test_run_with_an_image_replies_as_transformers_and_the_text_alone_runs(family, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"` prints transformers' greedy tokens; without
    an image the folder runs its DeepSeek-V3 language model (the Hub's
    language_model.model.* keys), saying so, with transformers' logits."""
    model, folder, engine = family
    record = RECORDS[3]
    (height, width, seed) = record["images"][0]
    path = tmp_path / "picture.png"
    path.write_bytes(picture(height, width, seed))
    inputs = reference_inputs(engine, record["input_ids"], [open_image(path)])
    expected = greedy_tokens(model, inputs)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = ("run", str(folder), "--image", str(path), GOLDEN_QUESTION, "-n", "8")
    result = llmrun(*args, "--temperature", "0", "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    result = llmrun("run", str(folder), GOLDEN_QUESTION, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "a multimodal Kimi K2.5; running its language model" in result.stderr
    assert "until an image is given" in result.stderr
    text_only = api.load(str(folder), device="cpu")
    assert text_only.vision is None
    assert text_only.checkpoint.config["model_type"] == "deepseek_v3"
    ids = text_only.tokenizer.encode(
        text_only.render([{"role": "user", "content": GOLDEN_QUESTION}])
    )
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
        ours = text_only.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)

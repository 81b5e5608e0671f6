"""GLM-OCR with images against transformers: a tiny random GlmOcrForConditionalGeneration
(glm4v_helpers' sizes: text hidden 64 in 2 layers without q/k/v biases, M-RoPE sections
[2, 3, 3]; vision hidden 32 in 2 blocks with per-head q/k norms, no learned positions)
whose processor (Glm4vProcessor's chat template, <|image|> expansion and patches) makes
the reference inputs. Two images, 56x84 (3x4 merged tokens) and 140x224 (5x8): the
prompt ids, the patches, the image features, the logits and 8 greedy tokens match; so do
the same model's files as llama.cpp's converter writes them (a glm4 text GGUF, an mmproj
GGUF of projector glm4v with attn_q_norm / attn_k_norm and no v.position_embd).

Tolerances: 1e-4 on f32 image features and logits; patches 1e-5."""

import json

import pytest
import torch
from glm4v_helpers import (
    IMAGE,
    greedy_tokens,
    processor_inputs,
    save_glm4v_dir,
    tiny_glm4v,
    write_mmproj,
    write_text_gguf,
)
from in_process import llmrun
from vision_helpers import picture

from llmrun import api
from llmrun.glm4v_images import pixel_patches
from llmrun.images import open_image
from llmrun.models.base import RMSNorm
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_glm4v(kind="GlmOcr")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glm4v_dir(model, tmp_path_factory.mktemp("glm-ocr"))


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(56, 84, 1)), open_image(picture(140, 224, 2))]


@pytest.fixture(scope="module")
def reference(model, folder, images):
    inputs = processor_inputs(folder, images, QUESTION)
    with torch.no_grad():
        features = model.model.get_image_features(
            inputs.pixel_values, inputs.image_grid_thw
        ).pooler_output
        logits = model(**inputs).logits[0]
    return inputs, torch.cat(features), logits, greedy_tokens(model, inputs)


def check_matches_transformers(engine, images, reference) -> None:
    """The engine's prompt ids, image features, logits and 8 greedy tokens are
    transformers'."""
    inputs, features, logits, tokens = reference
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    assert ids == inputs.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == IMAGE != ids[i - 1]]
    with torch.no_grad():
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
    torch.testing.assert_close(torch.cat(prompt_images.embeds), features, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == tokens
    assert len(tokens) == 8


def test_a_folder_takes_images_as_transformers(folder, images, reference, monkeypatch):
    """The patches, ids, features, logits and greedy tokens; the q/k norms left out (a
    planted bug), the features move."""
    engine = api.load(str(folder), device="cpu", vision=True)
    patches = [pixel_patches(image, engine.vision) for image in images]
    assert [grid for _, *grid in patches] == reference[0].image_grid_thw[:, 1:].tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference[0].pixel_values, atol=1e-5, rtol=0)
    check_matches_transformers(engine, images, reference)

    attention = engine.vision.encoder.blocks[0].attn
    assert isinstance(attention.q_norm, RMSNorm)
    monkeypatch.setattr(attention.q_norm, "forward", lambda x: x)
    monkeypatch.setattr(attention.k_norm, "forward", lambda x: x)
    wrong = torch.cat([e.flatten(0, 1) for e in engine.encode_images(images[:1])])
    assert (wrong - reference[1][: len(wrong)]).abs().max() > 1e-2


def test_gguf_with_mmproj_takes_images_as_transformers(model, images, reference, tmp_path):
    """The text GGUF with its MTP layer last (skipped, as llama.cpp skips it) and the
    mmproj."""
    text = write_text_gguf(model, tmp_path / "model.gguf", mtp=True)
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    assert engine.vision.encoder.args.glm_ocr
    assert len(engine.model.model.layers) == model.config.text_config.num_hidden_layers
    check_matches_transformers(engine, images, reference)


def test_the_hub_s_mtp_layer_is_left_out(model, folder, tmp_path):
    """The Hub's checkpoint holds a layer past num_hidden_layers (its MTP layer), which
    transformers never runs: the text model loads without it, and its logits stay."""
    import shutil

    from safetensors.torch import load_file, save_file

    with_mtp = shutil.copytree(folder, tmp_path / "with-mtp")
    weights = load_file(with_mtp / "model.safetensors")
    extra = {
        k.replace(".layers.1.", ".layers.2."): v.clone()
        for k, v in weights.items()
        if ".language_model.layers.1." in k
    }
    save_file({**weights, **extra}, with_mtp / "model.safetensors", metadata={"format": "pt"})
    ids = list(range(3, 20))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
        engine = api.load(str(with_mtp), device="cpu")
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_run_with_an_image_replies_as_transformers(model, folder, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"` prints transformers' greedy reply."""
    from PIL import Image

    path = tmp_path / "page.png"
    path.write_bytes(picture(90, 120, seed=4))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], QUESTION))
    args = ("run", str(folder), "--image", str(path), QUESTION, "-n", "8", "--temperature", "0")
    result = llmrun(*args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected

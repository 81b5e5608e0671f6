"""GLM-4.6V as transformers 5 saves it (model_type glm46v, Glm46VForConditionalGeneration;
the Hub's own GLM-4.6V and GLM-4.6V-Flash files say glm4v_moe and glm4v, which
test_glm4v_vision covers) against transformers: tiny random models of glm4v_helpers' sizes
(text hidden 64 in 2 layers with M-RoPE sections [2, 3, 3]; vision hidden 32 in 2
blocks), whose Glm46VProcessor (Glm4vProcessor's chat template, <|image|> expansion and
patches) makes the reference inputs. Its language model is the one its text_config
names: GLM-4.1V's (the config's default) or GLM-4.5V's experts, which transformers saves
stacked here. Two images, 56x84 (3x4 merged tokens) and 140x224 (5x8): the prompt ids,
the patches, the image features, the logits and 8 greedy tokens match, from the folder
and from its GGUFs as llama.cpp's converter writes them once the folder names
Glm4vForConditionalGeneration (the converter refuses Glm46VForConditionalGeneration; its
mmproj and text GGUF of this model equal write_mmproj's and write_text_gguf's tensor for
tensor, benchmarks/llama_cpp_glm46v_vision.py checks the mmproj).

Tolerances: 1e-4 on f32 image features and logits; patches 1e-5."""

import json
import shutil

import pytest
import torch
from glm4v_helpers import (
    IMAGE,
    greedy_tokens,
    processor,
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
from llmrun.loading import experts
from llmrun.models import glm4
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")
KIND = "Glm46V"


@pytest.fixture(scope="module")
def model():
    return tiny_glm4v(kind=KIND)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_glm4v_dir(model, tmp_path_factory.mktemp("glm46v"))


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(56, 84, 1)), open_image(picture(140, 224, 2))]


def reference_of(model, folder, images):
    """The processor's inputs, transformers' image features, logits and 8 greedy tokens."""
    inputs = processor_inputs(folder, images, QUESTION, KIND)
    with torch.no_grad():
        features = model.model.get_image_features(
            inputs.pixel_values, inputs.image_grid_thw
        ).pooler_output
        logits = model(**inputs).logits[0]
    return inputs, torch.cat(features), logits, greedy_tokens(model, inputs)


@pytest.fixture(scope="module")
def reference(model, folder, images):
    return reference_of(model, folder, images)


def logits_with_images(engine, images) -> tuple[list[int], torch.Tensor, object]:
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    with torch.no_grad():
        logits = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )[0]
    return ids, logits, prompt_images


def check_matches_transformers(engine, images, reference) -> None:
    """The engine's prompt ids, image features, logits and 8 greedy tokens are
    transformers'."""
    inputs, features, logits, tokens = reference
    ids, ours, prompt_images = logits_with_images(engine, images)
    assert ids == inputs.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == IMAGE != ids[i - 1]]
    torch.testing.assert_close(torch.cat(prompt_images.embeds), features, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == tokens
    assert len(tokens) == 8


def test_a_folder_takes_images_as_transformers(folder, images, reference, monkeypatch):
    """The patches, ids, features, logits and greedy tokens; the text turned by halves
    (GLM-4.5V's way, a planted bug) instead of GLM-4.1V's adjacent pairs, the logits
    move."""
    engine = api.load(str(folder), device="cpu", vision=True)
    patches = [pixel_patches(image, engine.vision) for image in images]
    assert [grid for _, *grid in patches] == reference[0].image_grid_thw[:, 1:].tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference[0].pixel_values, atol=1e-5, rtol=0)
    check_matches_transformers(engine, images, reference)

    monkeypatch.setattr(glm4.Attention, "rotate", lambda self, x, frame: frame.rotate(x))
    wrong = logits_with_images(engine, images)[1]
    assert (wrong - reference[2]).abs().max() > 1e-2


def test_text_alone_runs_with_a_note(model, folder):
    """`llmrun run FOLDER "prompt"`: the language model alone on the chat template's ids,
    transformers' greedy tokens, and a note naming GLM-4.6V."""
    made = processor(folder, KIND)
    messages = [{"role": "user", "content": QUESTION}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = made.tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    args = ("run", folder, QUESTION, "-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    result = llmrun(*args)
    assert result.returncode == 0, result.stderr
    ours = [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]
    # generate() goes past stories260K's </s> (2), where llmrun stops.
    assert ours == expected[: expected.index(2) if 2 in expected else 8]
    assert "a multimodal GLM-4.6V; running its language model" in result.stderr


def test_gguf_with_mmproj_takes_images_as_transformers(model, images, reference, tmp_path):
    """The glm4 text GGUF (q/k rows reordered into halves, the rotated width and the
    sections) and the glm4v mmproj, as the converter writes them of GLM-4.1V's layout."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    check_matches_transformers(api.load(str(text), device="cpu", mmproj=mmproj), images, reference)


def test_moe_text_takes_images_as_transformers(images, tmp_path, monkeypatch):
    """A text_config of glm4v_moe_text: GLM-4.5V's language model, its experts stacked as
    transformers saves them; each expert's gate and up rows swapped (a planted bug), the
    logits move."""
    model = tiny_glm4v(kind=KIND, moe=True)
    folder = save_glm4v_dir(model, tmp_path / "glm46v-moe")
    reference = reference_of(model, folder, images)
    check_matches_transformers(api.load(str(folder), device="cpu", vision=True), images, reference)

    split = experts.split_stacked

    def swapped(*args, **kwargs):
        out = split(*args, **kwargs)
        for name in [n for n in out if n.endswith(".gate_proj.weight") and ".experts." in n]:
            up = name.replace(".gate_proj.", ".up_proj.")
            out[name], out[up] = out[up], out[name]
        return out

    monkeypatch.setattr(experts, "split_stacked", swapped)
    wrong = logits_with_images(api.load(str(folder), device="cpu", vision=True), images)[1]
    assert (wrong - reference[2]).abs().max() > 1e-2


def test_an_unknown_text_model_is_refused(folder, tmp_path):
    """A text_config naming a model llmrun does not read as GLM-4.6V's: one error line."""
    odd = shutil.copytree(folder, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["text_config"]["model_type"] = "glm4_text"
    (odd / "config.json").write_text(json.dumps(config))
    result = llmrun("run", odd, "hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "GLM-4.6V text_config of model_type 'glm4_text'" in result.stderr

"""Qwen3-VL with images against transformers: a tiny random
Qwen3VLForConditionalGeneration (qwen3_vl_helpers: text hidden 64 in 2 layers with uneven
interleaved M-RoPE sections [3, 2, 3]; vision hidden 32 in 3 blocks, the second's features
deepstacked into the first decoder layer, a 4x4 grid of learned positions resampled to
each image) whose processor (Qwen3VLProcessor: chat template, <|image_pad|> expanded,
Qwen2VLImageProcessor's patches of 16 pixels) makes the reference inputs. Two images, 64x96
(2x3 merged tokens) and 160x224 (5x7). The patches, the prompt ids, the image and deepstack
features, the logits (whole, and a chunked prefill through a KV cache) and 8 greedy tokens
(decoding after the images at shifted positions) match; so do the same model as llama.cpp's
converter writes it, a qwen3vl text GGUF and an mmproj GGUF (the converter's own layout:
tests/qwen3_vl_helpers.write_qwen3_mmproj gives the tiny model's keys, values, tensor names
and tensors as convert_hf_to_gguf.py --mmproj does, checked against it once), the MoE
(Qwen3VLMoeForConditionalGeneration) and Qwen3.5 (Qwen3_5ForConditionalGeneration: no
deepstack, a hybrid language model). Planted bugs fail: deepstack features left out, the
M-RoPE sections taken in blocks rather than interleaved.

Tolerances: 1e-4 on f32 image features (about ±10) and logits (about ±8); patches 1e-5.
"""

import dataclasses
import json

import pytest
import torch
from in_process import llmrun
from qwen2_vl_helpers import IMAGE, TEXT, tiny_qwen_vl, write_mmproj
from qwen3_vl_helpers import (
    PROCESSOR,
    processor_inputs,
    save_qwen3_vl_dir,
    tiny_qwen3_5,
    tiny_qwen3_vl,
    write_qwen3_mmproj,
    write_qwen3_text_gguf,
)
from vision_helpers import picture

from llmrun import api
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.qwen3_vl_vision import from_mmproj
from llmrun.models import mrope
from llmrun.models.mrope import MRopeImages
from llmrun.qwen2_vl_images import pixel_patches
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")
HIDDEN = 64
EOS = TEXT["eos_token_id"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(transformers model, its folder, an engine with the vision tower)."""
    model = tiny_qwen3_vl()
    folder = save_qwen3_vl_dir(model, tmp_path_factory.mktemp("qwen3-vl"))
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


def forward(model, ids, images) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], images=images)[0]


def test_the_prompt_and_patches_are_the_processors(family, images, prompt, reference):
    engine = family[2]
    ids, prompt_images = prompt
    assert ids == reference.input_ids[0].tolist()
    assert prompt_images.starts == [i for i, t in enumerate(ids) if t == IMAGE != ids[i - 1]]
    assert [len(e) for e in prompt_images.embeds] == [6, 35]
    patches = [pixel_patches(image, engine.vision) for image in images]
    assert [grid for _, *grid in patches] == reference.image_grid_thw[:, 1:].tolist()
    ours = torch.cat([p for p, *_ in patches])
    torch.testing.assert_close(ours, reference.pixel_values, atol=1e-5, rtol=0)


def test_image_and_deepstack_features_match_transformers(family, prompt, reference):
    """Each image token's embedding: its features, then its deepstack features."""
    with torch.no_grad():
        expected = family[0].model.get_image_features(
            reference.pixel_values, reference.image_grid_thw
        )
    (deepstack,) = expected.deepstack_features
    for i, ours in enumerate(prompt[1].embeds):
        assert ours.shape[1] == 2 * HIDDEN
        torch.testing.assert_close(ours[:, :HIDDEN], expected.pooler_output[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours[:, HIDDEN:], deepstack[i], atol=1e-4, rtol=0)


def test_logits_with_images_match_transformers(family, prompt, reference, monkeypatch):
    model, _, engine = family
    ids, prompt_images = prompt
    length = len(ids)
    soft = prompt_images.tokens(0, length, CPU)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7 (moved so that no image is split): the text
        # after the first image turns by the shift the KV cache keeps.
        state = KVState(engine.model.new_cache(1, 160, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(forward(engine.model, ids, soft), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    # Planted bugs: the deepstack features left out; the sections in blocks.
    shallow = MRopeImages(soft.embeds[:, :HIDDEN], soft.groups, soft.rope, soft.shift)
    assert (forward(engine.model, ids, shallow) - expected).abs().max() > 1e-2
    angles = mrope.angles
    monkeypatch.setattr(mrope, "angles", lambda *a: angles(*a[:4], interleaved=False))
    assert (forward(engine.model, ids, soft) - expected).abs().max() > 1e-2


def generated(engine, ids, prompt_images, state=None) -> list[int]:
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images, state=state)
    return [r.token for r in stream if r.token is not None]


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs.input_ids.shape[1] :].tolist()


def test_greedy_tokens_match_transformers_and_text_after_them_too(family, prompt, reference):
    """8 tokens decoded at positions shifted by the images; then, through the same KV
    cache, a text-only prompt turns by plain positions again."""
    model, folder, engine = family
    expected = greedy_tokens(model, reference)
    assert len(expected) == 8
    state = engine.new_state(256)
    assert generated(engine, *prompt, state=state) == expected
    assert state.cache.rope_shifts
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert generated(engine, ids, None, state=state) == out[0, len(ids) :].tolist()
    assert not state.cache.rope_shifts


def test_gguf_with_mmproj_matches_transformers(family, images, prompt, reference, tmp_path):
    """The mmproj has no pixel limits: the Hub processor's, which scale these images up
    to 256x256 pixels or more (as transformers' processor with the Hub's settings does);
    the folder's limits given, its tokens are the folder's."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = family[0]
    text = write_qwen3_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_qwen3_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    hub = {**PROCESSOR, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    grids = Qwen2VLImageProcessorPil(**hub)(images=images, return_tensors="pt").image_grid_thw
    assert [engine.image_tokens(image) for image in images] == (grids.prod(-1) // 4).tolist()
    engine.vision = dataclasses.replace(engine.vision, min_pixels=4096)
    ids, prompt_images = engine.image_prompt(engine.prompt_text(QUESTION, images=2), images)
    assert ids == prompt[0]
    for ours, theirs in zip(prompt_images.embeds, prompt[1].embeds, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    with torch.no_grad():
        logits = model(**reference).logits[0]
    ours = forward(engine.model, ids, prompt_images.tokens(0, len(ids), CPU))
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, HIDDEN)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


def test_run_with_an_image_replies_as_transformers(family, tmp_path):
    """`llmrun run FOLDER --image PATH "prompt"` prints transformers' greedy reply, up to
    its end-of-sequence token."""
    from PIL import Image

    model, folder, _ = family
    path = tmp_path / "cat.png"
    path.write_bytes(picture(96, 128, seed=4))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], QUESTION))
    args = ("run", str(folder), "--image", str(path), QUESTION, "-n", "8", "--temperature", "0")
    result = llmrun(*args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    # run stops at the end-of-sequence token, which it does not print.
    stop = expected.index(EOS) if EOS in expected else len(expected)
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected[:stop]


def test_images_need_a_qwen3_vl_language_model(family, tmp_path):
    """Qwen3-VL's images go to its language model with M-RoPE, an mmproj with a GGUF:
    one line each, naming what to give."""
    model = family[0]
    mmproj = write_qwen3_mmproj(model, tmp_path / "mmproj.gguf")
    plain = tmp_path / "plain"
    save_qwen3_vl_dir(model, plain)
    config = json.loads((plain / "config.json").read_text())
    config["text_config"]["rope_parameters"].pop("mrope_section")
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="Qwen3-VL/Qwen3.5's images go to its own language model"):
        api.load(str(plain), device="cpu", vision=True)
    with pytest.raises(UsageError, match="--mmproj goes with a GGUF model"):
        api.load(str(family[1]), device="cpu", mmproj=mmproj)


def test_a_qwen2_vl_mmproj_is_refused_for_a_qwen3_vl_language_model(family, tmp_path):
    """Both language models turn by M-RoPE, but Qwen2-VL's tower feeds only Qwen2's."""
    text = write_qwen3_text_gguf(family[0], tmp_path / "qwen3vl.gguf")
    qwen2_mmproj = write_mmproj(tiny_qwen_vl(), tmp_path / "mmproj-qwen2vl.gguf")
    with pytest.raises(UsageError, match="Qwen2-VL/2.5-VL's images go to its own language model"):
        api.load(str(text), device="cpu", mmproj=qwen2_mmproj)


def test_an_mmproj_of_another_deepstack_count_is_refused(family, tmp_path):
    """The text GGUF says how many deepstack features its layers add; a tower that gives
    another number is another model's (llama.cpp refuses it by the embedding width)."""
    model = family[0]
    mmproj = write_qwen3_mmproj(model, tmp_path / "mmproj.gguf")
    vision = model.config.vision_config
    indexes = list(vision.deepstack_visual_indexes)
    vision.deepstack_visual_indexes = indexes[:-1]
    try:
        text = write_qwen3_text_gguf(model, tmp_path / "other.gguf")
    finally:
        vision.deepstack_visual_indexes = indexes
    with pytest.raises(UsageError, match=f"adds {len(indexes) - 1} deepstack features"):
        api.load(str(text), device="cpu", mmproj=mmproj)
    same = write_qwen3_text_gguf(model, tmp_path / "same.gguf")
    assert api.load(str(same), device="cpu", mmproj=mmproj).vision is not None


def test_the_moe_takes_images_as_transformers(images, tmp_path):
    """Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration: 4 experts, 2 a token): the same
    tower, its language model's logits and greedy tokens with the images."""
    model = tiny_qwen3_vl(moe=True)
    folder = save_qwen3_vl_dir(model, tmp_path / "moe")
    engine = api.load(str(folder), device="cpu", vision=True)
    reference = processor_inputs(folder, images, QUESTION)
    ids, prompt_images = engine.image_prompt(engine.prompt_text(QUESTION, images=2), images)
    assert ids == reference.input_ids[0].tolist()
    with torch.no_grad():
        expected = model(**reference).logits[0]
    ours = forward(engine.model, ids, prompt_images.tokens(0, len(ids), CPU))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)


def test_qwen3_5_takes_images_as_transformers(images, tmp_path, monkeypatch):
    """Qwen3.5 (Qwen3_5ForConditionalGeneration): the same tower without deepstack, its
    hybrid language model's full-attention layer turned by interleaved M-RoPE over a
    quarter of each head: logits and greedy tokens with the images; the sections in
    blocks fail."""
    model = tiny_qwen3_5()
    folder = save_qwen3_vl_dir(model, tmp_path / "qwen3.5")
    engine = api.load(str(folder), device="cpu", vision=True)
    reference = processor_inputs(folder, images, QUESTION)
    ids, prompt_images = engine.image_prompt(engine.prompt_text(QUESTION, images=2), images)
    assert ids == reference.input_ids[0].tolist()
    assert prompt_images.embeds[0].shape == (6, HIDDEN)
    with torch.no_grad():
        expected = model(**reference).logits[0]
    soft = prompt_images.tokens(0, len(ids), CPU)
    torch.testing.assert_close(forward(engine.model, ids, soft), expected, atol=1e-4, rtol=0)
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, reference)
    angles = mrope.angles
    monkeypatch.setattr(mrope, "angles", lambda *a: angles(*a[:4], interleaved=False))
    assert (forward(engine.model, ids, soft) - expected).abs().max() > 1e-2

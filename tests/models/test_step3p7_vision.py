"""Step 3.7 (step3p7: a ViT with a 2-D RoPE and layer scales, two stride-2 convolutions, a
linear projector, Step 3.5 text) with images against transformers: a tiny random
Step3p7ForConditionalGeneration (text hidden 64 in 2 layers, a global dense one and a
sliding one of experts; vision hidden 32 in 2 layers of 2 heads, 14-pixel patches, a
112-pixel global view of 4 soft tokens and 56-pixel local crops of 1, whose positions are
the global grid's resized). Its folder is as save_pretrained writes it: StepFun's tensor
names (fused, RoPE-paired in_proj). Images: 60x50 (the global view alone), 80x150 (2 rows
of 3 crops), 20x150 (near-degenerate: padded to a square, 3x3 crops), and for the pixels
only 40x100 (a small elongated image: crops of its short side) and 500x90 (scaled to
max_image_size 400 first). The prompt ids and pixels are Step3p7Processor's (stored in
tests/data/step3p7_processor.json: its image processor needs torchvision; checked live,
every pixel, where torchvision is installed); the image features, the logits and 8 greedy
tokens are Step3p7ForConditionalGeneration's on those pixels. Reading in_proj without
reordering its RoPE pairs, or the crops' positions without resizing, fails.

Tolerances: pixels 1e-5 (sums of the stored ones to 1e-6 relative); f32 image features and
logits 1e-4.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from in_process import llmrun
from llama_converter import run_converter
from step3p7_helpers import (
    CONVERT_TINY,
    HUB_TEXT,
    IM_END,
    IM_PATCH,
    IM_START,
    PATCH_START,
    PROCESSOR,
    TEMPLATE,
    save_folder,
    tiny_model,
)
from vision_checks import check_run_chat_and_serve_with_an_image
from vision_helpers import picture

from llmrun import api, step3p7_images, vision_families
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading import step3p7_vision as step3p7_loading
from llmrun.models import step3p7_vision
from llmrun.multimodal import PromptImages
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

STORED = Path(__file__).parent.parent / "data" / "step3p7_processor.json"
QUESTION = "What is in these pictures?"
PROMPT_IMAGES = ((60, 50, 1), (80, 150, 2), (20, 150, 4))  # height, width, seed
PIXEL_IMAGES = (*PROMPT_IMAGES, (40, 100, 3), (500, 90, 5))
GREEDY = SamplingParams(temperature=0.0)


def pixel_sums(pixels: torch.Tensor) -> list[float]:
    """Sums that a wrong pixel, crop or order changes: the plain sum, and one weighted by
    each value's place."""
    flat = pixels.double().flatten()
    weights = torch.cos(torch.arange(len(flat), dtype=torch.float64) * 0.01)
    return [flat.sum().item(), (flat * weights).sum().item()]


def _processor(folder: Path):
    return transformers.Step3p7Processor(
        image_processor=transformers.Step3p7ImageProcessor(**PROCESSOR),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )


def processor_pixels(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor, list[bool]]]:
    """Step3p7ImageProcessor's global view, crops and row ends of each of PIXEL_IMAGES
    (needs torchvision)."""
    out = []
    for image in PIXEL_IMAGES:
        inputs = _processor(folder).image_processor(
            images=[open_image(picture(*image))], return_tensors="pt"
        )
        crops = inputs.get("pixel_values_local", torch.zeros(0, 3, 56, 56))
        out.append(
            (inputs["pixel_values"][0], crops, (inputs.get("patch_newline_masks") or [[]])[0])
        )
    return out


def processor_record(folder: Path) -> dict:
    """Step3p7Processor's input_ids for one user message of PROMPT_IMAGES then QUESTION,
    and each of PIXEL_IMAGES' crop count, row ends and pixel sums (needs torchvision)."""
    processor = _processor(folder)
    content = [{"type": "image"}] * len(PROMPT_IMAGES) + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [open_image(picture(*image)) for image in PROMPT_IMAGES]
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {
        "input_ids": inputs["input_ids"][0].tolist(),
        "images": [
            {
                "crops": len(crops),
                "row_ends": ends,
                "global": pixel_sums(view),
                "local": pixel_sums(crops),
            }
            for view, crops, ends in processor_pixels(folder)
        ],
    }


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_folder(model, tmp_path_factory.mktemp("step3p7"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(*image)) for image in PROMPT_IMAGES]


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


def reference_inputs(engine, images) -> dict:
    """transformers' pixel inputs of `images`, from llmrun's pixels."""
    cut = [step3p7_images.pixel_values(engine.vision, image) for image in images]
    crops = torch.cat([c for _, c in cut])
    return {
        "pixel_values": torch.stack([view for view, _ in cut]),
        "pixel_values_local": crops if len(crops) else None,
        "num_local_patches": [len(c) for _, c in cut],
    }


def image_features(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(**inputs).pooler_output)


def soft_tokens(prompt) -> torch.Tensor:
    """The image features of a prompt: its images' rows in <im_patch> places."""
    ids, prompt_images = prompt
    rows = [
        embeds[i]
        for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True)
        for i in range(len(embeds))
        if ids[start + i] == IM_PATCH
    ]
    return torch.stack(rows)


def test_the_prompt_and_pixels_are_the_processors(engine, images, prompt):
    stored = json.loads(STORED.read_text())
    ids, prompt_images = prompt
    assert ids == stored["input_ids"]
    for image, record in zip(PIXEL_IMAGES, stored["images"], strict=True):
        opened = open_image(picture(*image))
        view, crops = step3p7_images.pixel_values(engine.vision, opened)
        cut = step3p7_images.plan(engine.vision, opened.width, opened.height)
        assert len(crops) == record["crops"] == cut.crops
        ends = [(i + 1) % cut.columns == 0 and i + 1 < cut.crops for i in range(cut.crops)]
        assert ends == record["row_ends"]
        assert pixel_sums(view) == pytest.approx(record["global"], rel=1e-6, abs=1e-3)
        assert pixel_sums(crops) == pytest.approx(record["local"], rel=1e-6, abs=1e-3)
    assert [r["crops"] for r in stored["images"]] == [0, 6, 9, 3, 14]
    assert [engine.image_tokens(i) for i in images] == [6, 6 * 3 + 1 + 6, 9 * 3 + 2 + 6]
    # Each image's span: from its first soft token to its global view's last.
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start - 1] in (PATCH_START, IM_START) and ids[start + len(embeds)] == IM_END


def test_the_stored_inputs_are_the_processors_own(engine, folder):
    pytest.importorskip("torchvision")
    live, stored = processor_record(folder), json.loads(STORED.read_text())
    assert live["input_ids"] == stored["input_ids"]
    for got, want in zip(live["images"], stored["images"], strict=True):
        assert (got["crops"], got["row_ends"]) == (want["crops"], want["row_ends"])
        assert got["global"] == pytest.approx(want["global"], rel=1e-6, abs=1e-3)
        assert got["local"] == pytest.approx(want["local"], rel=1e-6, abs=1e-3)
    for image, (view, crops, _) in zip(PIXEL_IMAGES, processor_pixels(folder), strict=True):
        ours = step3p7_images.pixel_values(engine.vision, open_image(picture(*image)))
        torch.testing.assert_close(ours[0], view, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours[1], crops, atol=1e-5, rtol=0)


def test_features_logits_and_greedy_tokens_match_transformers(model, engine, images, prompt):
    ids, prompt_images = prompt
    inputs = reference_inputs(engine, images)
    expected = image_features(model, inputs)
    torch.testing.assert_close(soft_tokens(prompt), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
        theirs = model(input_ids=torch.tensor([ids]), **inputs).logits[0]
    assert theirs.abs().max() > 2
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), **inputs, max_new_tokens=8, do_sample=False
        )
    expected_tokens = out[0, len(ids) :].tolist()
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected_tokens
    assert len(expected_tokens) == 8


def test_unordered_rope_pairs_or_unresized_positions_fail(
    model, folder, engine, images, monkeypatch
):
    """Reading in_proj's q and k rows as they are stored, or giving a crop the global
    grid's first positions, gives other features."""
    expected = image_features(model, reference_inputs(engine, images))
    with monkeypatch.context() as patch:
        patch.setattr(step3p7_loading, "_pairs_to_halves", lambda rows, heads: rows)
        unordered = step3p7_loading.from_hf_dir(folder, 64)
    features = torch.cat(
        [
            torch.cat([e.crops.flatten(0, 1), e.view])
            for e in step3p7_images.encode(unordered, images)
        ]
    )
    assert (features - expected).abs().max() > 1e-2

    def cropped_table(self, pixels):
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight[: patches.shape[1]]

    monkeypatch.setattr(step3p7_vision.Embeddings, "forward", cropped_table)
    encoded = step3p7_images.encode(engine.vision, images)
    features = torch.cat([torch.cat([e.crops.flatten(0, 1), e.view]) for e in encoded])
    assert (features - expected).abs().max() > 1e-2


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<im_patch>\) for 3"):
        engine.image_prompt("<|im_start|>user\n<im_patch>three?", images)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    image = tmp_path / "cat.png"
    image.write_bytes(picture(*PROMPT_IMAGES[1]))
    opened = [open_image(image.read_bytes())]
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=1), opened)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            **reference_inputs(engine, opened),
            max_new_tokens=8,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "Step 3.7")


def test_a_processor_that_does_not_fit_the_tower_is_one_error_line(folder, tmp_path):
    other = shutil.copytree(folder, tmp_path / "odd")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**settings, "patch_size": 60}))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(*PROMPT_IMAGES[0]))
    result = llmrun("run", other, "--image", image, "hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and "not a multiple of 56 pixels" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@needs_converter
def test_the_converter_s_gguf_and_mmproj_match_transformers(
    tmp_path, model, folder, engine, images
):
    """llama.cpp's converter on the folder (its config.json in StepFun's names, with the
    Hub's understand_projector_stride) writes a step35 text GGUF and a step3vl mmproj: the
    mmproj's tower gives transformers' image features of every view, and with the text
    GGUF the logits and 8 greedy tokens of an image that takes no crops (mtmd's crop size,
    504, is not the folder's) are transformers'."""
    hub = shutil.copytree(folder, tmp_path / "hub")
    config = json.loads((hub / "config.json").read_text())
    config.update(text_config=HUB_TEXT, understand_projector_stride=2)
    (hub / "config.json").write_text(json.dumps(config))
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    outputs = {text: "--outtype f32", mmproj: "--outtype f32 --mmproj"}
    run_converter(hub, outputs, CONVERT_TINY)
    assert vision_families.of_mmproj(mmproj).name == "Step 3.7"
    loaded = api.load(str(text), device="cpu", mmproj=mmproj)
    assert (loaded.vision.size, loaded.vision.crop, loaded.vision.max_image_size) == (
        112,
        504,
        3024,
    )
    inputs = reference_inputs(engine, images)
    with torch.no_grad():
        views = loaded.vision.encoder(inputs["pixel_values"])
        crops = loaded.vision.encoder(inputs["pixel_values_local"])
    features, taken = [], 0
    for view, count in zip(views, inputs["num_local_patches"], strict=True):
        features += [crops[taken : taken + count].flatten(0, 1), view]
        taken += count
    expected = image_features(model, inputs)
    torch.testing.assert_close(torch.cat(features), expected, atol=1e-4, rtol=0)
    alone = [images[0]]  # 60x50: the global view alone, as the folder's
    # The processor's ids (the GGUF's vocabulary is the converter's BPE reading of the toy
    # tokenizer), the image's soft tokens from the mmproj.
    ids, folder_images = engine.image_prompt(engine.prompt_text(QUESTION, images=1), alone)
    (encoded,) = step3p7_images.encode(loaded.vision, alone)
    assert len(encoded.crops) == 0
    prompt_images = PromptImages([encoded.view], folder_images.starts)
    reference = reference_inputs(engine, alone)
    with torch.no_grad():
        ours = loaded.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
        theirs = model(input_ids=torch.tensor([ids]), **reference).logits[0]
        out = model.generate(
            input_ids=torch.tensor([ids]), **reference, max_new_tokens=8, do_sample=False
        )
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    stream = loaded.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == out[0, len(ids) :].tolist()

"""LLaVA 1.5 and LLaVA-NeXT (CLIP tower, two-layer MLP projector, Llama text; NeXT's anyres
tiles, unpadding and image_newline) with images against transformers: tiny random
LlavaForConditionalGeneration and LlavaNextForConditionalGeneration (text hidden 64 in 2
layers; CLIP hidden 32 in 3 layers, features after the second, on 32-pixel tiles of 8-pixel
patches; NeXT's pinpoints 32x64, 64x32, 64x64, 32x96) whose LlavaProcessor /
LlavaNextProcessor (Pillow image processors) make the reference inputs. Two images, 50x90
and 100x40. The prompt ids, the pixel values, the image features, the logits (whole, and a
chunked prefill through a KV cache) and 8 greedy tokens match; so does the same model as a
text GGUF and an mmproj GGUF laid out as llama.cpp's LLaVA script writes them. A kept class
token, or a dropped image_newline, fails. The anyres arithmetic and the processors' pixels
match transformers' at the real models' sizes too.

Tolerances: 1e-4 on f32 image features and logits (about ±8); pixels 1e-5 (exact here).
"""

import json

import pytest
import torch
from in_process import llmrun
from llava_helpers import (
    IMAGE,
    TILE_TOKENS,
    greedy_tokens,
    image_features,
    processor_inputs,
    save_llava_dir,
    tiny_llava,
    write_mmproj,
    write_text_gguf,
)
from vision_helpers import picture

from llmrun import api, llava_images
from llmrun.errors import ModelFormatError, UsageError
from llmrun.generate import KVState, prefill
from llmrun.images import open_image
from llmrun.loading.llava_vision import LlavaVision, from_mmproj
from llmrun.models import llava_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in these pictures?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["llava", "llava_next"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def model(kind):
    return tiny_llava(next_=kind == "llava_next")


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_llava_dir(model, tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(50, 90, 1)), open_image(picture(100, 40, 2))]


@pytest.fixture(scope="module")
def reference(folder, images):
    return processor_inputs(folder, images, QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


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


def reference_pixels(reference, counts) -> torch.Tensor:
    """The processor's tiles of each image, without LLaVA-NeXT's padding to a batch."""
    pixels = reference["pixel_values"]
    if pixels.dim() == 4:
        return pixels
    return torch.cat([p[:n] for p, n in zip(pixels, counts, strict=True)])


def test_the_prompt_and_pixels_are_the_processors(kind, engine, images, prompt, reference):
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    lengths = [len(e) for e in prompt_images.embeds]
    if kind == "llava":
        assert lengths == [TILE_TOKENS, TILE_TOKENS]
    else:  # the base tile's 16, then the unpadded grid's rows, each with its newline:
        # 50x90 in 32x64 (4x8 features), 100x40 in 64x32 (8x4)
        assert lengths == [16 + 4 * (8 + 1), 16 + 8 * (4 + 1)]
    assert lengths == [engine.image_tokens(image) for image in images]
    for start, length in zip(prompt_images.starts, lengths, strict=True):
        assert ids[start : start + length] == [IMAGE] * length
        assert ids[start + length] != IMAGE
    tiles = [llava_images.pixel_values(engine.vision, image) for image in images]
    expected = reference_pixels(reference, [len(t) for t in tiles])
    torch.testing.assert_close(torch.cat(tiles), expected, atol=1e-5, rtol=0)


def test_image_features_match_transformers(model, prompt, reference):
    features = torch.cat(prompt[1].embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)


def test_a_kept_class_token_fails(model, engine, images, reference, monkeypatch):
    """The features of every position but the last instead of but the first."""

    def forward(self, tiles):
        states = self.vision_tower.vision_model.hidden_states(tiles)
        return self.multi_modal_projector(states[self.args.feature_layers[0]][:, :-1])

    monkeypatch.setattr(llava_vision.ImageEncoder, "forward", forward)
    features = torch.cat(llava_images.encode(engine.vision, images))
    assert (features - image_features(model, reference)).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["llava_next"], indirect=True)  # LLaVA 1.5 has none
def test_a_dropped_image_newline_fails(kind, model, engine, images, reference, monkeypatch):
    zeros = torch.nn.Parameter(torch.zeros_like(engine.vision.encoder.image_newline))
    monkeypatch.setattr(engine.vision.encoder, "image_newline", zeros)
    features = torch.cat(llava_images.encode(engine.vision, images))
    assert (features - image_features(model, reference)).abs().max() > 1e-2


def test_logits_and_greedy_tokens_match_transformers(model, engine, prompt, reference):
    ids, prompt_images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
        # generate's prefill in chunks of 7, moved so that no image is split.
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=7, images=prompt_images)
    torch.testing.assert_close(logits(engine, *prompt), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    assert len(tokens) == 8
    assert generated(engine, *prompt) == tokens


def test_gguf_with_mmproj_matches_transformers(kind, model, images, tmp_path):
    """The text GGUF (arch llama) and the mmproj (projector mlp) as llama.cpp's LLaVA
    script writes it; LLaVA 1.5's images then padded square with the mean colour, as
    LlavaImageProcessor's do_pad (LLaVA-NeXT's mmproj names its feature layer). The GGUF's
    tokenizer puts a space after <image>, so transformers runs on the GGUF's ids."""
    folder = save_llava_dir(model, tmp_path / "padded", do_pad=True)
    reference = processor_inputs(folder, images, QUESTION)
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf", feature_layer=kind == "llava_next")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = engine.image_prompt(
        engine.prompt_text(QUESTION, images=len(images)), images
    )
    tiles = [llava_images.pixel_values(engine.vision, image) for image in images]
    expected = reference_pixels(reference, [len(t) for t in tiles])
    torch.testing.assert_close(torch.cat(tiles), expected, atol=1e-5, rtol=0)
    features = torch.cat(prompt_images.embeds)
    torch.testing.assert_close(features, image_features(model, reference), atol=1e-4, rtol=0)
    inputs = {**reference, "input_ids": torch.tensor([ids])}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        expected_logits = model(**inputs).logits[0]
    torch.testing.assert_close(
        logits(engine, ids, prompt_images), expected_logits, atol=1e-4, rtol=0
    )
    assert generated(engine, ids, prompt_images) == greedy_tokens(model, inputs)
    with pytest.raises(ModelFormatError, match="not an mmproj GGUF"):
        from_mmproj(text, 64)
    with pytest.raises(ModelFormatError, match="projects to 64 features, but .* is 32"):
        from_mmproj(mmproj, 32)


# save_pretrained's names (transformers 5 writes the -hf repos' layout, but for the tower's
# vision_model level) -> the Hub's files', and -> transformers 5's module names.
LAYOUTS = {
    "hub": {"vision_tower.": "vision_tower.vision_model."},
    "modules": {
        "vision_tower.": "model.vision_tower.",
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "multi_modal_projector.": "model.multi_modal_projector.",
        "image_newline": "model.image_newline",
    },
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_key_layouts_load_alike(layout, engine, folder, images, prompt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    other = shutil.copytree(folder, tmp_path / layout)
    renames = LAYOUTS[layout]
    tensors = {}
    for name, tensor in load_file(other / "model.safetensors").items():
        old = next((o for o in renames if name.startswith(o)), None)
        tensors[name if old is None else renames[old] + name[len(old) :]] = tensor
    assert any(name.startswith(renames["vision_tower."]) for name in tensors)
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    loaded = api.load(str(other), device="cpu", vision=True)
    ids, prompt_images = prompt
    features = torch.cat(llava_images.encode(loaded.vision, images))
    torch.testing.assert_close(features, torch.cat(prompt_images.embeds), atol=0, rtol=0)
    torch.testing.assert_close(
        logits(loaded, ids, prompt_images), logits(engine, ids, prompt_images), atol=0, rtol=0
    )


def test_a_quantized_mmproj_stays_close(model, images, tmp_path):
    """Q8_0 tower matrices: features near the exact ones (LLaVA 1.5's padded square)."""
    import gguf

    path = write_mmproj(model, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    quantized = from_mmproj(path, 64)
    exact = from_mmproj(write_mmproj(model, tmp_path / "f32.gguf"), 64)
    features = torch.cat(llava_images.encode(quantized, images))
    expected = torch.cat(llava_images.encode(exact, images))
    assert 0 < (features - expected).abs().max() < 0.05 * expected.abs().max()


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<image>\) for 2 images"):
        engine.image_prompt("USER: <image>\ntwo? ASSISTANT:", images)
    with pytest.raises(UsageError, match="marks 2 image places"):
        engine.image_prompt("USER: <image><image>\none? ASSISTANT:", images[:1])


def test_anyres_arithmetic_matches_transformers():
    """LLaVA-NeXT's pinpoint choice, fitted size and token count (llava-v1.6's pinpoints,
    336-pixel tiles of 14-pixel patches) for many image sizes."""
    from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    processor = transformers.LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(image_grid_pinpoints=pinpoints),
        tokenizer=transformers.PreTrainedTokenizerFast(
            tokenizer_object=_word_level(), additional_special_tokens=["<image>"]
        ),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    args = llava_vision.EncoderArgs(
        llava_vision.VisionArgs(image_size=336, patch_size=14, num_hidden_layers=1),
        text_hidden_size=8,
        feature_layers=[1],
        newline=True,
    )
    with torch.device("meta"):
        encoder = llava_vision.ImageEncoder(args)
    pairs = [(h, w) for h, w in pinpoints]
    vision = LlavaVision(encoder, 336, (336, 336), False, (0.5,) * 3, (0.5,) * 3, 3, pairs, 336)
    sizes = [(h, w) for h in (1, 37, 200, 336, 337, 640, 1333) for w in (1, 60, 336, 700, 2000)]
    for h, w in sizes:
        best = select_best_resolution((h, w), pinpoints)
        assert llava_images.best_resolution(h, w, pairs) == tuple(best)
        image = torch.zeros(3, h, w).numpy()
        expected_size = get_patch_output_size(image, best, input_data_format="channels_first")
        assert llava_images.fitted_size(h, w, best) == tuple(expected_size)
        tokens = processor._get_number_of_features(h, w, 336, 336) - 1
        assert llava_images.image_tokens(vision, _Size(h, w)) == tokens


class _Size:
    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width


def _word_level():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1}, unk_token="<unk>"))


@pytest.mark.parametrize(
    ("size", "mode", "pad"),
    [((1000, 600), "RGBA", False), ((333, 1600), "RGB", True), ((300, 400), "L", True)],
)
def test_pixels_match_llava_image_processor(size, mode, pad):
    """llava-1.5's settings (336 pixels, bicubic, CLIP's mean and std), with and without
    do_pad."""
    import io

    from PIL import Image
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    data = picture(*size, seed=3, mode=mode)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    processor = LlavaImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_pad=pad
    )
    expected = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt").pixel_values
    vision = LlavaVision(None, 336, (336, 336), pad, mean, std)
    ours = llava_images.pixel_values(vision, open_image(data))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [(1000, 600), (200, 900), (336, 336)])
def test_tiles_match_llava_next_image_processor(size):
    """llava-v1.6's settings: 336-pixel tiles of its five pinpoints, the base tile first."""
    import io

    from PIL import Image
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    data = picture(*size, seed=4)
    processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=pinpoints,
    )
    expected = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    mean, std = processor.image_mean, processor.image_std
    pairs = [(h, w) for h, w in pinpoints]
    vision = LlavaVision(None, 336, (336, 336), False, mean, std, 3, pairs, 336, (336, 336))
    ours = llava_images.pixel_values(vision, open_image(data))
    torch.testing.assert_close(ours, expected.pixel_values[0], atol=1e-5, rtol=0)


def test_a_config_s_settings_are_checked(kind, folder, tmp_path):
    import shutil

    other = shutil.copytree(folder, tmp_path / "other")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(
        json.dumps({**settings, "crop_size": {"height": 48, "width": 48}})
    )
    with pytest.raises(ModelFormatError, match=r"\(48, 48\) pixels, but the vision tower takes"):
        api.load(str(other), device="cpu", vision=True)
    # CLIPImageProcessor (llava-1.5-hf's) takes no do_pad.
    clip = {**settings, "image_processor_type": "CLIPImageProcessor", "do_pad": True}
    (other / "preprocessor_config.json").write_text(json.dumps(clip))
    assert api.load(str(other), device="cpu", vision=True).vision.pad is False
    (other / "preprocessor_config.json").write_text(json.dumps(settings))
    config = json.loads((other / "config.json").read_text())
    if kind == "llava_next":
        for pinpoints, error in (([[32, 48]], "not whole tiles of 32"), ([[32, 9600]], "past")):
            (other / "config.json").write_text(
                json.dumps({**config, "image_grid_pinpoints": pinpoints})
            )
            with pytest.raises(ModelFormatError, match=error):
                api.load(str(other), device="cpu", vision=True)
    (other / "config.json").write_text(
        json.dumps({**config, "vision_feature_select_strategy": "full"})
    )
    image = tmp_path / "cat.png"
    image.write_bytes(picture(40, 40, seed=5))
    result = llmrun("run", str(other), "--image", str(image), "hi")
    assert result.returncode != 0 and "vision_feature_select_strategy 'full'" in result.stderr


@pytest.mark.parametrize("kind", ["llava"], indirect=True)  # one family is enough here
def test_run_with_an_image_replies_as_transformers(kind, model, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"` from the folder."""
    from PIL import Image

    image = tmp_path / "cat.png"
    image.write_bytes(picture(90, 70, seed=4))
    reference = processor_inputs(folder, [Image.open(image).convert("RGB")], QUESTION)
    expected = greedy_tokens(model, reference)
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    args = [str(folder), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected

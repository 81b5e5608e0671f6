"""TrOCR (llmrun.models.vit, llmrun.models.trocr, llmrun.trocr_images, llmrun.text_to_text)
against transformers' VisionEncoderDecoderModel: tiny random folders (tests/trocr_helpers.py)
of a ViT with a decoder of learned positions, and of a DeiT (its distillation token, a
centre-cropping processor) with a decoder of scaled embeddings and sinusoid positions (fewer
than the image's tokens, which are its source, not its positions), give TrOCRProcessor's
pixel values for a 50 x 37 picture, transformers' encoder output and decoder logits (the
padding token last: a DeiT decoder's sinusoid for it is zero, and left non-zero, the planted
bug, the logits differ), and greedy and 3-beam decoding give transformers' generate ids; so does a folder without generation_config.json whose config.json gives beams
and lengths, decoded as transformers' generate decodes it by default. `run --image` without
a prompt prints generate's text, as serve's chat endpoint answers an image part alone; a
prompt, no image, or an encoder TrOCR's checkpoints do not use, is refused in one line. A
folder of RobertaTokenizer's vocab.json and merges.txt (no tokenizer.json, as microsoft/trocr-*
ship) prints the text transformers' RobertaTokenizer decodes.

Tolerances: pixel values and ids exact; encoder output and logits 1e-4.
"""

import json
import shutil

import pytest
import serving
import torch
from bart_kin_helpers import vocab_and_merges
from in_process import llmrun
from trocr_helpers import reference, trocr_folder
from vision_helpers import picture

from llmrun import api, trocr_images
from llmrun.images import open_image
from llmrun.sampling import SamplingParams
from llmrun.text_to_text import Options

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per encoder: (folder, transformers' model and processor, llmrun's engine, a
    picture's file)."""
    built = {}
    for encoder in ("vit", "deit"):
        folder = trocr_folder(tmp_path_factory.mktemp(f"trocr_{encoder}"), encoder)
        ref, processor = reference(folder)
        engine = api.load(str(folder), vision=True, text_to_text=True)
        image = folder / "picture.png"
        image.write_bytes(picture(37, 50, 1))
        built[encoder] = folder, ref, processor, engine, image
    return built


def _generate(engine, image, beams):
    ids, images = engine.image_prompt("", [open_image(image)])
    options = Options(num_beams=beams)
    replies = engine.generate(
        ids, SamplingParams(temperature=0.0), 12, images=images, options=options
    )
    return [r.token for r in replies if r.token is not None]


@pytest.mark.parametrize("encoder", ["vit", "deit"])
def test_encoder_decoder_and_generate_match_transformers(models, encoder, monkeypatch):
    _, ref, processor, engine, image = models[encoder]
    pixels = processor(images=open_image(image), return_tensors="pt").pixel_values
    assert torch.equal(trocr_images.pixel_values(engine.vision, open_image(image)), pixels[0])
    ids, images = engine.image_prompt("", [open_image(image)])
    decoder_ids = torch.tensor([[2, 0, *range(20, 29), 1]])  # the padding token last
    with torch.no_grad():
        expected = ref(pixel_values=pixels, decoder_input_ids=decoder_ids)
        assert (images.embeds[0] - expected.encoder_last_hidden_state[0]).abs().max() < 1e-4
        encoded = engine.model.encode(torch.tensor([ids]), images)
        logits = engine.model.decoding(encoded)(decoder_ids, torch.arange(12)[None])
        assert (logits - expected.logits).abs().max() < 1e-4
        for beams in (1, 3):
            out = ref.generate(pixels, do_sample=False, num_beams=beams, max_new_tokens=12)
            tokens = _generate(engine, image, beams)
            assert tokens == out[0, 1:].tolist()  # generate's without its start token
            assert len(set(tokens)) >= 3
        if not engine.model.args.use_learned_position_embeddings:
            monkeypatch.setattr(engine.model.args, "pad_token_id", None)
            wrong = engine.model.decoding(encoded)(decoder_ids, torch.arange(12)[None])
            assert (wrong - expected.logits).abs().max() > 1e-2


def test_run_reads_an_image_without_a_prompt(models):
    folder, ref, processor, engine, image = models["vit"]
    pixels = processor(images=open_image(image), return_tensors="pt").pixel_values
    with torch.no_grad():
        out = ref.generate(pixels, do_sample=False, num_beams=1, max_new_tokens=12)[0]
    result = llmrun("run", folder, "--image", image, "-n", "12", "--beams", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.tokenizer.decode(out[1:].tolist())
    assert result.stderr == ""
    prompted = llmrun("run", folder, "what is it?", "--image", image)
    assert prompted.returncode != 0
    assert prompted.stderr == (
        "error: TrOCR reads the text of an image and takes no prompt: give --image alone\n"
    )
    assert "image-to-text (encoder-decoder)" in llmrun("show", folder).stdout
    served = serving.served(engine, "trocr")
    reply = serving.chat_reply(next(served), image.read_bytes(), max_tokens=12)
    served.close()
    assert reply["choices"][0]["message"]["content"] == result.stdout
    blind = llmrun("run", folder, "what is it?")
    assert blind.returncode != 0
    assert blind.stderr.endswith(
        "error: TrOCR reads the text of one image: give it one (--image)\n"
    )


def test_another_pair_is_refused_by_name(models, tmp_path):
    folder = shutil.copytree(models["vit"][0], tmp_path / "beit")
    config = json.loads((folder / "config.json").read_text())
    config["encoder"]["model_type"] = "beit"
    (folder / "config.json").write_text(json.dumps(config))
    result = llmrun("run", folder, "--image", folder / "picture.png")
    assert result.returncode != 0
    assert result.stderr == (
        f"error: {folder}: a vision-encoder-decoder of a 'beit' encoder and a 'trocr' decoder; "
        "llmrun runs TrOCR's (vit or deit and trocr)\n"
    )


def test_an_older_folder_decodes_as_its_config_says(models, tmp_path):
    folder, _, processor, _, image = models["vit"]
    shutil.copytree(folder, tmp_path / "old")
    (tmp_path / "old" / "generation_config.json").unlink()
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config.update(num_beams=3, max_length=20, no_repeat_ngram_size=3, length_penalty=2.0)
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    ref, _ = reference(tmp_path / "old")  # transformers reads them from config.json
    pixels = processor(images=open_image(image), return_tensors="pt").pixel_values
    with torch.no_grad():
        out = ref.generate(pixels)[0]
    engine = api.load(str(tmp_path / "old"), vision=True, text_to_text=True)
    ids, images = engine.image_prompt("", [open_image(image)])
    replies = engine.generate(ids, SamplingParams(temperature=0.0), None, images=images)
    assert [r.token for r in replies if r.token is not None] == out[1:].tolist()


def test_a_folder_of_roberta_tokenizer_files_reads_as_transformers(models, tmp_path):
    folder, ref, processor, _, image = models["vit"]
    files = shutil.copytree(folder, tmp_path / "roberta")
    model = json.loads((files / "tokenizer.json").read_text())["model"]
    (files / "tokenizer.json").unlink()
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab_and_merges(files, model["vocab"], merges)
    mask = {"content": "<mask>", "lstrip": True, "normalized": True, "__type": "AddedToken"}
    settings = {"tokenizer_class": "RobertaTokenizer", "mask_token": mask}
    (files / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = transformers.AutoTokenizer.from_pretrained(files)
    assert type(tokenizer).__name__ == "RobertaTokenizer"
    pixels = processor(images=open_image(image), return_tensors="pt").pixel_values
    with torch.no_grad():
        out = ref.generate(pixels, do_sample=False, num_beams=1, max_new_tokens=12)[0]
    result = llmrun("run", files, "--image", image, "-n", "12", "--beams", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.decode(out, skip_special_tokens=True)
    assert result.stdout.strip()

"""Fuyu with an image against transformers: a tiny random FuyuForCausalLM (no vision
tower: 4-pixel patches through one Linear into a Persimmon) and FuyuProcessor with its
Pillow image processor (FuyuImageProcessorPil, shrinking images into a 24x32 box) make
the reference inputs; the folder has no chat template, as adept/fuyu-8b has none, so
prompts are plain text. The test image (50x27) is shrunk to 32x17 and padded to 5 rows of
8 patches, its last row partly padding. The prompt ids (the rows of |SPEAKER| each closed
by |NEWLINE|, <s>, the text, <0x04>), the patches, the image features, the logits (whole
and prefilled in chunks), 8 greedy tokens and a text-only prompt match; `run --image`,
`chat` and serve's image parts reply with transformers' tokens; a flat config.json (the
Hub's) and the model's own key names load alike (save_pretrained writes the Hub's). Padding
with white (255, not Fuyu's 1 before / 255) or patches flattened channel by channel differ.

The tokenizer: stories260K's with |SPEAKER| and |NEWLINE| as BPE merges of their
characters, so that, as Fuyu's own tokenizer, it puts "▁" before a text that begins with
them (FuyuProcessor drops that first token).

Tolerances: patches 1e-6, features and logits 1e-4 (absolute), tokens exact.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from exaone4_5_helpers import greedy_tokens
from helpers import randomize, save_vision_dir
from in_process import llmrun
from serving import chat_reply, served
from vision_checks import check_logits_chunks_and_greedy, check_text_only_prompt, logits
from vision_helpers import picture

from llmrun import api, fuyu_images, vision_families
from llmrun.chat_template import plain_transcript
from llmrun.errors import UsageError
from llmrun.images import open_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from transformers.models.fuyu.image_processing_pil_fuyu import FuyuImageProcessorPil  # noqa: E402

PATCH, HEIGHT, WIDTH = 4, 24, 32
QUESTION = "What is in the picture?\n"
PROCESSOR = {
    "image_processor_type": "FuyuImageProcessor",
    "size": {"height": HEIGHT, "width": WIDTH},
    "patch_size": {"height": PATCH, "width": PATCH},
}


def merged(word: str) -> list[str]:
    """The prefixes a chain of BPE merges builds `word` through, `word` last."""
    return [word[:n] for n in range(2, len(word) + 1)]


# |SPEAKER| and |NEWLINE| at ids 512 and 513, their partial merges after.
IMAGE, NEWLINE = 512, 513
PARTIAL = [p for w in ("|SPEAKER|", "|NEWLINE|") for p in merged(w)[:-1]]
VOCAB = 512 + 2 + len(PARTIAL)


def fuyu_tokens(folder) -> None:
    """The folder's tokenizer.json with Fuyu's two image tokens as merges of their
    characters (ranked before stories260K's own merges)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for i, token in enumerate(["|SPEAKER|", "|NEWLINE|", *PARTIAL], start=512):
        vocab[token] = i
    chains = [merged(w) for w in ("|SPEAKER|", "|NEWLINE|")]
    merges = [[prefix[:-1], prefix[-1]] for chain in chains for prefix in chain]
    tok["model"]["merges"] = merges + tok["model"]["merges"]
    (folder / "tokenizer.json").write_text(json.dumps(tok))


def tiny_fuyu(seed: int = 0):
    """A random FuyuForCausalLM: Persimmon text of hidden 64 in 2 layers (4 heads, half of
    each rotated), 4-pixel patches."""
    text = dict(
        model_type="persimmon",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = transformers.FuyuConfig(text_config=text, patch_size=PATCH, image_token_id=IMAGE)
    torch.manual_seed(seed)
    model = transformers.FuyuForCausalLM(config).eval()
    randomize(model)
    return model


class ImageProcessor(FuyuImageProcessorPil):
    """FuyuImageProcessorPil as FuyuProcessor calls it: the processor asks for torch
    tensors, which its numpy patchify_image cannot transpose; numpy in, torch out."""

    def patchify_image(self, image, patch_size=None):
        return torch.from_numpy(super().patchify_image(np.asarray(image), patch_size))


def processor_inputs(folder, images: list, text: str) -> dict:
    """FuyuProcessor's inputs for `images` and the plain prompt `text`."""
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    processor = transformers.FuyuProcessor(
        image_processor=ImageProcessor(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
    )
    inputs = processor(
        images=images, text=text, return_tensors="pt", return_legacy_image_output=False
    )
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


@pytest.fixture(scope="module")
def model():
    return tiny_fuyu()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    folder = save_vision_dir(model, tmp_path_factory.mktemp("fuyu"), (), "", PROCESSOR)
    fuyu_tokens(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]  # adept/fuyu-8b has none
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def image():
    return open_image(picture(27, 50, 1))


@pytest.fixture(scope="module")
def reference(folder, image):
    return processor_inputs(folder, [image], QUESTION)


@pytest.fixture(scope="module")
def prompt(engine, image):
    assert engine.template is None
    return engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])


def image_features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(reference["pixel_values"]).last_hidden_state


def test_the_prompt_patches_features_logits_and_tokens_are_transformers(
    model, engine, image, prompt, reference
):
    assert vision_families.of_vision(engine.vision).name == "Fuyu"
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    rows, columns = 5, 8  # 27x50 shrunk to 17x32, padded to 20x32
    assert ids[: rows * (columns + 1)] == ([IMAGE] * columns + [NEWLINE]) * rows
    assert ids[rows * (columns + 1)] == 1  # <s>
    assert prompt_images.starts == [0] and engine.image_tokens(image) == rows * (columns + 1)
    ours = fuyu_images.patches(engine.vision, image)
    torch.testing.assert_close(ours, reference["pixel_values"], atol=1e-6, rtol=0)
    features = prompt_images.embeds[0].reshape(rows, columns + 1, -1)[:, :columns]
    expected = image_features(model, reference).reshape(rows, columns, -1)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        expected_logits = model(**reference).logits[0]
    assert 2 < expected_logits.abs().max() < 50
    check_logits_chunks_and_greedy(model, engine, prompt, reference, expected_logits)
    check_text_only_prompt(model, engine, QUESTION)


def test_white_padding_and_channel_first_patches_differ(
    model, engine, image, reference, monkeypatch
):
    """Planted: padding of 255 (white, as if padded after / 255), which moves the last
    row of patches alone (the image's 17 rows of pixels padded to 20); patches flattened
    channel by channel, as a ViT's convolution reads them."""
    expected = image_features(model, reference)
    monkeypatch.setattr(engine.vision, "padding_value", 255)
    white = fuyu_images.encode(engine.vision, [image])[0].flatten(0, 1)
    assert (white[-8:] - expected[-8:]).abs().max() > 1e-2
    torch.testing.assert_close(white[:-8], expected[:-8], atol=1e-4, rtol=0)
    monkeypatch.undo()
    patches = fuyu_images.patches

    def channel_first(vision, picture_):
        cut = patches(vision, picture_).reshape(-1, PATCH, PATCH, 3)
        return cut.permute(0, 3, 1, 2).flatten(1)

    monkeypatch.setattr(fuyu_images, "patches", channel_first)
    ours = fuyu_images.encode(engine.vision, [image])[0].flatten(0, 1)
    assert (ours - expected).abs().max() > 1e-2


def test_a_flat_config_and_the_state_dicts_names_load_alike(
    model, folder, image, engine, prompt, tmp_path
):
    """adept/fuyu-8b's config.json holds the text fields at the top level (FuyuConfig reads
    them from there); save_pretrained writes the Hub's names (language_model.model.*,
    language_model.lm_head, vision_embed_tokens), which the folder above has, and a file
    may hold the model's own (model.language_model.*, lm_head, model.vision_embed_tokens)."""
    from safetensors.torch import load_file, save_file

    hub = shutil.copytree(folder, tmp_path / "hub")
    config = json.loads((hub / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling=None)
    (hub / "config.json").write_text(json.dumps(config))
    weights = load_file(hub / "model.safetensors")
    assert {"vision_embed_tokens.weight", "language_model.lm_head.weight"} <= set(weights)
    renamed = {"model." + name: tensor for name, tensor in weights.items()}
    renamed["lm_head.weight"] = renamed.pop("model.language_model.lm_head.weight")
    renamed = {k.replace("language_model.model.", "language_model."): t for k, t in renamed.items()}
    assert set(renamed) == set(model.state_dict())
    save_file(renamed, hub / "model.safetensors", metadata={"format": "pt"})
    loaded = api.load(str(hub), device="cpu", vision=True)
    ours = loaded.image_prompt(loaded.prompt_text(QUESTION, images=1), [image])
    assert ours[0] == prompt[0]
    torch.testing.assert_close(logits(loaded, *ours), logits(engine, *prompt), atol=0, rtol=0)


def test_one_image_a_prompt_and_no_image_tokens_of_its_own(engine, image):
    with pytest.raises(UsageError, match="one image a prompt, not 2"):
        engine.image_prompt(QUESTION, [image, image])
    with pytest.raises(UsageError, match=r"\|SPEAKER\| or \|NEWLINE\| of its own"):
        engine.image_prompt("|NEWLINE|" + QUESTION, [image])


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `llmrun chat MODEL --image PATH` and
    serve's image parts (no chat template: the image before the plain transcript, as
    chat's) give transformers' greedy tokens; text alone runs the language model with a
    note."""
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    path = tmp_path / "cat.png"
    path.write_bytes(picture(60, 90, seed=6))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(path)], QUESTION))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    options = ("-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    result = llmrun("run", str(folder), "--image", str(path), QUESTION, *options)
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    # chat and serve: no chat template, so a plain transcript, the image's tokens before it.
    transcript = plain_transcript([{"role": "user", "content": QUESTION}])
    inputs = processor_inputs(folder, [Image.open(path)], transcript)
    expected = greedy_tokens(model, inputs)
    expected = expected[: expected.index(2)] if 2 in expected else expected
    assert len(expected) >= 4
    options = ("--image", str(path), "-n", "8", "--temperature", "0")
    chat = llmrun("chat", str(folder), *options, input=QUESTION)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == load_tokenizer(folder).decode(expected) + "\n\n"
    for client in served(engine, "model"):
        reply = chat_reply(client, path.read_bytes(), QUESTION)
        assert reply["choices"][0]["message"]["content"] == chat.stdout[:-2]
        usage = (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
        assert usage == (inputs["input_ids"].shape[1], len(expected))
    text = llmrun("run", str(folder), QUESTION, "-n", "2", "--temperature", "0")
    assert text.returncode == 0, text.stderr
    assert "a multimodal Fuyu; running its language model" in text.stderr


def test_a_padding_mode_other_than_constant_is_one_error(folder, tmp_path):
    bad = shutil.copytree(folder, tmp_path / "reflect")
    settings = {**PROCESSOR, "padding_mode": "reflect"}
    (bad / "preprocessor_config.json").write_text(json.dumps(settings))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(20, 20, seed=2))
    result = llmrun("run", str(bad), "--image", str(image), QUESTION, "-n", "1")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "padding_mode 'reflect'" in result.stderr

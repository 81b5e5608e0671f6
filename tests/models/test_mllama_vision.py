"""Llama 3.2 Vision (mllama) with an image against transformers: a tiny random
MllamaForConditionalGeneration (text hidden 64 in 4 layers, the third a cross-attention one;
vision hidden 32 in 2 plain layers and 1 gated global one, both plain layers' states joining
the final one, on 56-pixel tiles of 14-pixel patches, up to 4 tiles) whose MllamaProcessor
(MllamaImageProcessorPil, the chat template) makes the reference inputs. For images of one
to four tiles and every shape of canvas: the prompt ids, the pixels of each tile, the aspect
ratio id and mask and the cross-attention mask are the processor's; the image features, the
logits (whole, and a chunked prefill through the KV cache), 8 greedy tokens, a text-only
prompt (also after an image prompt through the same cache) and `run --image` and a two-turn
`chat --image` are transformers'. A text-before-the-image row given the MLP, or the
intermediate states concatenated instead of interleaved, fails.

Tolerances: pixels 1e-5 (they are bit-equal), features and logits 1e-4 (f32).
"""

import json
import shutil

import pytest
import torch
from in_process import llmrun
from mllama_helpers import (
    MAX_TILES,
    TILE,
    greedy_tokens,
    processor_inputs,
    save_mllama_dir,
    tiny_mllama,
)
from vision_helpers import picture

from llmrun import api, mllama_images
from llmrun.errors import UsageError
from llmrun.generate import prefill
from llmrun.images import open_image
from llmrun.models import mllama
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is in this picture?"
CPU = torch.device("cpu")
# (height, width): one tile, enlarged; 1x3 tiles, shrunk; 4x1; 2x2; 1x2 exactly.
SIZES = ((40, 30), (100, 260), (300, 70), (150, 130), (TILE, 2 * TILE))


@pytest.fixture(scope="module")
def model():
    return tiny_mllama()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_mllama_dir(model, tmp_path_factory.mktemp("mllama"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def image():
    return open_image(picture(100, 260, 3))


def messages(question: str = QUESTION, image: bool = True) -> list[dict]:
    content = [{"type": "image"}] * image + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def reference(folder, image):
    return processor_inputs(folder, [image], messages())


@pytest.fixture(scope="module")
def prompt(engine, image):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])


def logits(engine, ids, images) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=images.tokens(0, len(ids), CPU),
        )[0]


def generated(engine, ids, images=None, state=None) -> list[int]:
    stream = engine.generate(ids, GREEDY, 8, state=state, images=images)
    return [r.token for r in stream if r.token is not None]


def test_inputs_are_the_processors(engine, folder):
    """Ids, tiles, aspect ratio ids and masks, and where the text attends to the image."""
    for height, width in SIZES:
        picture_ = open_image(picture(height, width, seed=height))
        ref = processor_inputs(folder, [picture_], messages())
        ids, images = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [picture_])
        assert ids == ref.input_ids[0].tolist()
        pixels, ratio, tiles = mllama_images.pixel_values(engine.vision, picture_)
        torch.testing.assert_close(pixels, ref.pixel_values[0, 0], atol=1e-5, rtol=0)
        assert ratio == ref.aspect_ratio_ids.item()
        assert ref.aspect_ratio_mask[0, 0].tolist() == [1] * tiles + [0] * (MAX_TILES - tiles)
        # Rows before <|image|> attend to no tile; from it on, to the image's real tiles.
        mask = ref.cross_attention_mask[0, :, 0]
        start = images.starts[0]
        assert not mask[:start].any()
        assert (mask[start:] == torch.tensor([1] * tiles + [0] * (MAX_TILES - tiles))).all()
        assert images.embeds[0].tiles == tiles


def test_image_features_match_transformers(model, prompt, reference):
    with torch.no_grad():
        vision = model.model.vision_model(
            reference.pixel_values, reference.aspect_ratio_ids, reference.aspect_ratio_mask
        ).last_hidden_state
        expected = model.model.multi_modal_projector(vision).reshape(-1, 64)
    torch.testing.assert_close(prompt[1].embeds[0].states, expected, atol=1e-4, rtol=0)


def test_logits_match_transformers_whole_and_through_the_cache(model, engine, prompt, reference):
    ids, images = prompt
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, images), expected, atol=1e-4, rtol=0)
    # Chunks of 3: the prompt up to <|image|> in one, then the rest from the cached image.
    state = engine.new_state(64)
    last = prefill(engine.model, state, ids, chunk=3, images=images)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(model, engine, prompt, reference):
    assert generated(engine, *prompt) == greedy_tokens(model, reference)


def test_a_text_prompt_matches_transformers_also_after_an_image(model, engine, folder, prompt):
    ref = processor_inputs(folder, [], messages(image=False))
    ids = ref.input_ids[0].tolist()
    assert ids == engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        expected = model(**ref).logits[0]
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, ref)
    state = engine.new_state(64)
    assert generated(engine, *prompt, state=state) != tokens  # the image matters
    # The same cache, which held the image: the text-only prompt sees none of it.
    assert generated(engine, ids, state=state) == tokens


@pytest.mark.parametrize("bug", ["text before the image takes the MLP", "states concatenated"])
def test_a_planted_bug_fails(model, engine, image, prompt, reference, monkeypatch, bug):
    with torch.no_grad():
        expected = model(**reference).logits[0]
    ids, images = prompt
    if bug == "states concatenated":
        original = torch.stack
        monkeypatch.setattr(torch, "stack", lambda ts, dim=0: original(ts, dim=-2))
        images = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [image])[1]
    else:
        original = mllama.CrossFrame

        def everyone(keys_values, mask, rows):
            return original(keys_values, mask, torch.ones_like(rows))

        monkeypatch.setattr(mllama, "CrossFrame", everyone)
    assert (logits(engine, ids, images) - expected).abs().max() > 1e-2


def test_one_image_a_conversation_and_the_processor_s_settings(engine, folder, tmp_path):
    """Two images, or settings the tiles do not follow, are one error line."""
    path = tmp_path / "cat.png"
    path.write_bytes(picture(60, 80, seed=5))
    image = open_image(path.read_bytes())
    with pytest.raises(UsageError, match=r"marks 0 image places"):
        engine.image_prompt(engine.prompt_text(QUESTION), [image])
    two = llmrun("run", folder, "--image", path, "--image", path, QUESTION, "-n", "1")
    assert two.returncode != 0
    assert two.stderr.strip().splitlines()[-1] == (
        "error: Llama 3.2 Vision takes one image a conversation, not 2"
    )
    other = shutil.copytree(folder, tmp_path / "other")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**settings, "resample": 3}))
    result = llmrun("run", other, "--image", path, QUESTION, "-n", "1")
    assert result.returncode != 0 and "error: " in result.stderr and "resample 3" in result.stderr


def test_run_and_chat_with_an_image_reply_as_transformers(model, engine, folder, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, and a two-turn `llmrun chat --image` whose
    second turn still sees the image."""
    path = tmp_path / "cat.png"
    path.write_bytes(picture(120, 150, seed=4))
    opened = open_image(path.read_bytes())
    expected = greedy_tokens(model, processor_inputs(folder, [opened], messages()))
    args = [str(folder), "--image", str(path), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected

    questions, conversation, replies = (QUESTION, "And then?"), [], []
    for question in questions:
        content = messages(question)[0]["content"] if not conversation else question
        conversation.append({"role": "user", "content": content})
        inputs = processor_inputs(folder, [opened], conversation)
        replies.append(engine.tokenizer.decode(greedy_tokens(model, inputs)))
        conversation.append({"role": "assistant", "content": replies[-1]})
    options = ("-n", "8", "--temperature", "0")
    chat = llmrun("chat", folder, "--image", path, *options, input="\n".join(questions))
    assert chat.returncode == 0, chat.stderr
    # The chat prints a reply's leading space, which decoding it alone drops.
    assert [r.strip() for r in chat.stdout.split("\n\n")[:-1]] == [r.strip() for r in replies]


def test_show_counts_the_self_attention_layers_kv_cache(folder):
    from llmrun.loading.inspect import kv_cache_bytes
    from llmrun.models import kv_cache_bytes as allocated

    config = json.loads((folder / "config.json").read_text())
    text = {**config["text_config"], "model_type": "mllama_text"}
    # 3 self-attention layers of 2 KV heads of 16, keys and values in f32
    assert kv_cache_bytes(config, 10) == allocated(text, 10) == 3 * 2 * 2 * 16 * 4 * 10

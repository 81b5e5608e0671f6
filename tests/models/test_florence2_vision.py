"""Florence-2 (llmrun.models.florence2_vision, llmrun.florence2_images, BART's encoder taking
the image's tokens, llmrun.text_to_text) against transformers: a tiny random folder
(tests/florence2_helpers.py: a two-stage DaViT whose 8 x 8 grid windows of 3 pad, a BART)
gives Florence2Processor's pixel values and input ids for a task prompt and a 50 x 37
picture, transformers' image features, encoder output and decoder logits, and greedy
decoding (one beam) gives transformers' generate ids, which `run --image` prints (also for
no prompt: the image, <s> and </s>) and serve's chat endpoint answers to an image part and
the task. The temporal position left out of the image tokens
(the planted bug) fails. A reply's task and location tokens (special in Florence-2's
tokenizer) are its text, as the processor decodes them for post_process_generation
(skip_special_tokens=False, <s> and </s> dropped). A folder of the original remote-code
format is refused by name.

Tolerances: pixel values and ids exact; features, encoder output and logits 1e-4.
"""

import copy
import json
import shutil

import pytest
import serving
import torch
from florence2_helpers import LOCATIONS, POST_PROCESSOR, florence2_folder, reference
from in_process import llmrun
from vision_helpers import picture

from llmrun import api, florence2_images
from llmrun.images import open_image
from llmrun.models import florence2_vision
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, transformers' model and processor, llmrun's engine, a picture's file)."""
    folder = florence2_folder(tmp_path_factory.mktemp("florence2"))
    ref, processor = reference(folder)
    engine = api.load(str(folder), vision=True, text_to_text=True)
    image = folder / "picture.png"
    image.write_bytes(picture(37, 50, 1))
    return folder, ref, processor, engine, image


def test_image_prompt_and_model_match_transformers(model, monkeypatch):
    _, ref, processor, engine, image = model
    task = "<CAPTION_TO_PHRASE_GROUNDING> a fox and a dog"
    inputs = processor(text=task, images=open_image(image), return_tensors="pt")
    pixels = florence2_images.pixel_values(engine.vision, open_image(image))
    assert torch.equal(pixels, inputs.pixel_values[0])
    ids, images = engine.image_prompt(task, [open_image(image)])
    assert ids == inputs.input_ids[0].tolist()
    decoder_ids = torch.tensor([[2, 0, *range(20, 30)]])
    with torch.no_grad():
        features = ref.get_image_features(inputs.pixel_values).pooler_output
        expected = ref(**inputs, decoder_input_ids=decoder_ids)
        assert (images.embeds[0] - features[0]).abs().max() < 1e-4
        encoded = engine.model.encode(torch.tensor([ids]), images)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        logits = engine.model.decoding(encoded)(decoder_ids, torch.arange(12)[None])
        assert (logits - expected.logits).abs().max() < 1e-4
        monkeypatch.setattr(florence2_vision, "temporal_position", torch.zeros)
        wrong = engine.encode_images([open_image(image)])[0]
        assert (wrong - features[0]).abs().max() > 1e-2


def test_replies_keep_task_and_location_tokens(model):
    _, _, processor, engine, _ = model
    tokenizer = engine.tokenizer
    marks = [tokenizer.token_id(t) for t in LOCATIONS]
    ids = [0, *tokenizer.encode(" a fox", add_bos=False), *marks, 2, 1]
    shown = processor.batch_decode([ids], skip_special_tokens=False)[0]
    assert "<loc_999>" in shown
    expected = shown.replace("<s>", "").replace("</s>", "").replace("<pad>", "")
    assert tokenizer.decode(ids) == expected


def test_run_with_an_image_prints_transformers_greedy_reply(model):
    folder, ref, processor, engine, image = model
    inputs = processor(text="<OCR>", images=open_image(image), return_tensors="pt")
    with torch.no_grad():
        out = ref.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=12)[0]
    ids, images = engine.image_prompt("<OCR>", [open_image(image)])
    replies = list(engine.generate(ids, SamplingParams(temperature=0.0), 12, images=images))
    tokens = [r.token for r in replies if r.token is not None]
    assert tokens == out[1:].tolist()  # generate's without its start token
    assert len(set(tokens)) >= 4
    result = llmrun("run", folder, "<OCR>", "--image", image, "-n", "12", "--beams", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.tokenizer.decode(out[1:].tolist())
    assert "without the vision tower" not in result.stderr
    inputs = processor(text="", images=open_image(image), return_tensors="pt")
    with torch.no_grad():
        out = ref.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=6)[0]
    bare = llmrun("run", folder, "--image", image, "-n", "6", "--beams", "1")  # no prompt
    assert bare.stdout == engine.tokenizer.decode(out[1:].tolist()), bare.stderr
    assert "image-to-text (encoder-decoder)" in llmrun("show", folder).stdout
    served = serving.served(engine, "florence")
    reply = serving.chat_reply(next(served), image.read_bytes(), "<OCR>", max_tokens=12)
    served.close()
    assert reply["choices"][0]["message"]["content"] == result.stdout
    wrong = llmrun("run", folder, "<OCR> and more", "--image", image, "-n", "4")
    assert wrong.returncode != 0
    assert wrong.stderr == "error: Florence-2's task <OCR> goes alone in the prompt\n"


def test_output_format_json_adds_the_processors_parsed_reply(model):
    folder, ref, processor, engine, image = model
    task, picture = "<CAPTION_TO_PHRASE_GROUNDING> a fox", open_image(image)
    inputs = processor(text=task, images=picture, return_tensors="pt")
    with torch.no_grad():
        out = ref.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=12)[0]
    # The model card's way: the whole output decoded, parsed by the task and image size.
    reply = processor.batch_decode([out], skip_special_tokens=False)[0]
    post = copy.copy(processor)
    florence2 = transformers.models.florence2.processing_florence2
    post.post_processor = florence2.Florence2PostProcessor(POST_PROCESSOR, processor.tokenizer)
    parsed = post.post_process_generation(
        reply, task="<CAPTION_TO_PHRASE_GROUNDING>", image_size=picture.size
    )
    args = (folder, task, "--image", image, "-n", "12", "--beams", "1", "--output-format")
    result = llmrun("run", *args, "json")
    assert result.returncode == 0, result.stderr
    text = engine.tokenizer.decode(out[1:].tolist())
    assert json.loads(result.stdout) == {"text": text, "parsed": parsed}
    wrong = llmrun("run", *args, "srt")
    assert wrong.stderr == "error: --output-format 'srt' with --image: give json\n"


def test_the_original_remote_code_format_is_refused_by_name(model, tmp_path):
    folder = shutil.copytree(model[0], tmp_path / "original")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["model_type"] = "florence2_language"
    (folder / "config.json").write_text(json.dumps(config))
    result = llmrun("run", folder, "<OD>", "--image", folder / "picture.png")
    assert result.returncode != 0
    assert result.stderr.startswith(
        f"error: {folder}: a Florence-2 text_config of model_type 'florence2_language'"
    )

"""Phi-4-multimodal (phi4_multimodal) against transformers' Phi4MultimodalForCausalLM: a tiny
random model (tests/phi4mm_helpers.py: Phi-3 text of hidden 64 in 2 layers, LongRoPE over
3/4 of each head; SigLIP of hidden 32 in 2 layers on 448-pixel crops of 14-pixel patches,
the features after the first; an audio tower of 1 block) saved as save_pretrained writes it.

Text alone runs its Phi-3 language model: logits whole, through a KV cache and past
original_max_position_embeddings (LongRoPE's long factors); `run`, `chat` and serve give
generate's greedy tokens, `show` counts the language model alone. With a KV cache llmrun
picks LongRoPE's factors by the context size, as llama.cpp does (models/base.py), so
`chat` and serve run in a context of original_max_position_embeddings (64), where
transformers' short prompts take the short factors too. A PEFT adapter on the language
model's layers (as the Hub's vision-lora and speech-lora are) gives PEFT's greedy tokens.

Images: a 300x700 one (a 1x2 canvas, its bottom padded) and a 100x60 one (one crop,
padded right and below). The prompt ids, crops and patch masks are
Phi4MultimodalProcessor's (stored in tests/data/phi4mm_processor.json: its image processor
needs torchvision; checked live where torchvision is installed); the image features, the
logits and 8 greedy tokens are Phi4MultimodalForCausalLM's on those crops. Attending to
the padded patches fails.

Audio: a 1.3-second clip (16 soft tokens) and a 0.4-second one. Log-mel frames and ids are
Phi4MultimodalProcessor's (its feature extractor runs without torchvision), the audio
features, logits and 8 greedy tokens Phi4MultimodalForCausalLM's (its speech projection);
`run --audio`, `chat`'s /audio and serve's /v1/audio/transcriptions (the model card's
"Transcribe the audio clip into text.") reply as transformers. The tiny tower's chunks of
4 frames see the chunk before: transformers adds that mask to the attention scores as 1 and
0, which llmrun does too; a tower that lets every frame see every other alike fails.

Tolerances: crops' sums 1e-6 relative; log-mel frames 1e-4; f32 logits of about ±7 and
image and audio features, 1e-4.
"""

import base64
import json
from pathlib import Path

import pytest
import torch
from family_checks import check_whole_and_cached, max_diff
from in_process import llmrun
from lora_helpers import peft_model
from phi4mm_helpers import AUDIO, END, IMAGE, processor, save_phi4mm_dir, tiny_phi4mm
from serving import GREEDY, chat_reply, served
from starlette.testclient import TestClient
from vision_checks import check_run_chat_and_serve_with_an_image
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, phi4mm_clips, phi4mm_images
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import phi4mm_audio, phi4mm_vision
from llmrun.server import Service, create_app

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

CPU = torch.device("cpu")
STORED = Path(__file__).parent.parent / "data" / "phi4mm_processor.json"
QUESTION = "Once upon a time"
IMAGES = ((300, 700, 1), (100, 60, 2))  # height, width, seed
CLIPS = (wav_bytes(chirp(1.3, 16000, seed=3), 16000), wav_bytes(chirp(0.4, 16000, seed=4), 16000))
# A transcription's context: its prompt of some 45 tokens and the answer, within
# original_max_position_embeddings (LongRoPE's short factors, as transformers' for it).
CONTEXT = 64
IDS = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model():
    return tiny_phi4mm()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_phi4mm_dir(model, tmp_path_factory.mktemp("phi4mm"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", ctx_size=64)


@pytest.fixture(scope="module")
def vision_engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(*image)) for image in IMAGES]


@pytest.fixture(scope="module")
def prompt(vision_engine, images):
    """The ids and images of one user message of both images, then the question."""
    text = vision_engine.prompt_text(QUESTION, images=len(images))
    return vision_engine.image_prompt(text, images)


def crop_sums(crops: torch.Tensor) -> list[float]:
    """Sums that a wrong pixel, crop or order changes: the plain sum, and one weighted by
    each value's place."""
    flat = crops.double().flatten()
    weights = torch.cos(torch.arange(len(flat), dtype=torch.float64) * 0.01)
    return [flat.sum().item(), (flat * weights).sum().item()]


def model_inputs(vision, images) -> dict:
    """The images as Phi4MultimodalForCausalLM takes them, from llmrun's crops: padded to
    the most crops with zero pixels and all-valid masks, as the processor pads them."""
    cut = [phi4mm_images.pixel_values(vision, image) for image in images]
    most = max(len(crops) for crops, _, _ in cut)
    pixels, masks = [], []
    for crops, mask, _ in cut:
        pixels.append(torch.cat([crops, crops.new_zeros(most - len(crops), *crops.shape[1:])]))
        masks.append(torch.cat([mask, mask.new_ones(most - len(mask), *mask.shape[1:])]))
    sizes = [[c.rows * vision.crop, c.columns * vision.crop] for _, _, c in cut]
    return dict(
        image_pixel_values=torch.stack(pixels),
        image_attention_mask=torch.stack(masks),
        image_sizes=torch.tensor(sizes),
    )


def processor_record(folder: Path) -> dict:
    """What Phi4MultimodalProcessor gives for one user message of IMAGES and QUESTION: the
    prompt ids, each image's token count and crop count, its crops' sums and the valid
    patches of its crops' masks (what tests/data/phi4mm_processor.json holds)."""
    made = processor(folder)
    content = [{"type": "image"}] * len(IMAGES) + [{"type": "text", "text": QUESTION}]
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    opened = [open_image(picture(*image)) for image in IMAGES]
    out = made(text=text, images=opened, return_tensors="pt")
    tokens = made.image_processor(opened)["num_img_tokens"]
    record = {"input_ids": out["input_ids"][0].tolist(), "images": []}
    for i, (height, width) in enumerate(out["image_sizes"].tolist()):
        crops = 1 + (height // 448) * (width // 448)
        record["images"].append(
            {
                "tokens": int(tokens[i]),
                "crops": crops,
                "pixel_sums": crop_sums(out["image_pixel_values"][i, :crops]),
                "valid_patches": out["image_attention_mask"][i, :crops].sum((1, 2)).tolist(),
            }
        )
    return record


def test_text_logits_match_transformers(model, folder):
    """Whole, chunked and token by token below original_max_position_embeddings (64), and
    whole past it, where LongRoPE turns every position by its long factors."""
    ours = load_model(folder, CPU, "f32").model
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    check_whole_and_cached(ours, IDS, expected)
    long = torch.randint(3, 500, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(ours(long, torch.arange(90)[None]), model(input_ids=long).logits) < 1e-4


def test_run_chat_and_serve_reply_as_transformers(model, folder, engine):
    """`llmrun run`, `chat` and serve give generate's 8 greedy tokens (eos: <|end|> or
    </s>, as the config lists them); `show` names phi4_multimodal and counts no tower's weight."""
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert len(expected) == 8 and END not in expected and 2 not in expected
    options = ("-n", "8", "--temperature", "0")
    result = llmrun("run", folder, QUESTION, *options, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    assert "a multimodal Phi-4-multimodal; running its language model" in result.stderr
    stream = engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", folder, *options, "-c", "64", input=QUESTION)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    for client in served(engine, "phi4mm"):
        served_reply = chat_reply(client, QUESTION)
        assert served_reply["choices"][0]["message"]["content"] == reply
    shown = llmrun("show", folder)
    assert shown.returncode == 0, shown.stderr
    assert "phi4_multimodal" in shown.stdout
    text_weights = sum(p.numel() for n, p in model.named_parameters() if "extend" not in n)
    assert inspect.describe(folder)["parameters"] == text_weights


def test_a_peft_adapter_applies_as_peft_does(model, folder, engine, tmp_path):
    """`llmrun run --lora ADAPTER` (a PEFT folder on the language model's layers, as the
    Hub's vision-lora and speech-lora are, which transformers' docs load by hand with
    load_adapter) gives PEFT's greedy tokens, which the base model's are not."""
    target = r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))"
    adapted = peft_model(model, target_modules=target)
    adapted.save_pretrained(tmp_path / "adapter")
    ids = engine.tokenizer.encode(engine.prompt_text(QUESTION))
    with torch.no_grad():
        out = adapted.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        base = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert expected != base[0, len(ids) :].tolist()
    options = ("-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    result = llmrun("run", folder, QUESTION, "--lora", tmp_path / "adapter", *options)
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected


def test_the_prompt_and_crops_are_the_processors(vision_engine, images, prompt):
    stored = json.loads(STORED.read_text())
    ids, prompt_images = prompt
    assert ids == stored["input_ids"]
    vision = vision_engine.vision
    for image, embeds, record in zip(images, prompt_images.embeds, stored["images"], strict=True):
        crops, masks, _ = phi4mm_images.pixel_values(vision, image)
        assert len(crops) == record["crops"]
        assert crop_sums(crops) == pytest.approx(record["pixel_sums"], rel=1e-6, abs=1e-3)
        assert masks.sum((1, 2)).tolist() == record["valid_patches"]
        assert vision_engine.image_tokens(image) == len(embeds) == record["tokens"]
    # Each image's span is a run of its image tokens.
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start : start + len(embeds)] == [IMAGE] * len(embeds)
        assert ids[start + len(embeds)] != IMAGE or start + len(embeds) in prompt_images.starts


def test_the_stored_inputs_are_the_processors_own(folder):
    pytest.importorskip("torchvision")
    live, stored = processor_record(folder), json.loads(STORED.read_text())
    assert live["input_ids"] == stored["input_ids"]
    for got, want in zip(live["images"], stored["images"], strict=True):
        assert (got["tokens"], got["crops"]) == (want["tokens"], want["crops"])
        assert got["valid_patches"] == want["valid_patches"]
        assert got["pixel_sums"] == pytest.approx(want["pixel_sums"], rel=1e-6, abs=1e-3)


def test_features_logits_and_greedy_tokens_match_transformers(model, vision_engine, images, prompt):
    ids, prompt_images = prompt
    inputs = model_inputs(vision_engine.vision, images)
    embed = model.model.embed_tokens_extend.image_embed
    places = torch.tensor([ids])
    with torch.no_grad():
        embedded = embed(places, torch.zeros(1, len(ids), 64), **inputs)[0]
    expected = embedded[places[0] == IMAGE]
    torch.testing.assert_close(torch.cat(prompt_images.embeds), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        reference = model(input_ids=places, **inputs).logits
        out = model.generate(input_ids=places, **inputs, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        logits = vision_engine.model(
            places,
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), CPU),
        )
    assert max_diff(logits, reference) < 1e-4
    expected_tokens = out[0, len(ids) :].tolist()
    responses = vision_engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in responses if r.token is not None] == expected_tokens
    assert len(expected_tokens) == 8


def test_attending_to_the_padded_patches_fails(model, vision_engine, images, monkeypatch):
    """The planted bug: each crop's padded patches attended to as the rest."""
    inputs = model_inputs(vision_engine.vision, images[:1])
    ids = torch.full((1, vision_engine.image_tokens(images[0])), IMAGE)
    with torch.no_grad():
        expected = model.model.embed_tokens_extend.image_embed(
            ids, torch.zeros(1, ids.shape[1], 64), **inputs
        )[0]
    good = phi4mm_images.encode(vision_engine.vision, images[:1])[0]
    assert max_diff(good, expected) < 1e-4
    attend = phi4mm_vision._attend
    monkeypatch.setattr(
        phi4mm_vision, "_attend", lambda attn, x, valid: attend(attn, x, torch.ones_like(valid))
    )
    bad = phi4mm_images.encode(vision_engine.vision, images[:1])[0]
    assert max_diff(bad, expected) > 1e-2


def test_image_places_must_match_the_images(vision_engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|endoftext10\|>\) for 2"):
        vision_engine.image_prompt("<|user|><|endoftext10|>two?<|end|>", images)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(
    model, folder, vision_engine, tmp_path
):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens."""
    image = tmp_path / "picture.png"
    image.write_bytes(picture(*IMAGES[1]))
    opened = [open_image(image.read_bytes())]
    ids, _ = vision_engine.image_prompt(vision_engine.prompt_text(QUESTION, images=1), opened)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            **model_inputs(vision_engine.vision, opened),
            max_new_tokens=8,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    check_run_chat_and_serve_with_an_image(vision_engine, folder, image, QUESTION, expected, None)


@pytest.fixture(scope="module")
def audio_engine(folder):
    return api.load(str(folder), device="cpu", audio=True, ctx_size=CONTEXT)


@pytest.fixture(scope="module")
def clips():
    return [audio.open_audio(clip) for clip in CLIPS]


def audio_reference(folder, clip, question: str = QUESTION) -> dict:
    """Phi4MultimodalProcessor's inputs for a user turn of the clip, then `question`."""
    made = processor(folder, images=False)
    content = [{"type": "audio"}, {"type": "text", "text": question}]
    text = made.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(made(text=text, audio=[clip.samples], sampling_rate=16000, return_tensors="pt"))


def test_audio_frames_ids_features_logits_and_greedy_tokens_match_transformers(
    model, folder, audio_engine, clips
):
    for clip in clips:
        reference = audio_reference(folder, clip)
        frames = phi4mm_clips.features(clip)
        torch.testing.assert_close(frames, reference["audio_input_features"][0], atol=1e-4, rtol=0)
        text = audio_engine.prompt_text(QUESTION, audio=1)
        ids, prompt_clips = audio_engine.audio_prompt(text, [clip])
        assert ids == reference["input_ids"][0].tolist()
        size = int(reference["audio_embed_sizes"][0])
        assert audio_engine.audio_tokens(clip) == len(prompt_clips.embeds[0]) == size
        places = torch.tensor([ids])
        with torch.no_grad():
            embedded = model.model.embed_tokens_extend.audio_embed(
                places,
                torch.zeros(1, len(ids), 64),
                audio_input_features=reference["audio_input_features"],
                audio_embed_sizes=reference["audio_embed_sizes"],
            )[0]
        expected = embedded[places[0] == AUDIO]
        torch.testing.assert_close(prompt_clips.embeds[0], expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        theirs = model(**reference).logits
        out = model.generate(**reference, max_new_tokens=8, do_sample=False)
        ours = audio_engine.model(
            places, torch.arange(len(ids))[None], images=prompt_clips.tokens(0, len(ids), CPU)
        )
    assert max_diff(ours, theirs) < 1e-4
    responses = audio_engine.generate(ids, GREEDY, 8, images=prompt_clips)
    assert [r.token for r in responses if r.token is not None] == out[0, len(ids) :].tolist()


def test_a_tower_whose_frames_see_every_frame_alike_fails(audio_engine, clips, monkeypatch):
    """The planted bug: no chunk mask. The tiny tower's features (transformers' within 1e-4)
    move by over 5 times that."""
    good = audio_engine.encode_audio([clips[0]])[0]
    monkeypatch.setattr(
        phi4mm_audio, "chunk_mask", lambda tokens, size, left: torch.ones(tokens, tokens).bool()
    )
    planted = phi4mm_clips.encode(audio_engine.audio, [clips[0]])[0]
    assert max_diff(planted, good) > 5e-4


def test_run_chat_and_transcriptions_reply_as_transformers(model, folder, audio_engine, tmp_path):
    """`llmrun run --audio`, `chat`'s /audio, serve's /v1/audio/transcriptions (its prompt
    the model card's, as the processor makes it) and an input_audio part give transformers'
    greedy tokens."""
    wav = tmp_path / "clip.wav"
    wav.write_bytes(CLIPS[0])
    clip = audio.open_audio(CLIPS[0])
    reference = audio_reference(folder, clip)
    with torch.no_grad():
        out = model.generate(**reference, max_new_tokens=8, do_sample=False)
    ids = reference["input_ids"][0].tolist()
    expected = out[0, len(ids) :].tolist()
    options = ("-n", "8", "--temperature", "0")
    result = llmrun("run", folder, "--audio", wav, QUESTION, *options, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    stream = audio_engine.tokenizer.stream(after=ids)
    reply = "".join(stream.add(t) for t in expected) + stream.flush()
    chat = llmrun("chat", folder, *options, "-c", "64", input=f"/audio {wav}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == reply + "\n\n"
    request = audio_reference(folder, clip, phi4mm_clips.INSTRUCTION)
    prompt = request["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**request, max_new_tokens=CONTEXT + 1 - len(prompt), do_sample=False)
    tokens = [t for t in out[0, len(prompt) :].tolist() if t not in (2, END)]
    service = Service("phi4mm", set(), None, parallel=1, queue=4)
    service.start(audio_engine)
    try:
        with TestClient(create_app(service)) as client:
            files = {"file": ("clip.wav", CLIPS[0], "audio/wav")}
            response = client.post(
                "/v1/audio/transcriptions", data={"model": "phi4mm"}, files=files
            )
            refused = client.post(
                "/v1/audio/transcriptions", data={"model": "phi4mm", "language": "en"}, files=files
            )
            part = {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(CLIPS[0]).decode(), "format": "wav"},
            }
            content = [part, {"type": "text", "text": QUESTION}]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
            chatted = client.post("/v1/chat/completions", json={**body, "temperature": 0})
    finally:
        service.close()
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["input_tokens"] == len(prompt)
    assert answer["text"] == audio_engine.tokenizer.decode(tokens).strip()
    assert refused.status_code == 400
    assert "takes no language" in refused.json()["error"]["message"]
    assert chatted.status_code == 200, chatted.text
    assert chatted.json()["choices"][0]["message"]["content"] == reply

"""Qwen2.5-Omni's thinker with images and with audio against transformers: a tiny random
Qwen2_5OmniThinkerForConditionalGeneration (a Qwen2 with M-RoPE, Qwen2.5-VL's vision
tower, its windowed audio tower) and Qwen2_5OmniProcessor (Qwen2VLImageProcessor,
WhisperFeatureExtractor, its chat template and token counts) make the reference, for a
prompt with two images and one with two clips (1.5 s at 16 kHz; 2.5 s at 22.05 kHz, which
spans two of the tower's 2-second windows). The input ids, the image and audio embeddings
(as the language model takes them), the logits and 8 greedy tokens match; so do the Hub's
layout (thinker_config, thinker.* weights, talker weights left unread), and the text GGUF
and the one mmproj GGUF of both towers laid out as llama.cpp's converter writes them
(benchmarks/llama_cpp_qwen25_omni.py runs the converter). serve's replies to an image and
to an input_audio part are run's. Audio attending across its windows, or images turned
by plain positions, fail.

Tolerances: ids and tokens exact; embeddings and logits within 1e-4.
"""

import copy
import json
import shutil

import pytest
import torch
from audio_checks import audio_body, placed
from image_serving import check_reply_is_run_s
from in_process import llmrun
from qwen2_5_omni_helpers import (
    AUDIO,
    AUDIO_BOS,
    AUDIO_EOS,
    IMAGE,
    check_matches,
    greedy_tokens,
    hub_layout,
    processor_inputs,
    save_qwen25_omni_dir,
    tiny_qwen25_omni,
    write_mmproj,
    write_text_gguf,
)
from serving import GREEDY, chat_reply, image_prompt, served
from vision_checks import logits
from vision_helpers import picture
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, qwen2_vl_images
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.server.app import _towers

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
QUESTION = "What is this?"
# 56x84 pixels take 2x3 merged tokens, 84x140 3x5.
WIDE, OTHER = picture(56, 84, 1), picture(84, 140, 2)
# 150 and 250 feature frames: 75 and 125 after the convolutions, 37 and 62 tokens.
TOKENS = [37, 62]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen25_omni()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_qwen25_omni_dir(model, tmp_path_factory.mktemp("qwen2.5-omni"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True, audio=True)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wavs")
    first, second = tmp / "first.wav", tmp / "second.wav"
    first.write_bytes(wav_bytes(chirp(1.5, 16000, seed=1), 16000))
    second.write_bytes(wav_bytes(chirp(2.5, 22050, seed=2), 22050))
    return first, second


@pytest.fixture(scope="module")
def clips(wavs):
    return [audio.open_audio(path) for path in wavs]


def user_turn(kind: str, count: int) -> list[dict]:
    content = [{"type": kind}] * count + [{"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def image_reference(folder):
    images = [open_image(WIDE), open_image(OTHER)]
    return processor_inputs(folder, user_turn("image", 2), images=images)


@pytest.fixture(scope="module")
def audio_reference(folder, clips):
    return processor_inputs(folder, user_turn("audio", 2), clips=[c.samples for c in clips])


def image_prompt_of(engine):
    pictures = [open_image(WIDE), open_image(OTHER)]
    return engine.image_prompt(engine.prompt_text(QUESTION, images=2), pictures)


def audio_prompt_of(engine, clips):
    return engine.audio_prompt(engine.prompt_text(QUESTION, audio=len(clips)), clips)


def test_an_image_prompt_matches_transformers(model, engine, image_reference):
    prompt = image_prompt_of(engine)
    assert [len(e) for e in prompt[1].embeds] == [6, 15]
    assert prompt[1].shift_at(len(prompt[0])) < 0  # the text after them is shifted
    check_matches(model, engine, prompt, image_reference, IMAGE)


def test_an_audio_prompt_matches_transformers(model, engine, clips, audio_reference):
    prompt = audio_prompt_of(engine, clips)
    ids, prompt_images = prompt
    assert [engine.audio_tokens(clip) for clip in clips] == TOKENS
    for start, count in zip(prompt_images.starts, TOKENS, strict=True):
        assert ids[start - 1] == AUDIO_BOS and ids[start + count] == AUDIO_EOS
    check_matches(model, engine, prompt, audio_reference, AUDIO)


def test_audio_attending_across_its_windows_fails(
    model, engine, clips, audio_reference, monkeypatch
):
    expected = placed(model, audio_reference, AUDIO)
    monkeypatch.setattr(engine.audio.encoder.args, "n_window", 1000)
    planted = torch.cat(engine.encode_audio(clips))
    assert planted.shape == expected.shape
    assert (planted[37:] - expected[37:]).abs().max() > 1e-2


def test_images_turned_by_plain_positions_fail(model, engine, image_reference, monkeypatch):
    def plain(length, starts, grids):
        return torch.arange(length).expand(3, -1)

    monkeypatch.setattr(qwen2_vl_images, "rope_index", plain)
    ids, prompt_images = image_prompt_of(engine)
    with torch.no_grad():
        expected = model(**image_reference).logits[0]
    assert (logits(engine, ids, prompt_images) - expected).abs().max() > 1e-2


def test_the_hubs_layout_loads_the_thinker(
    model, folder, clips, image_reference, audio_reference, tmp_path
):
    hub = hub_layout(folder, tmp_path / "hub")
    engine = api.load(str(hub), device="cpu", vision=True, audio=True)
    ids, prompt_images = image_prompt_of(engine)
    with torch.no_grad():
        expected = model(**image_reference).logits[0]
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    heard = torch.cat(audio_prompt_of(engine, clips)[1].embeds)
    expected_rows = placed(model, audio_reference, AUDIO)
    torch.testing.assert_close(heard, expected_rows, atol=1e-4, rtol=0)
    text_only = api.load(str(hub), device="cpu")
    assert text_only.vision is None and text_only.audio is None
    # Both towers said to load at their first input (the note named the vision tower only).
    assert text_only.checkpoint.notes == [
        f"{hub}: a multimodal Qwen2.5-Omni; running its language model, without the vision "
        "tower until an image is given (--image, /image)",
        f"{hub}: Qwen2.5-Omni's audio tower is not run until a clip is given (--audio, /audio)",
    ]
    shown = llmrun("show", hub)  # the thinker's language model, not its talker's
    assert shown.returncode == 0, shown.stderr
    assert "architecture   qwen2_5_omni\n" in shown.stdout
    assert "context length 2048\n" in shown.stdout
    text = model.model.language_model.num_parameters() + model.lm_head.weight.numel()
    assert f"({text:,})" in shown.stdout


def test_gguf_with_mmproj_matches_transformers(
    model, clips, image_reference, audio_reference, tmp_path
):
    text = write_text_gguf(model, tmp_path / "model.gguf")
    # F32 but the audio conv weights, which the converter keeps F16 whatever --outtype
    # says: transformers with those weights rounded the same way is the reference.
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    rounded = copy.deepcopy(model)
    for conv in (rounded.model.audio_tower.conv1, rounded.model.audio_tower.conv2):
        conv.weight.data = conv.weight.data.half().float()
    engine = api.load(str(text), device="cpu", mmproj=mmproj, vision=True, audio=True)
    check_matches(rounded, engine, image_prompt_of(engine), image_reference, IMAGE)
    check_matches(rounded, engine, audio_prompt_of(engine, clips), audio_reference, AUDIO)


def test_a_gguf_loads_the_other_tower_of_its_mmproj_at_first_use(model, clips, tmp_path):
    """A GGUF loaded with its mmproj for images only (`chat --mmproj`) takes a clip too: the
    audio tower loads from the same mmproj at the first one (it said to give --mmproj); and
    serve loads both towers of such an mmproj (it loaded the audio tower alone)."""
    text = write_text_gguf(model, tmp_path / "model.gguf")
    mmproj = write_mmproj(model, tmp_path / "mmproj.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    assert engine.vision is not None and engine.audio is None
    ids, prompt_images = audio_prompt_of(engine, clips)
    assert engine.audio is not None and AUDIO in ids
    heard = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    assert heard.vision is None
    image_ids, _ = image_prompt_of(heard)
    assert heard.vision is not None and IMAGE in image_ids
    assert _towers(text, mmproj) == (True, True)


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_run_and_chat_reply_as_transformers(model, folder, engine, wavs, tmp_path, kind):
    """`llmrun run FOLDER --image A "prompt"` (and `--audio A`), and `chat` with `/image A`
    (`/audio A`) then the question: transformers' greedy reply."""
    if kind == "image":
        media = tmp_path / "wide.png"
        media.write_bytes(WIDE)
        reference = processor_inputs(folder, user_turn("image", 1), images=[open_image(WIDE)])
    else:
        media = wavs[1]
        clip = audio.open_audio(media)
        reference = processor_inputs(folder, user_turn("audio", 1), clips=[clip.samples])
    expected = greedy_tokens(model, reference)
    options = ("-n", "8", "--temperature", "0")
    result = llmrun(
        "run", folder, f"--{kind}", media, QUESTION, *options, "--json", "--logprobs", "0"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected
    chat = llmrun("chat", folder, *options, input=f"/{kind} {media}\n{QUESTION}")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == engine.tokenizer.decode(expected) + "\n\n"


def test_a_clip_over_the_chunk_length_or_too_short_is_one_error_line(engine, folder, tmp_path):
    """The feature extractor cuts a clip at its chunk_length (the Hub's 300 seconds, the
    folder's where it says otherwise); llmrun refuses it rather than drop audio, and one too
    short for a token."""
    with pytest.raises(UsageError, match="takes 300 seconds a clip at most"):
        engine.audio_tokens(audio.Clip(torch.zeros(300 * 16000 + 1).numpy(), "long"))
    with pytest.raises(UsageError, match="too short for Qwen2.5-Omni"):
        engine.audio_tokens(audio.Clip(torch.zeros(320).numpy(), "tiny"))
    shorter = tmp_path / "shorter"
    shutil.copytree(folder, shorter)
    settings = json.loads((shorter / "preprocessor_config.json").read_text())
    (shorter / "preprocessor_config.json").write_text(json.dumps({**settings, "chunk_length": 30}))
    long = tmp_path / "long.wav"
    long.write_bytes(wav_bytes(chirp(30.5, 8000, seed=3), 8000))
    result = llmrun("run", shorter, "--audio", long, QUESTION)
    assert result.returncode == 2
    # The note that the vision tower waits for an image, then the one error line.
    *notes, line = result.stderr.strip().splitlines()
    assert [note.split(": ")[0] for note in notes] == ["note"]
    assert line == (
        f"error: {long}: 30.5 seconds of audio; Qwen2.5-Omni takes 30 seconds a clip at most "
        "(cut it into clips)"
    )


def test_serve_replies_to_an_image_and_to_audio_as_run_does(model, folder, engine, wavs):
    data = wavs[1].read_bytes()
    for client in served(engine, "qwen2.5-omni"):
        reply = chat_reply(client, WIDE, QUESTION)
        heard = client.post("/v1/chat/completions", json=audio_body(data, QUESTION))
    _, ids, _, _ = image_prompt(engine, WIDE, QUESTION)
    reference = processor_inputs(folder, user_turn("image", 1), images=[open_image(WIDE)])
    check_reply_is_run_s(reply, engine, (WIDE, QUESTION), greedy_tokens(model, reference), len(ids))
    assert heard.status_code == 200, heard.text
    ids, prompt_images = audio_prompt_of(engine, [audio.open_audio(data)])
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=prompt_images))
    assert heard.json()["choices"][0]["message"]["content"] == expected
    assert heard.json()["usage"]["prompt_tokens"] == len(ids)

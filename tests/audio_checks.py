"""What the audio-taking families' tests against transformers share: chirps written as WAV
files, a user turn of a clip and a question, the rows transformers' language model takes
at a clip's places, a clip prompt's ids, embeddings, logits and tokens, and `run --audio`'s,
`chat`'s and serve's replies to clips. Tolerances: embeddings and logits 1e-4 (absolute),
tokens and text exact."""

import base64
import json
from pathlib import Path

import torch
from in_process import llmrun
from serving import GREEDY
from starlette.testclient import TestClient
from vision_checks import logits
from voxtral_helpers import chirp, wav_bytes

from llmrun import audio
from llmrun.generate import KVState, prefill
from llmrun.server import Service, create_app


def chirp_wavs(tmp: Path, long_seconds: float, short_seconds: float = 0.7) -> tuple[Path, Path]:
    """long.wav and short.wav in `tmp`: 16 kHz chirps (seeds 1 and 2) of these lengths."""
    long, short = tmp / "long.wav", tmp / "short.wav"
    long.write_bytes(wav_bytes(chirp(long_seconds, 16000, seed=1), 16000))
    short.write_bytes(wav_bytes(chirp(short_seconds, 16000, seed=2), 16000))
    return long, short


def two_rate_wavs(tmp: Path) -> tuple[Path, Path]:
    """first.wav and second.wav in `tmp`: chirps of 2 s at 16 kHz (seed 1) and of 1.3 s at
    22.05 kHz (seed 2), which the audio loader resamples."""
    first, second = tmp / "first.wav", tmp / "second.wav"
    first.write_bytes(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    second.write_bytes(wav_bytes(chirp(1.3, 22050, seed=2), 22050))
    return first, second


def audio_user_turn(question: str) -> list[dict]:
    """A chat of one user turn: a clip, then `question`."""
    return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]}]


def placed(model, reference, token: int) -> torch.Tensor:
    """The rows transformers' language model takes at the places of `token` (the clip's)
    when `model` runs on the processor's inputs `reference`."""
    taken = {}

    def keep(module, args, kwargs):
        taken["embeds"] = kwargs["inputs_embeds"][0]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**reference)
    finally:
        hook.remove()
    return taken["embeds"][reference["input_ids"][0] == token]


def audio_body(data: bytes, question: str) -> dict:
    """A chat request of one user turn: `data` as an input_audio part, then `question`."""
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"},
    }
    return {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]}],
        "max_tokens": 8,
        "temperature": 0,
    }


def check_served_audio_reply(engine, name: str, data: bytes, question: str) -> None:
    """serve's reply to a chat request of the WAV `data` as an input_audio part and
    `question` is the single-sequence loop's on the prompt `llmrun run` makes of them."""
    service = Service(name, set(), None, parallel=1, queue=2)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            response = http.post("/v1/chat/completions", json=audio_body(data, question))
    finally:
        service.close()
    assert response.status_code == 200, response.text
    ids, prompt_audio = engine.audio_prompt(
        engine.prompt_text(question, audio=1), [audio.open_audio(data)]
    )
    expected = "".join(r.text for r in engine.generate(ids, GREEDY, 8, images=prompt_audio))
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert response.json()["usage"]["prompt_tokens"] == len(ids)


def check_run_with_audio(folder: Path, wavs, question: str, expected: list[int]) -> None:
    """`llmrun run FOLDER --audio A [--audio B ...] "question"` prints the tokens
    `expected` (transformers' greedy reply)."""
    clips = [arg for wav in wavs for arg in ("--audio", str(wav))]
    args = ["run", str(folder), *clips, question]
    result = llmrun(*args, "-n", "8", "--temperature", "0", "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected


def check_chat_with_audio(folder: Path, wav: Path, question: str, expected: str) -> None:
    """`chat --audio WAV` and `/audio WAV` then the question both print the reply
    `expected` (transformers' greedy one) and a blank line."""
    options = ("-n", "8", "--temperature", "0")
    flag = llmrun("chat", folder, "--audio", wav, *options, input=question)
    assert flag.returncode == 0, flag.stderr
    assert flag.stdout == expected + "\n\n"
    command = llmrun("chat", folder, *options, input=f"/audio {wav}\n{question}")
    assert command.returncode == 0, command.stderr
    assert command.stdout == expected + "\n\n"


def check_clip_prompt(
    model,
    engine,
    clip,
    reference,
    question: str,
    token: int,
    context: int,
    chunk: int,
    marks: tuple[int, int] | None = None,
    same_ids: bool = True,
) -> list[int]:
    """llmrun's prompt of `clip` and `question`: its ids (between the ids `marks`, where
    the family has them), the embeddings placed at the `token` places, the logits (whole,
    and generate's prefill in chunks of `chunk` through a cache of `context`) and 8 greedy
    tokens (returned) are transformers' on the processor's inputs `reference`; `same_ids`
    False: transformers runs on llmrun's ids (with the reference's features)."""
    ids, prompt_images = engine.audio_prompt(engine.prompt_text(question, audio=1), [clip])
    if same_ids:
        assert ids == reference["input_ids"][0].tolist()
    else:
        row = torch.tensor([ids])
        reference = {**reference, "input_ids": row, "attention_mask": torch.ones_like(row)}
    if marks is not None:
        (start,) = prompt_images.starts
        count = len(prompt_images.embeds[0])
        assert ids[start - 1] == marks[0] and ids[start + count] == marks[1]
    torch.testing.assert_close(
        prompt_images.embeds[0], placed(model, reference, token), atol=1e-4, rtol=0
    )
    with torch.no_grad():
        expected = model(**reference).logits[0]
        state = KVState(engine.model.new_cache(1, context, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=chunk, images=prompt_images)
        out = model.generate(**reference, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = out[0, reference["input_ids"].shape[1] :].tolist()
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == tokens
    return tokens


def check_run_and_chat_with_a_clip(
    engine, folder: Path, wav: Path, question: str, expected: list[int]
) -> None:
    """`llmrun run FOLDER --audio WAV "question"` prints the tokens `expected`, and `chat`
    with `/audio WAV` then the question their text."""
    check_run_with_audio(folder, [wav], question, expected)
    options = ("-n", "8", "--temperature", "0")
    chat = llmrun("chat", folder, *options, input=f"/audio {wav}\n{question}")
    assert chat.returncode == 0, chat.stderr
    # The stream keeps the first token's leading space, which a whole decode drops.
    assert chat.stdout.lstrip(" ") == engine.tokenizer.decode(expected) + "\n\n"

"""Audio in serve's requests: chat's `input_audio` content parts ({"data": BASE64,
"format": "wav"}), decoded and encoded for the prompt as llmrun.server.images does images.

The bytes are untrusted: a size limit before base64 is decoded, the WAV header's checks
(llmrun.audio.open_audio: sizes, duration), one 400 for anything undecodable; formats
other than WAV are a 400 naming what is taken. A clip's prompt tokens (Engine.audio_tokens)
are counted before it is encoded, so clips that the context cannot hold are a 400 first.
Each distinct clip of a request (by the SHA-256 of its bytes) is encoded once, and the
latest KEPT_CLIPS stay encoded for the requests that send them again. The digests salt
the names of the KV blocks the clips begin in (llmrun.batching), as images' do, so the
prefix cache shares a clip's keys and values only between prompts that hold the same clip.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from llmrun import api
from llmrun.audio import open_audio
from llmrun.audio_families import NAMES
from llmrun.server.images import Encoded, MediaEncoder
from llmrun.server.schema import ApiError

# A clip's bytes, after base64 (OpenAI's limit for an audio file).
MAX_AUDIO_BYTES = 25 << 20
# Encoded clips kept for later requests (a 30-second clip is 375 tokens).
KEPT_CLIPS = 16


@dataclass
class AudioRef:
    data: str  # base64
    format: str
    param: str  # the request field it came from, for errors

    @property
    def url(self) -> str:
        """The part's payload as the body carries it (what check_body leaves out)."""
        return self.data


class AudioEncoder(MediaEncoder):
    """Audio clips: their prompt tokens by Engine.audio_tokens (Qwen2-Audio refuses some
    lengths)."""

    over = "the audio up to {param} takes"

    def __init__(self, kept: int = KEPT_CLIPS) -> None:
        super().__init__(kept)

    def open(self, data: bytes, param: str) -> Any:
        return open_audio(data, name=param)

    def tokens(self, engine: api.Engine, part: Any) -> int:
        return engine.audio_tokens(part)

    def embed(self, engine: api.Engine, part: Any) -> torch.Tensor:
        return engine.encode_audio([part])[0]


def audio_refs(messages: list[dict[str, Any]], where: str) -> list[AudioRef]:
    """The audio parts of chat-template messages (Message.as_dict's {"type": "audio",
    "data": ..., "format": ...}), in order, each with its field; audio outside a user
    message is a 400."""
    refs = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") != "audio":
                continue
            param = f"{where}.{i}.content.{j}.input_audio.data"
            if message["role"] != "user":
                raise ApiError(400, f"{param}: audio goes in user messages", param=param)
            refs.append(AudioRef(part["data"], part["format"], param))
    return refs


async def read_audio(
    engine: api.Engine, encoder: AudioEncoder, name: str, refs: list[AudioRef]
) -> Encoded | None:
    """The clips of `refs` encoded for the prompt (None without any), checked: a model
    (`name`) that takes audio, room in its context, base64 WAV data."""
    if not refs:
        return None
    param = refs[0].param
    if engine.audio is None:
        raise ApiError(400, f"{param}: {no_audio(engine, name)}", param=param)
    if engine.template is None:
        raise ApiError(400, f"{name} has no chat template to place audio in", param=param)

    def encode() -> Encoded:
        payloads = [_wav_bytes(ref) for ref in refs]
        digests = [hashlib.sha256(data).digest() for data in payloads]
        params = [ref.param for ref in refs]
        return Encoded(encoder.encode(engine, payloads, digests, params), digests)

    return await asyncio.to_thread(encode)


def media_digests(
    messages: list[dict[str, Any]], images: Encoded | None, clips: Encoded | None
) -> list[bytes]:
    """The digests of the messages' images and clips in the order their parts come, which
    is the prompt's (each kind's `Encoded` holds its own in order)."""
    kinds = [
        part["type"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") in ("image", "audio")
    ]
    digests = {
        "image": iter(images.digests if images is not None else ()),
        "audio": iter(clips.digests if clips is not None else ()),
    }
    return [next(digests[kind]) for kind in kinds]


def _wav_bytes(ref: AudioRef) -> bytes:
    """The bytes of a part's base64 WAV data; another format, or bad base64, is a 400."""
    param = ref.param
    if ref.format.lower() != "wav":
        where = param.removesuffix(".data") + ".format"
        raise ApiError(
            400, f'{where}: audio of format {ref.format!r}; serve takes WAV ("wav")', param=where
        )
    if len(ref.data) > -(-MAX_AUDIO_BYTES // 3) * 4:
        raise ApiError(400, f"{param}: audio over {MAX_AUDIO_BYTES >> 20} MiB", param=param)
    try:
        data = base64.b64decode(ref.data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param}: the base64 does not decode", param=param) from None
    if not data:
        raise ApiError(400, f"{param}: no audio", param=param)
    return data


def no_audio(engine: api.Engine, name: str) -> str:
    """Why the model takes no audio, and what to do where something can be."""
    if engine.checkpoint.gguf is not None:
        return (
            f"{name} takes no audio: a GGUF's audio encoder is its mmproj file; for {NAMES} "
            "models, start serve with --mmproj FILE (llama.cpp's mmproj GGUF of the model)"
        )
    return f"{name} takes no audio (serve takes it for {NAMES} models)"

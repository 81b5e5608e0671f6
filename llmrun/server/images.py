"""Images in serve's requests: the `data:` URLs of chat's `image_url` content parts and
the Responses API's `input_image` parts, decoded and encoded for the prompt.

No URL is fetched: an http(s) or file URL is a 400, so no request makes the server reach
anything. The bytes are untrusted: a size limit before base64 is decoded, Pillow's checks
and llmrun's pixel limit (llmrun.images.open_image), one 400 for anything undecodable.
An image's prompt tokens (Engine.image_tokens: Gemma 3's fixed count, Mistral 3's and
Qwen2-VL's by its size) are counted before it is encoded, so images that the context
cannot hold are a 400 first. Each distinct image of a request (by the SHA-256 of its bytes) is encoded once, and the
latest KEPT_IMAGES stay encoded for the requests that send them again (a conversation
sends its images every turn). The digests salt the names of the KV blocks the images
begin in (llmrun.batching), so the prefix cache shares an image's keys and values only
between prompts that hold the same image.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request

from llmrun import api
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.server.schema import ApiError
from llmrun.vision_families import NAMES

# An image's bytes, after base64 (OpenAI's limit per image).
MAX_IMAGE_BYTES = 20 << 20
# Encoded images kept for later requests (Gemma 3 27B's are 5.5 MB each).
KEPT_IMAGES = 16


@dataclass
class ImageRef:
    url: str
    param: str  # the request field it came from, for errors


@dataclass
class Encoded:
    """A prompt's images in order: each one's soft-token embeddings and content digest."""

    embeds: list[torch.Tensor]
    digests: list[bytes]


class MediaEncoder:
    """The server's encoding of one kind of content part (images here, audio in
    llmrun.server.audio): one part at a time (each takes every core, and an 896-pixel
    image's attention takes memory), the latest `kept` kept by digest with the prompt
    tokens each takes. A kind says how to open a part, count its tokens and encode it."""

    over = "the parts up to {param} take"  # how a 400 names the parts over the context

    def __init__(self, kept: int) -> None:
        self.kept_count = kept
        self.kept: OrderedDict[bytes, tuple[torch.Tensor, int]] = OrderedDict()
        self.lock = threading.Lock()

    def open(self, data: bytes, param: str) -> Any:
        raise NotImplementedError

    def tokens(self, engine: api.Engine, part: Any) -> int:
        raise NotImplementedError

    def embed(self, engine: api.Engine, part: Any) -> torch.Tensor:
        raise NotImplementedError

    def encode(
        self,
        engine: api.Engine,
        payloads: Sequence[bytes],
        digests: Sequence[bytes],
        params: Sequence[str],
    ) -> list[torch.Tensor]:
        """Each part's embeddings, in order, each distinct one encoded once; its prompt
        tokens are counted first, and parts that take more than the context holds are a
        400 before the part over it is encoded."""
        encoded: dict[bytes, tuple[torch.Tensor, int]] = {}  # this request's
        tokens = 0
        with self.lock:
            for data, digest, param in zip(payloads, digests, params, strict=True):
                if digest not in encoded and digest in self.kept:
                    self.kept.move_to_end(digest)
                    encoded[digest] = self.kept[digest]
                part = None
                if digest in encoded:
                    count = encoded[digest][1]
                else:
                    try:
                        part = self.open(data, param)
                        count = self.tokens(engine, part)  # (some shapes are refused)
                    except UsageError as e:
                        raise ApiError(400, str(e), param=param) from None
                tokens += count
                if tokens > engine.ctx_size:
                    raise ApiError(
                        400,
                        f"{self.over.format(param=param)} {tokens} tokens, more than the "
                        f"context of {engine.ctx_size} tokens holds",
                        param=param,
                        code="context_length_exceeded",
                    )
                if part is not None:
                    encoded[digest] = (self.embed(engine, part), count)
                    self.kept[digest] = encoded[digest]
                    while len(self.kept) > self.kept_count:
                        self.kept.popitem(last=False)
        return [encoded[d][0] for d in digests]


class ImageEncoder(MediaEncoder):
    """Images: their prompt tokens by Engine.image_tokens (Gemma 3's fixed count, Mistral
    3's and Qwen2-VL's by its size)."""

    over = "the images up to {param} take"

    def __init__(self, kept: int = KEPT_IMAGES) -> None:
        super().__init__(kept)

    def open(self, data: bytes, param: str) -> Any:
        return open_image(data, name=param)

    def tokens(self, engine: api.Engine, part: Any) -> int:
        return engine.image_tokens(part)

    def embed(self, engine: api.Engine, part: Any) -> torch.Tensor:
        return engine.encode_images([part])[0]


def image_refs(messages: list[dict[str, Any]], where: str) -> list[ImageRef]:
    """The image parts of chat-template messages (Message.as_dict's {"type": "image",
    "url": ...}), in order, each with its field (its own "param", else
    `where`.i.content.j.image_url.url); an image outside a user message is a 400."""
    refs = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") != "image":
                continue
            param = part.get("param") or f"{where}.{i}.content.{j}.image_url.url"
            if message["role"] != "user":
                raise ApiError(400, f"{param}: images go in user messages", param=param)
            refs.append(ImageRef(part["url"], param))
    return refs


def check_body(request: Request, refs: list[ImageRef], limit: int) -> None:
    """A body over `limit` bytes is refused (413) unless its images' URLs make the rest."""
    size = getattr(request.state, "body_bytes", 0) - sum(len(ref.url) for ref in refs)
    if size > limit:
        raise ApiError(413, f"the request body is over {limit} bytes besides its images")


async def read_images(
    engine: api.Engine, encoder: ImageEncoder, name: str, refs: list[ImageRef]
) -> Encoded | None:
    """The images of `refs` encoded for the prompt (None without any), checked: a model
    (`name`) that takes images, room in its context, data: URLs of images."""
    if not refs:
        return None
    param = refs[0].param
    if engine.vision is None:
        raise ApiError(400, f"{refs[0].param}: {_no_images(engine, name)}", param=param)
    if engine.template is None and not (engine.image_to_text or engine.image_first):
        raise ApiError(400, f"{name} has no chat template to place images in", param=param)

    def encode() -> Encoded:
        payloads = [data_url_bytes(ref.url, ref.param) for ref in refs]
        digests = [hashlib.sha256(data).digest() for data in payloads]
        params = [ref.param for ref in refs]
        return Encoded(encoder.encode(engine, payloads, digests, params), digests)

    return await asyncio.to_thread(encode)


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a base64 `data:` URL; any other URL, or bad base64, is a 400."""
    scheme, colon, rest = url.partition(":")
    if not colon or scheme.lower() != "data":
        shown = url if len(url) <= 40 else url[:40] + "..."
        raise ApiError(
            400,
            f"{param}: serve takes images as base64 data: URLs (data:image/png;base64,...) "
            f"and fetches nothing, not {shown!r}",
            param=param,
        )
    header, comma, payload = rest.partition(",")
    if not comma or header.rpartition(";")[2].strip().lower() != "base64":
        raise ApiError(
            400,
            f"{param}: the data: URL is not base64 (data:image/png;base64,...)",
            param=param,
        )
    if len(payload) > -(-MAX_IMAGE_BYTES // 3) * 4:
        raise ApiError(400, f"{param}: an image over {MAX_IMAGE_BYTES >> 20} MiB", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(
            400, f"{param}: the data: URL's base64 does not decode", param=param
        ) from None
    if not data:
        raise ApiError(400, f"{param}: the data: URL holds no image", param=param)
    return data


def _no_images(engine: api.Engine, name: str) -> str:
    """Why the model takes no images, and what to do where something can be."""
    if engine.checkpoint.gguf is not None:
        return (
            f"{name} takes no images: a GGUF's image encoder is its mmproj file; for {NAMES} "
            "models, start serve with --mmproj FILE (llama.cpp's mmproj GGUF of the model)"
        )
    return f"{name} takes no images (serve takes them for {NAMES} models)"

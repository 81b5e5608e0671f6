"""OpenAI's speech to text: POST /v1/audio/transcriptions, a multipart/form-data body of
`file` (WAV), `model`, `language` (ISO 639-1; SeamlessM4T's: that or its three-letter code
of the language it writes), `prompt`, `response_format` (json, text,
srt, verbose_json or vtt: llmrun.transcript_formats), `timestamp_granularities[]` (segment,
word or both; with verbose_json), `temperature` and `num_beams` (an extension, as
completions take it: a beam search's beams, for the encoder-decoders whose transcribers
search, transcribers.BEAMED; another family's is a 400 unless 1), answered as OpenAI answers.
srt, vtt and segment timestamps come from a family that predicts times (Whisper: decoded
with timestamps for them); another's srt, vtt or segment is a 400 naming the model, its
verbose_json one without segments. Word timestamps are Whisper's (llmrun.whisper_words, from
its generation_config.json's alignment_heads; a folder without them is a 400) and a Parakeet
transducer's (llmrun.parakeet): verbose_json's "words", and its "segments" only where segment
is asked for too (none asked: segments).

The prompt is the one the model's audio family documents for transcription
(llmrun.audio_families: Voxtral's is mistral_common's, Qwen3-ASR's, GLM-ASR's, Audio Flamingo 3's
and OmniASR's their processors' through the chat template, Granite Speech Plus's the one transformers documents,
OpenAI's `prompt` Qwen3-ASR's context), and the answer's text is read as the family's processor reads it
(Qwen3-ASR's without its "language NAME<asr_text>", GLM-ASR's and Audio Flamingo 3's without "The
spoken content of the audio is"); a family that documents none is a 400. The clip is encoded as chat's `input_audio` parts are (llmrun.server.audio: the same
size limit, WAV checks and kept encodings), and the request runs on the scheduler with the
others, cancelled when its client goes away and counted in /metrics as "transcriptions".
The body is read up to a limit before the form is parsed (python-multipart, Starlette's
form parser), so an upload's size is bounded however it is sent.

A Whisper model (llmrun.whisper), and so a Cohere Transcribe or Moonshine model (the
encoder-decoders of llmrun.transcribers), transcribes off the scheduler, which decodes
decoder-only models: one request at a time under a lock (each takes every core), greedily
OpenAI's `prompt` as Whisper's initial prompt. POST /v1/audio/translations is
Whisper's (or Canary's) English translation of the clip, the same form without `language`
(Canary's with it: the clip's, which Canary does not detect).

A Whisper request's `temperature`, where given, starts openai-whisper's temperature fallback
(llmrun.whisper.Fallback: from it up by 0.2 to 1.0, with its thresholds); OpenAI's API
documents that its default, 0, "will use log probability to automatically increase the
temperature until certain thresholds are hit". Left out, a Whisper request decodes greedily
without retries (as generate does by default), so that its answer is reproducible; OpenAI's
clients send no temperature unless one is set. Another family decodes greedily: a temperature
over 0 is a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import threading
import time
from typing import Any

import python_multipart  # noqa: F401  (Starlette's form parser: serve names it if missing)
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from llmrun import audio, audio_families, batching, transcribers
from llmrun import transcript_formats as formats
from llmrun.beam_search import Beams
from llmrun.errors import ModelFormatError, UsageError
from llmrun.server.audio import MAX_AUDIO_BYTES, no_audio
from llmrun.server.schema import ApiError
from llmrun.server.service import Generation, Service, generating_engine

GRANULARITIES = "timestamp_granularities[]"  # as OpenAI's clients send the list
FIELDS = (
    "file",
    "model",
    "language",
    "prompt",
    "response_format",
    "temperature",
    "num_beams",
    GRANULARITIES,
)
TIMED_FAMILIES = " and ".join(
    dict.fromkeys(transcribers.FAMILIES[t][0] for t in transcribers.TIMESTAMPED)
)
# The form's fields besides the file.
MAX_FIELDS_BYTES = 64 << 10
TRANSCRIBES = ", ".join(f.name for f in audio_families.FAMILIES if f.transcription is not None)
# One encoder-decoder speech request at a time (Whisper, Cohere Transcribe, Moonshine):
# its decoding, off the scheduler, takes every core.
SPEECH_LOCK = threading.Lock()


async def transcriptions(request: Request) -> Response:
    """POST /v1/audio/transcriptions: the text of the uploaded clip, in the response_format
    asked for."""
    arrived = time.perf_counter()
    service: Service = request.app.state.service
    service.authorize(request)
    form, data = await _read_form(request)
    fields = {name: _text(form, name) for name in FIELDS[1:]}
    engine = service.ready_engine(fields["model"])
    if not engine.transcribes:
        engine = generating_engine(service, fields["model"])
    response_format = _response_format(
        form, engine.speech_timestamps, service.model_id, engine.word_timestamps
    )
    language = fields["language"] or None
    # SeamlessM4T's languages are its three-letter codes (the language it writes), or ISO
    # 639-1 codes of them.
    targeted = engine.transcribes and engine.checkpoint.config["model_type"] in (
        transcribers.TARGETED
    )
    if language is not None and not re.fullmatch(
        "[a-z]{2,3}" if targeted else "[a-z]{2}", language
    ):
        example = (
            "an ISO 639-1 code or the model's three-letter code, such as 'en' or 'eng'"
            if targeted
            else "an ISO 639-1 code, such as 'en'"
        )
        raise ApiError(400, f"language {language!r}: give {example}", param="language")
    params = engine.defaults.updated(temperature=_temperature(fields["temperature"]))
    if engine.transcribes:
        granularities = form.getlist(GRANULARITIES)
        return await _speech_to_text(
            service, engine, data, fields, response_format, None, granularities
        )
    if engine.audio is None:
        raise ApiError(400, f"file: {no_audio(engine, service.model_id)}", param="file")
    family = audio_families.of_encoder(engine.audio)
    if _num_beams(fields["num_beams"]) not in (None, 1):
        raise ApiError(
            400,
            f"num_beams: {service.model_id} is a {family.name} model (an audio-language model), "
            "which llmrun transcribes without beams",
            param="num_beams",
        )
    if family.transcription is None:
        raise ApiError(
            400,
            f"{service.model_id} is a {family.name} model, whose transcription prompt llmrun "
            f"does not know (it transcribes with {TRANSCRIBES} models); send the audio to "
            "/v1/chat/completions as an input_audio part with your instruction",
            param="model",
            code="model_not_supported",
        )
    if fields["prompt"] and not family.transcription_context:
        raise ApiError(
            400,
            f"prompt: {family.name}'s transcription prompt has no place for a text",
            param="prompt",
        )

    try:
        text = engine.transcription_prompt(language, fields["prompt"] or None)
    except (UsageError, ModelFormatError) as e:  # a language it does not take, no template
        raise ApiError(400, str(e)) from None
    digest = hashlib.sha256(data).digest()
    embeds = await asyncio.to_thread(
        service.audio_encoder.encode, engine, [data], [digest], ["file"]
    )
    ids, clips = await asyncio.to_thread(engine.encoded_audio_prompt, text, embeds)
    job = batching.Request(ids, params, images=clips, image_digests=[digest])
    gen = Generation(service, "transcriptions", [job], arrived)
    pieces = [event.text async for _, event in gen.events(request.is_disconnected)]
    if not gen.done:
        return Response(status_code=499)
    transcript = family.transcript("".join(pieces))
    if response_format == "text":
        return PlainTextResponse(transcript)
    if response_format == "verbose_json":
        duration = len(audio.open_audio(data, "file").samples) / audio.SAMPLE_RATE
        return JSONResponse(formats.verbose_json(transcript, language, "transcribe", duration))
    stats = gen.finals[0].stats
    audio_tokens = len(embeds[0])
    usage = {
        "type": "tokens",
        "input_tokens": stats.prompt_tokens,
        "input_token_details": {
            "text_tokens": stats.prompt_tokens - audio_tokens,
            "audio_tokens": audio_tokens,
        },
        "output_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }
    return JSONResponse({"text": transcript, "usage": usage})


async def translations(request: Request) -> Response:
    """POST /v1/audio/translations: a Whisper model's English translation of the uploaded
    clip, in the response_format asked for."""
    service: Service = request.app.state.service
    service.authorize(request)
    form, data = await _read_form(request)
    fields = {name: _text(form, name) for name in FIELDS[1:]}
    engine = service.ready_engine(fields["model"])
    if not engine.transcribes:
        raise ApiError(
            400,
            f"{service.model_id} does not translate speech: llmrun translates it with "
            "Whisper and Canary models",
            param="model",
            code="model_not_supported",
        )
    if fields["language"] and engine.speech_family not in transcribers.TRANSLATE_FROM_LANGUAGE:
        raise ApiError(400, "language: a translation is into English", param="language")
    response_format = _response_format(
        form, engine.speech_timestamps, service.model_id, engine.word_timestamps
    )
    _temperature(fields["temperature"])
    granularities = form.getlist(GRANULARITIES)
    return await _speech_to_text(
        service, engine, data, fields, response_format, "translate", granularities
    )


async def _speech_to_text(
    service: Service,
    engine: Any,
    data: bytes,
    fields: dict[str, str | None],
    response_format: str,
    task: str | None,
    granularities: list[str],
) -> Response:
    """A speech recognition model's (Whisper's, ...) answer to a transcription (`task`
    None: generate's default, which transcribes) or translation request, one at a time;
    `granularities`: its timestamp_granularities[]."""
    temperature = None
    if fields["temperature"]:
        temperature = _temperature(fields["temperature"])
    if temperature and not engine.whisper_options:
        raise ApiError(
            400,
            f"temperature: llmrun decodes {engine.speech_family} greedily; give 0 or leave it out",
            param="temperature",
        )
    num_beams = _num_beams(fields["num_beams"])
    if num_beams not in (None, 1) and engine.checkpoint.config["model_type"] not in (
        transcribers.BEAMED
    ):
        raise ApiError(
            400,
            f"num_beams: {service.model_id} is a {engine.speech_family} model, which llmrun "
            "decodes without beams",
            param="num_beams",
        )
    clip = audio.open_audio(data, "file")
    timed = engine.speech_timestamps and response_format in formats.TIMED
    words = "word" in granularities
    options = {"words": words} if engine.word_timestamps else {}
    if engine.whisper_options:
        options["temperature"] = temperature

    def transcribe():
        with SPEECH_LOCK:
            return engine.transcribe(
                clip,
                fields["language"] or None,
                task,
                fields["prompt"] or None,
                timed,
                num_beams=num_beams,
                **options,
            )

    result = await asyncio.to_thread(transcribe)
    endpoint = "translations" if task == "translate" else "transcriptions"
    service.metrics.requests.labels(endpoint, "200").inc()
    if response_format == "text":
        return PlainTextResponse(result.text)
    if response_format == "json":
        return JSONResponse(formats.json_body(result))
    if response_format == "verbose_json":
        duration = len(clip.samples) / audio.SAMPLE_RATE
        segments = result.segments
        if words and "segment" not in granularities:
            segments = None
        return JSONResponse(
            formats.verbose_json(
                result.text, result.language, task or "transcribe", duration, segments, result.words
            )
        )
    return Response(
        formats.subtitles(response_format, result.segments),
        media_type=formats.MEDIA_TYPES[response_format],
    )


def _response_format(form: FormData, timed: bool, model: str, words: bool = False) -> str:
    """The form's response_format (json unless given), checked with its
    timestamp_granularities[] against what the model answers (`timed`: its family predicts
    times; `words`: it times words too): srt, vtt and segment timestamps from a timed one
    alone, word timestamps from one that times words, timestamp_granularities[] with
    verbose_json alone."""
    response_format = _text(form, "response_format") or "json"
    if response_format not in formats.FORMATS:
        raise ApiError(
            400,
            f"response_format {response_format!r}: llmrun answers {', '.join(formats.FORMATS)}",
            param="response_format",
        )
    granularities = form.getlist(GRANULARITIES)
    for granularity in granularities:
        if granularity == "word" and not words:
            raise ApiError(
                400,
                f"{GRANULARITIES} word: {model} times no words (llmrun times words with "
                "Whisper and Parakeet TDT and RNN-T models); ask for segment",
                param=GRANULARITIES,
            )
        if granularity not in ("segment", "word"):
            raise ApiError(
                400,
                f"{GRANULARITIES} {granularity!r}: give segment or word",
                param=GRANULARITIES,
            )
    if granularities and response_format != "verbose_json":
        raise ApiError(
            400, f"{GRANULARITIES} goes with response_format verbose_json", param=GRANULARITIES
        )
    if not timed and (granularities or response_format in formats.SUBTITLES):
        asked = (
            f"{GRANULARITIES} segment" if granularities else f"response_format {response_format!r}"
        )
        raise ApiError(
            400,
            f"{asked}: {model} predicts no timestamps (llmrun times speech with "
            f"{TIMED_FAMILIES} models)",
            param=GRANULARITIES if granularities else "response_format",
        )
    return response_format


async def _read_form(request: Request) -> tuple[FormData, bytes]:
    """The multipart form, its body read up to MAX_AUDIO_BYTES and the fields' room first,
    and the bytes of its `file`; anything else in it is a 400."""
    limit = MAX_AUDIO_BYTES + MAX_FIELDS_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
    kind = request.headers.get("content-type", "").lower()
    if not kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise ApiError(
            400,
            "the request body must be multipart/form-data, with the audio as its `file` field",
        )

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    try:
        # timestamp_granularities[] may be there twice (segment and word).
        form = await Request(request.scope, receive).form(max_files=1, max_fields=len(FIELDS) + 1)
    except HTTPException as e:
        raise ApiError(400, f"the multipart body does not parse: {e.detail}") from None
    unknown = [name for name in form if name not in FIELDS]
    if unknown:
        raise ApiError(
            400,
            f"{unknown[0]}: not a field llmrun takes (it takes {', '.join(FIELDS)})",
            param=unknown[0],
        )
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(
            400, "file: the audio is missing: send it as the form's file field", param="file"
        )
    data = await upload.read()
    await form.close()
    if not data:
        raise ApiError(400, "file: no audio", param="file")
    if len(data) > MAX_AUDIO_BYTES:
        raise ApiError(400, f"file: audio over {MAX_AUDIO_BYTES >> 20} MiB", param="file")
    return form, data


def _text(form: FormData, name: str) -> str | None:
    """A text field of the form; a file there is a 400."""
    value = form.get(name)
    if isinstance(value, UploadFile):
        raise ApiError(400, f"{name}: a text field, not a file", param=name)
    return value


def _temperature(value: str | None) -> float:
    """The form's temperature: 0 (greedy) unless given, from 0 to 2."""
    if value is None or value == "":
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        temperature = math.nan
    if not 0 <= temperature <= 2:
        raise ApiError(
            400, f"temperature {value!r}: give a number from 0 to 2", param="temperature"
        )
    return temperature


def _num_beams(value: str | None) -> int | None:
    """The form's num_beams (None unless given): a beam search's beams, from 1 (greedy) to
    beam_search.MAX_BEAMS, as completions take it."""
    if value is None or value == "":
        return None
    try:
        return Beams().requested(int(value)).num_beams
    except ValueError:
        raise ApiError(
            400, f"num_beams {value!r}: give a whole number of beams", param="num_beams"
        ) from None
    except UsageError as e:
        raise ApiError(400, f"num_beams: {e}", param="num_beams") from None

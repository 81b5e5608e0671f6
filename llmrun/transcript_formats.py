"""A transcription (llmrun.whisper.Transcription) in each of OpenAI's speech-to-text response
formats: the bodies serve's /v1/audio/transcriptions and /v1/audio/translations answer and
`run --audio --output-format` prints.

text: the transcript. json: {"text", "usage"}. verbose_json: {"task", "language" (the
language's English name in lower case, as OpenAI writes it; "english" for a translation),
"duration" (seconds), "text", "segments"}, each segment as OpenAI's (id, seek, start, end,
text, tokens, temperature, avg_logprob, compression_ratio, no_speech_prob); a family that
predicts no times (Transcription.segments None) answers it without "segments", which
OpenAI's schema leaves optional; with word timestamps, "words" too, each {"word" (without its
leading space, as OpenAI writes it), "start", "end"}. srt and vtt: a cue per segment with text, its times as
openai-whisper's writers format them (hh:mm:ss,mmm and hh:mm:ss.mmm, the hours always there,
milliseconds rounded), the text stripped, its blank lines dropped and "-->" written "->".

Reference: OpenAI's API reference (audio/createTranscription, the transcription objects);
openai-whisper's whisper/utils.py (format_timestamp, WriteSRT, WriteVTT).
"""

from __future__ import annotations

from typing import Any

from llmrun.whisper import Segment, Transcription
from llmrun.whisper_languages import LANGUAGES
from llmrun.whisper_words import Word

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
TIMED = ("srt", "verbose_json", "vtt")  # the formats with segments' times
SUBTITLES = ("srt", "vtt")  # made of timed segments alone
MEDIA_TYPES = {"srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8"}


def json_body(result: Transcription) -> dict[str, Any]:
    """The json format: the text and the tokens it took."""
    usage = {
        "type": "tokens",
        "input_tokens": result.prompt_tokens,
        "output_tokens": len(result.ids),
        "total_tokens": result.prompt_tokens + len(result.ids),
    }
    return {"text": result.text, "usage": usage}


def verbose_json(
    text: str,
    language: str | None,
    task: str,
    duration: float,
    segments: tuple[Segment, ...] | None = None,
    words: tuple[Word, ...] | None = None,
) -> dict[str, Any]:
    """The verbose_json format of a transcription (`task` "transcribe") or translation
    ("translate") of a clip of `duration` seconds in `language` (a code; None: unknown),
    with its `segments` and `words` where given."""
    language = "en" if task == "translate" else language
    body: dict[str, Any] = {
        "task": task,
        "language": LANGUAGES.get(language, language) if language else None,
        "duration": duration,
        "text": text,
    }
    if segments is not None:
        body["segments"] = [_segment(s) for s in segments]
    if words is not None:
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end} for w in words]
    return body


def _segment(segment: Segment) -> dict[str, Any]:
    return {
        "id": segment.id,
        "seek": segment.seek,
        # to the millisecond: a time step's 0.02 s multiples print as 1.4, not 1.4000000000000001
        "start": round(segment.start, 3),
        "end": round(segment.end, 3),
        "text": segment.text,
        "tokens": segment.tokens,
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }


def timestamp(seconds: float, marker: str) -> str:
    """`seconds` as hh:mm:ss,mmm (`marker` ",") or hh:mm:ss.mmm (".")."""
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    whole, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{marker}{milliseconds:03d}"


def _cues(segments: tuple[Segment, ...], marker: str) -> list[tuple[str, str]]:
    """The segments with text, as (times, text) in the subtitle's spelling."""
    cues = []
    for segment in segments:
        lines = [line.strip() for line in segment.text.strip().splitlines()]
        text = "\n".join(line for line in lines if line).replace("-->", "->")
        if text:
            times = f"{timestamp(segment.start, marker)} --> {timestamp(segment.end, marker)}"
            cues.append((times, text))
    return cues


def subtitles(response_format: str, segments: tuple[Segment, ...]) -> str:
    """The srt or vtt format of the segments."""
    return srt(segments) if response_format == "srt" else vtt(segments)


def srt(segments: tuple[Segment, ...]) -> str:
    """SubRip subtitles: numbered cues, each ending with a blank line."""
    return "".join(
        f"{number}\n{times}\n{text}\n\n"
        for number, (times, text) in enumerate(_cues(segments, ","), start=1)
    )


def vtt(segments: tuple[Segment, ...]) -> str:
    """WebVTT subtitles: the WEBVTT header, then the cues, each ending with a blank line."""
    return "WEBVTT\n\n" + "".join(f"{times}\n{text}\n\n" for times, text in _cues(segments, "."))

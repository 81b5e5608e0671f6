"""llmrun.transcript_formats: srt and vtt as openai-whisper's writers spell them (hours
always, milliseconds rounded, text stripped, "-->" written "->", segments without text
left out) on made-up segments; verbose_json's language is the language's name ("english"
for a translation, null where unknown) and it has no segments where the family predicts no
times. (tests/models/test_whisper.py and tests/server/test_serve_whisper.py check the
bodies of a real transcription against transformers.)"""

from llmrun import transcript_formats
from llmrun.whisper import Segment


def segment(start: float, end: float, text: str) -> Segment:
    return Segment(0, 0, start, end, text, [], 0.0, -0.5, 1.2, 0.01)


SEGMENTS = (
    segment(0.0, 1.4000000000000001, " Hello there."),
    segment(1.4, 2.0, "   "),
    segment(3599.9995, 3723.456, " a --> b\n\n second line "),
)


def test_srt_and_vtt_spell_the_cues_as_openai_whisper():
    assert transcript_formats.srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:01,400\nHello there.\n\n"
        "2\n01:00:00,000 --> 01:02:03,456\na -> b\nsecond line\n\n"
    )
    assert transcript_formats.vtt(SEGMENTS) == (
        "WEBVTT\n\n"
        "00:00:00.000 --> 00:00:01.400\nHello there.\n\n"
        "01:00:00.000 --> 01:02:03.456\na -> b\nsecond line\n\n"
    )
    assert transcript_formats.vtt(()) == "WEBVTT\n\n"


def test_verbose_json_names_the_language_and_holds_segments_only_where_timed():
    body = transcript_formats.verbose_json("hallo", "de", "transcribe", 2.5, SEGMENTS[:1])
    assert body == {
        "task": "transcribe",
        "language": "german",
        "duration": 2.5,
        "text": "hallo",
        "segments": [
            {
                "id": 0,
                "seek": 0,
                "start": 0.0,
                "end": 1.4,  # 1.4000000000000001 to the millisecond
                "text": " Hello there.",
                "tokens": [],
                "temperature": 0.0,
                "avg_logprob": -0.5,
                "compression_ratio": 1.2,
                "no_speech_prob": 0.01,
            }
        ],
    }
    translated = transcript_formats.verbose_json("hello", "de", "translate", 2.5)
    assert translated == {
        "task": "translate",
        "language": "english",
        "duration": 2.5,
        "text": "hello",
    }
    assert transcript_formats.verbose_json("x", None, "transcribe", 1.0)["language"] is None

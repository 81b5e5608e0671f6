"""serve with a tiny random Whisper (tests/whisper_helpers.py): /v1/audio/transcriptions
answers transformers' WhisperForConditionalGeneration.generate text (greedy) for the
uploaded WAV, with the language detected or given and OpenAI's `prompt` as Whisper's
prompt_ids, as json (with usage) and as text; /v1/audio/translations answers generate's
task="translate". Chat completions (OpenAI's and ollama's) on a Whisper model, a temperature
above 0, a language on a translation and a translation by a model that is not Whisper are one
clear 400 each.
verbose_json, srt and vtt (both endpoints, through OpenAI's Python client: verbose_json parsed
as its TranscriptionVerbose and TranslationVerbose) hold generate(return_timestamps=True,
return_segments=True)'s segments: times, texts and tokens, the subtitles' cues in their
format and media type; timestamp_granularities[] segment is taken, word and a granularity
without verbose_json are one 400 each.

Tolerances: text, times and tokens exact (subtitles: to the millisecond).
"""

import pytest
from serving import served
from voxtral_helpers import chirp, wav_bytes
from whisper_helpers import reference_segments, subtitle_cues, tiny_whisper_dir

from llmrun import api, whisper_languages

transformers = pytest.importorskip("transformers")
SAMPLES = chirp(2.0, 16000, seed=3)
CLIP = wav_bytes(SAMPLES, 16000)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    return path, tiny_whisper_dir(path, seed=1)


@pytest.fixture(scope="module")
def client(folder):
    yield from served(api.load(str(folder[0]), device="cpu", generate=False), "whisper")


def features(path):
    """CLIP's features as transformers computes them from the samples serve decodes (16-bit
    WAV)."""
    samples = (SAMPLES * 32767).round() / 32768
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    return extractor(samples, sampling_rate=16000, return_tensors="pt").input_features


def expected_text(folder, **kwargs) -> str:
    """transformers' greedy transcript of CLIP as serve decodes it."""
    path, hf = folder
    features_ = features(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if "prompt" in kwargs:
        kwargs["prompt_ids"] = tokenizer.get_prompt_ids(kwargs.pop("prompt"), return_tensors="pt")
    return tokenizer.batch_decode(hf.generate(features_, **kwargs), skip_special_tokens=True)[0]


def post(client, endpoint: str = "transcriptions", **fields):
    files = {"file": ("clip.wav", CLIP, "audio/wav")}
    return client.post(f"/v1/audio/{endpoint}", data={"model": "whisper", **fields}, files=files)


@pytest.mark.parametrize(
    "fields", [{}, {"language": "de", "prompt": "the quick fox"}], ids=["detected", "prompted"]
)
def test_a_transcription_is_transformers_generate(client, folder, fields):
    response = post(client, **fields)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["text"] == expected_text(folder, **fields)
    assert answer["usage"]["output_tokens"] > 0
    plain = post(client, response_format="text", **fields)
    assert plain.headers["content-type"].startswith("text/plain")
    assert plain.text == answer["text"]


def test_a_translation_is_transformers_generate_s_translate(client, folder):
    response = post(client, "translations")
    assert response.status_code == 200, response.text
    assert response.json()["text"] == expected_text(folder, task="translate")


def test_chat_and_bad_requests_are_one_400(client):
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "whisper", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400
    assert chat.json()["error"]["message"] == (
        "whisper is a speech recognition model (Whisper); use /v1/audio/transcriptions"
    )
    ollama = client.post(
        "/api/chat", json={"model": "whisper", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert ollama.status_code == 400
    assert "a speech recognition model (Whisper)" in ollama.json()["error"]
    hot = post(client, temperature="0.5")
    assert hot.status_code == 400
    assert hot.json()["error"]["message"].startswith("temperature: llmrun decodes Whisper greedily")
    language = post(client, "translations", language="de")
    assert language.status_code == 400
    assert language.json()["error"]["message"] == "language: a translation is into English"


def test_a_translation_by_a_model_that_is_not_whisper_is_a_400():
    for http in served(api.load(None, device="cpu"), "stories"):
        response = http.post(
            "/v1/audio/translations",
            data={"model": "stories"},
            files={"file": ("clip.wav", CLIP, "audio/wav")},
        )
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("stories does not translate speech")


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the client's translations
@pytest.mark.parametrize("task", ["transcribe", "translate"])
def test_verbose_json_srt_and_vtt_hold_transformers_segments(client, folder, task):
    openai = pytest.importorskip("openai")
    path, hf = folder
    # generate's default task (none given) transcribes
    options = {"task": task} if task == "translate" else {}
    clip_features = features(path)
    expected = reference_segments(hf, path, clip_features, **options)
    sdk = openai.OpenAI(
        base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0
    )
    endpoint = sdk.audio.translations if task == "translate" else sdk.audio.transcriptions
    extra = {} if task == "translate" else {"timestamp_granularities": ["segment"]}
    verbose = endpoint.create(
        model="whisper", file=("clip.wav", CLIP), response_format="verbose_json", **extra
    )
    kind = openai.types.audio.TranslationVerbose
    if task == "transcribe":
        kind = openai.types.audio.TranscriptionVerbose
    assert isinstance(verbose, kind)
    assert verbose.model_extra["task"] == task
    assert verbose.duration == 2.0
    if task == "translate":
        assert verbose.language == "english"
    else:  # the detected language's name
        code = hf.detect_language(clip_features)[0].item()
        assert (
            verbose.language
            == whisper_languages.LANGUAGES[
                transformers.AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(code)[2:-2]
            ]
        )
    assert len(verbose.segments) >= 2
    assert [(s.id, s.start, s.end, s.text, s.tokens) for s in verbose.segments] == [
        (i, round(e["start"], 3), round(e["end"], 3), e["text"], e["tokens"])
        for i, e in enumerate(expected)
    ]
    cues = [(round(e["start"] * 1000), round(e["end"] * 1000), e["text"].strip()) for e in expected]
    # srt from one endpoint, vtt from the other
    response_format, marker, media = ("srt", ",", "application/x-subrip")
    if task == "translate":
        response_format, marker, media = ("vtt", ".", "text/vtt")
    raw = endpoint.with_raw_response.create(
        model="whisper", file=("clip.wav", CLIP), response_format=response_format
    )
    assert raw.headers["content-type"] == f"{media}; charset=utf-8"
    assert subtitle_cues(raw.parse(), marker) == [c for c in cues if c[2]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"response_format": "verbose_json", "timestamp_granularities[]": ["segment", "word"]},
            "timestamp_granularities[] word: llmrun times segments, not words",
        ),
        (
            {"timestamp_granularities[]": "segment"},
            "timestamp_granularities[] goes with response_format verbose_json",
        ),
        (
            {"response_format": "tsv"},
            "response_format 'tsv': llmrun answers json, text, srt, verbose_json, vtt",
        ),
    ],
    ids=["word", "not-verbose", "format"],
)
def test_what_serve_does_not_time_is_one_400(client, fields, message):
    response = post(client, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)

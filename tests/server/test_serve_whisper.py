"""serve with a tiny random Whisper (tests/whisper_helpers.py): /v1/audio/transcriptions
answers transformers' WhisperForConditionalGeneration.generate text (greedy) for the
uploaded WAV, with the language detected or given and OpenAI's `prompt` as Whisper's
prompt_ids, as json (with usage) and as text; /v1/audio/translations answers generate's
task="translate". Chat completions (OpenAI's and ollama's) on a Whisper model, a language on a
translation and a translation by a model that is not Whisper are one clear 400 each; a
temperature starts the temperature fallback (the random model fails every try: the last
temperature's result is kept).
verbose_json, srt and vtt (both endpoints, through OpenAI's Python client: verbose_json parsed
as its TranscriptionVerbose and TranslationVerbose) hold generate(return_timestamps=True,
return_segments=True)'s segments: times, texts and tokens, the subtitles' cues in their
format and media type; timestamp_granularities[] segment is taken, a granularity without
verbose_json is a 400, and so is word for a folder without alignment_heads. With them (a copy
of the folder), word gives verbose_json's words (parsed as the client's TranscriptionWord):
the library's words (tests/test_whisper_words.py checks them against transformers), without
their leading spaces, and no segments unless segment is asked for too. num_beams gives
generate(num_beams=...)'s transcript and translation; a bad count is a 400.

Tolerances: text, times and tokens exact (subtitles: to the millisecond).
"""

import json
import shutil

import pytest
from serving import served
from voxtral_helpers import chirp, wav_bytes
from whisper_helpers import reference_segments, subtitle_cues, tiny_whisper_dir

from llmrun import api, audio, whisper_languages

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
    language = post(client, "translations", language="de")
    assert language.status_code == 400
    assert language.json()["error"]["message"] == "language: a translation is into English"


def test_a_temperature_starts_the_fallback(client):
    response = post(client, temperature="0.8", response_format="verbose_json")
    assert response.status_code == 200, response.text
    assert {s["temperature"] for s in response.json()["segments"]} == {1.0}


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
            "word timestamps: this Whisper model's generation_config.json has no alignment_heads",
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


def test_word_timestamps_are_verbose_json_s_words(folder, tmp_path):
    openai = pytest.importorskip("openai")
    path, _ = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((path / "generation_config.json").read_text())
    config["alignment_heads"] = [[0, 1], [1, 0]]
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    engine = api.load(str(tmp_path), device="cpu", generate=False)
    clip = audio.open_audio(CLIP, "file")
    expected = engine.transcribe(clip, None, None, None, True, words=True)
    answers = {}
    for http in served(engine, "whisper"):
        sdk = openai.OpenAI(
            base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0
        )
        for granularities in (("word",), ("word", "segment")):
            answers[granularities] = sdk.audio.transcriptions.create(
                model="whisper",
                file=("clip.wav", CLIP),
                response_format="verbose_json",
                timestamp_granularities=list(granularities),
            )
    for granularities, verbose in answers.items():
        assert [(w.word, w.start, w.end) for w in verbose.words] == [
            (w.word.strip(), w.start, w.end) for w in expected.words
        ]
        assert (verbose.segments is not None) == ("segment" in granularities)
    assert len(expected.words) >= 2


def test_num_beams_is_transformers_beam_search(client, folder):
    """num_beams: generate(num_beams=...)'s transcript (2 and 3 beams: three different texts
    with the greedy one) and translation; a count that is no whole number, or over 32, is
    a 400."""
    texts = [expected_text(folder, prompt="a cat")]
    for beams in (2, 3):
        response = post(client, prompt="a cat", num_beams=str(beams))
        assert response.status_code == 200, response.text
        texts.append(response.json()["text"])
        assert texts[-1] == expected_text(folder, prompt="a cat", num_beams=beams)
    assert len(set(texts)) == 3
    translated = post(client, "translations", num_beams="3")
    assert translated.json()["text"] == expected_text(folder, task="translate", num_beams=3)
    for value, message in (
        ("two", "num_beams 'two': give a whole number of beams"),
        ("40", "num_beams: the number of beams must be between 1 and 32, got 40"),
    ):
        refused = post(client, num_beams=value)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == message

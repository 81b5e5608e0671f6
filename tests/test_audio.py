"""Decoding WAV files against scipy.io.wavfile (PCM 8/16/24/32-bit, float, several
channels averaged), resampling to 16 kHz against scipy.signal.resample_poly, the log-mel
spectrogram against transformers' WhisperFeatureExtractor (numpy), and what a bad file
gives: one clear error line."""

import io
import struct

import numpy as np
import pytest
from in_process import llmrun
from voxtral_helpers import chirp, wav_bytes

from llmrun import audio
from llmrun.errors import UsageError

scipy_io = pytest.importorskip("scipy.io.wavfile")
signal = pytest.importorskip("scipy.signal")


def scipy_read(data: bytes) -> tuple[np.ndarray, int]:
    """scipy's samples of a WAV file's bytes, scaled to [-1, 1) and averaged to mono."""
    rate, samples = scipy_io.read(io.BytesIO(data))
    if samples.dtype == np.uint8:
        scaled = (samples.astype(np.float64) - 128) / 128
    elif samples.dtype.kind == "i":
        # scipy reads 24-bit samples into the top bytes of int32
        bits = 32 if samples.dtype == np.int32 else 8 * samples.dtype.itemsize
        scaled = samples.astype(np.float64) / 2.0 ** (bits - 1)
    else:
        scaled = samples.astype(np.float64)
    return (scaled.mean(axis=1) if scaled.ndim == 2 else scaled), rate


def float_wav(samples: np.ndarray, rate: int) -> bytes:
    """A WAV file of 32-bit float samples [frames, channels] (format 3), by hand: Python's
    wave module writes PCM only."""
    data = samples.astype("<f4").tobytes()
    channels = samples.shape[1]
    fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * 4 * channels, 4 * channels, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_pcm_decodes_as_scipy_reads_it(width, channels):
    samples = np.stack([chirp(0.25, 8000, seed=c) for c in range(channels)], axis=1)
    data = wav_bytes(samples, 8000, width)
    ours, rate = audio.decode_wav(data)
    expected, expected_rate = scipy_read(data)
    assert rate == expected_rate == 8000
    np.testing.assert_array_equal(ours, expected)


def test_float_wav_decodes_as_scipy_reads_it():
    samples = np.stack([chirp(0.25, 16000, seed=3), chirp(0.25, 16000, seed=4)], axis=1)
    data = float_wav(samples, 16000)
    ours, _ = audio.decode_wav(data)
    np.testing.assert_array_equal(ours, scipy_read(data)[0])


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 44100, 48000])
def test_resampling_matches_scipy_resample_poly(rate):
    x = chirp(0.7, rate, seed=5)
    expected = signal.resample_poly(x, 16000, rate)
    ours = audio.resample(x, rate)
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=1e-12, rtol=0)


def test_open_audio_gives_16khz_mono_float32(tmp_path):
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(np.stack([chirp(0.5, 44100, 1), chirp(0.5, 44100, 2)], 1), 44100))
    clip = audio.open_audio(path)
    assert clip.samples.dtype == np.float32 and clip.samples.shape == (8000,)
    assert clip.name == str(path)


@pytest.mark.parametrize("rate", [16000, 24000, 48000])
def test_a_clip_at_another_rate_is_resampled_from_the_file_not_from_16khz(rate):
    """Muse Spark's 24 kHz encoder gets a 24 kHz file's samples as they are, and a 48 kHz
    file's resampled once (as scipy's resample_poly), never through 16 kHz."""
    x = chirp(0.5, rate, seed=3)
    clip = audio.open_audio(float_wav(x[:, None], rate))
    expected = (
        x.astype(np.float32).astype(np.float64)
        if rate == 24000
        else signal.resample_poly(x.astype(np.float32).astype(np.float64), 24000, rate)
    )
    np.testing.assert_allclose(clip.at(24000), expected, atol=1e-6, rtol=0)
    assert clip.length_at(24000) == len(clip.at(24000)) == len(expected)
    assert clip.at(16000) is clip.samples


@pytest.mark.parametrize("seconds", [0.3, 30.0, 41.5])
def test_log_mel_matches_whisper_feature_extractor(seconds):
    """128 mel bins (Voxtral's), 80 (Whisper's); the clip padded to whole 30-s chunks."""
    transformers = pytest.importorskip("transformers")
    samples = chirp(seconds, 16000, seed=6).astype(np.float32)
    chunks = -(-len(samples) // 480000)
    padded = np.zeros(chunks * 480000, dtype=np.float32)
    padded[: len(samples)] = samples
    for bins in (128, 80):
        extractor = transformers.WhisperFeatureExtractor(feature_size=bins)
        expected = extractor._np_extract_fbank_features(padded[None], "cpu")[0]
        ours = audio.chunked_features(audio.Clip(samples, "x"), bins)
        assert ours.shape == (chunks, bins, 3000)
        np.testing.assert_allclose(
            ours.transpose(1, 0, 2).reshape(bins, -1), expected, atol=1e-5, rtol=0
        )


def test_mel_filters_match_transformers():
    transformers = pytest.importorskip("transformers")
    expected = transformers.WhisperFeatureExtractor(feature_size=128).mel_filters
    np.testing.assert_allclose(audio.mel_filters(128), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"ID3\x04" + bytes(100), "MP3 audio; llmrun reads WAV"),
        (b"fLaC" + bytes(100), "FLAC audio; llmrun reads WAV"),
        (b"OggS" + bytes(100), "Ogg audio; llmrun reads WAV"),
        (b"hello there, not audio", "not a WAV file; llmrun reads WAV"),
        (b"RIFF\x04\x00\x00\x00WAVE", "without a valid fmt chunk"),
    ],
)
def test_other_formats_are_refused_by_name(data, message):
    with pytest.raises(UsageError, match=message):
        audio.decode_wav(data)


def test_bad_headers_are_refused():
    good = wav_bytes(chirp(0.1, 8000), 8000)
    no_data = good[: good.index(b"data")]
    with pytest.raises(UsageError, match="without a data chunk"):
        audio.decode_wav(no_data)
    at = good.index(b"fmt ") + 8
    mulaw = good[:at] + struct.pack("<H", 7) + good[at + 2 :]
    with pytest.raises(UsageError, match="format 0x7 with 16-bit samples"):
        audio.decode_wav(mulaw)
    channels = good[: at + 2] + struct.pack("<H", 3) + good[at + 4 :]
    with pytest.raises(UsageError, match="3 channels, 2-byte frames"):
        audio.decode_wav(channels)
    empty = good[: good.index(b"data") + 8]
    with pytest.raises(UsageError, match="no audio samples"):
        audio.decode_wav(empty)
    nan = float_wav(np.full((10, 1), np.nan), 16000)
    with pytest.raises(UsageError, match="not finite"):
        audio.decode_wav(nan)


def test_the_duration_is_checked_before_decoding(monkeypatch):
    monkeypatch.setattr(audio, "MAX_SECONDS", 1)
    with pytest.raises(
        UsageError, match=r"1\.5 seconds of audio, more than llmrun takes \(1 seconds\)"
    ):
        audio.decode_wav(wav_bytes(chirp(1.5, 8000), 8000))


def test_a_file_that_is_not_wav_is_one_error_line(tmp_path):
    song = tmp_path / "song.mp3"
    song.write_bytes(b"ID3\x04" + bytes(200))
    result = llmrun("run", "--audio", str(song), "hello")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {song}: MP3 audio; llmrun reads WAV (PCM 8/16/24/32-bit integer or 32/64-bit "
        "float) (convert it first, e.g. `ffmpeg -i IN -ar 16000 OUT.wav`)"
    ]
    missing = llmrun("run", "--audio", str(tmp_path / "none.wav"), "hello")
    assert missing.returncode == 2
    assert "cannot read the audio (No such file or directory)" in missing.stderr
    batch = llmrun("run", "--audio", "a.wav", "--batch", "requests.jsonl")
    assert batch.returncode == 2
    assert batch.stderr.startswith("error: --audio does not go with --batch")

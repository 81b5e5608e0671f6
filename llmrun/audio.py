"""Audio in: decode a WAV file or bytes (PCM 8/16/24/32-bit ints, 32/64-bit floats; the
channels averaged to mono), resample it to 16 kHz as scipy's resample_poly does, and turn
it into the log-mel spectrogram an audio encoder takes, as transformers'
WhisperFeatureExtractor computes it (numpy, float64 inside). No library beyond numpy:
other containers (MP3, FLAC, Ogg, ...) are refused by name.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmrun.errors import UsageError

SAMPLE_RATE = 16000  # what Whisper encoders take
MAX_FILE_BYTES = 512 * 2**20
MAX_SECONDS = 40 * 60  # Voxtral's longest audio for understanding
MAX_CHANNELS = 32
TAKEN = "WAV (PCM 8/16/24/32-bit integer or 32/64-bit float)"
# Whisper's short-time Fourier transform: 25 ms windows every 10 ms at 16 kHz.
N_FFT, HOP_LENGTH = 400, 160
# Magic bytes of the containers people try instead, to name them in the error.
_OTHER_FORMATS = (
    (b"ID3", "MP3"),
    (b"\xff\xfb", "MP3"),
    (b"\xff\xf3", "MP3"),
    (b"\xff\xf2", "MP3"),
    (b"fLaC", "FLAC"),
    (b"OggS", "Ogg"),
    (b"FORM", "AIFF"),
    (b"\x1aE\xdf\xa3", "WebM/Matroska"),
)
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


@dataclass(frozen=True)
class Clip:
    """Decoded audio: mono float32 samples in [-1, 1] at SAMPLE_RATE; where the file had
    another rate, also its samples at that rate (`decoded`, `rate`), so an encoder of
    another rate (Muse Spark's 24 kHz) resamples from them and not from 16 kHz."""

    samples: np.ndarray
    name: str
    decoded: np.ndarray | None = None
    rate: int = SAMPLE_RATE

    def at(self, rate: int) -> np.ndarray:
        """The samples at `rate` Hz, resampled once from the file's own."""
        if rate == SAMPLE_RATE:
            return self.samples
        if self.decoded is not None and rate == self.rate:
            return self.decoded
        source = self.samples if self.decoded is None else self.decoded
        return resample(
            source, self.rate if self.decoded is not None else SAMPLE_RATE, rate
        ).astype(np.float32)

    def length_at(self, rate: int) -> int:
        """How many samples `at(rate)` holds (resample's length)."""
        source, from_rate = (
            (self.samples, SAMPLE_RATE) if self.decoded is None else (self.decoded, self.rate)
        )
        g = math.gcd(from_rate, rate)
        return -(-len(source) * (rate // g) // (from_rate // g))


def open_audio(source: str | Path | bytes, name: str | None = None) -> Clip:
    """A file path's or encoded bytes' audio, decoded, mixed to mono and resampled to
    16 kHz; `name` says what the audio is in errors. Anything unreadable is one UsageError."""
    if isinstance(source, bytes):
        data, name = source, name or "the audio"
    else:
        path = Path(source)
        name = name or str(path)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise UsageError(f"{name}: an audio file over {MAX_FILE_BYTES >> 20} MiB")
            data = path.read_bytes()
        except OSError as e:
            raise UsageError(f"{name}: cannot read the audio ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{name}: audio over {MAX_FILE_BYTES >> 20} MiB")
    samples, rate = decode_wav(data, name)
    at_16k = resample(samples, rate, SAMPLE_RATE).astype(np.float32)
    if rate == SAMPLE_RATE:
        return Clip(at_16k, name)
    return Clip(at_16k, name, samples.astype(np.float32), rate)


def decode_wav(data: bytes, name: str = "the audio") -> tuple[np.ndarray, int]:
    """The mono float64 samples of a WAV file's bytes and its sample rate; the header's
    sizes are checked (and the duration against MAX_SECONDS) before the samples decode."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        other = next((kind for magic, kind in _OTHER_FORMATS if data.startswith(magic)), None)
        what = f"{other} audio" if other else "not a WAV file"
        raise UsageError(
            f"{name}: {what}; llmrun reads {TAKEN} (convert it first, e.g. "
            "`ffmpeg -i IN -ar 16000 OUT.wav`)"
        )
    fmt, body = None, None
    at = 12
    while at + 8 <= len(data):
        kind, size = data[at : at + 4], struct.unpack_from("<I", data, at + 4)[0]
        start, end = at + 8, at + 8 + size
        if kind == b"fmt ":
            fmt = data[start:end]
        elif kind == b"data":
            body = data[start : min(end, len(data))]  # streamed files leave the size open
            break
        at = end + (size & 1)  # chunks are padded to even sizes
    if fmt is None or len(fmt) < 16:
        raise UsageError(f"{name}: a WAV file without a valid fmt chunk")
    if body is None:
        raise UsageError(f"{name}: a WAV file without a data chunk")
    tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # the subformat GUID's first two bytes
    width = bits // 8
    if tag == _PCM and bits in (8, 16, 24, 32):
        kind = "int"
    elif tag == _FLOAT and bits in (32, 64):
        kind = "float"
    else:
        raise UsageError(
            f"{name}: WAV of format {tag:#x} with {bits}-bit samples; llmrun reads {TAKEN}"
        )
    if not 1 <= channels <= MAX_CHANNELS or align != channels * width:
        raise UsageError(f"{name}: a WAV header of {channels} channels, {align}-byte frames")
    if not 1000 <= rate <= 384000:
        raise UsageError(f"{name}: a sample rate of {rate} Hz (llmrun takes 1 kHz to 384 kHz)")
    frames = len(body) // align
    if frames == 0:
        raise UsageError(f"{name}: no audio samples")
    if frames / rate > MAX_SECONDS:
        raise UsageError(
            f"{name}: {frames / rate:.1f} seconds of audio, more than llmrun takes "
            f"({MAX_SECONDS} seconds)"
        )
    raw = np.frombuffer(body, dtype=np.uint8, count=frames * align)
    samples = _samples(raw, kind, width).reshape(frames, channels)
    if kind == "float" and not np.isfinite(samples).all():
        raise UsageError(f"{name}: float samples that are not finite")
    return samples.mean(axis=1), rate


def _samples(raw: np.ndarray, kind: str, width: int) -> np.ndarray:
    """float64 samples of little-endian bytes, integers scaled to [-1, 1)."""
    if kind == "float":
        return raw.view(f"<f{width}").astype(np.float64)
    if width == 1:  # 8-bit WAV is unsigned
        return (raw.astype(np.float64) - 128) / 128
    if width == 3:
        # [n, 3] bytes -> the top three bytes of an int32, so the sign comes along.
        wide = np.zeros((raw.size // 3, 4), dtype=np.uint8)
        wide[:, 1:] = raw.reshape(-1, 3)
        return wide.view("<i4")[:, 0].astype(np.float64) / 2.0**31
    return raw.view(f"<i{width}").astype(np.float64) / 2.0 ** (8 * width - 1)


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """`samples` at `rate` Hz resampled to `target` Hz as scipy.signal.resample_poly does
    by default: a polyphase FIR of 20 * max(up, down) + 1 taps (Kaiser window, beta 5,
    cut off at the lower Nyquist rate), the signal zero-padded at both ends."""
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    if up == down:
        return samples.astype(np.float64)
    n_in = len(samples)
    n_out = -(-n_in * up // down)
    half = 10 * max(up, down)
    m = np.arange(2 * half + 1) - half
    cutoff = 1.0 / max(up, down)
    h = cutoff * np.sinc(cutoff * m) * np.kaiser(2 * half + 1, 5.0)
    h = h / h.sum() * up
    pre_pad = down - half % down
    pre_remove = (half + pre_pad) // down
    taps = np.concatenate([np.zeros(pre_pad), h])
    # y[i] = sum_n x[n] * taps[i * down - n * up]: each output's taps, one phase each.
    per_phase = -(-len(taps) // up)
    phases = np.zeros(per_phase * up)
    phases[: len(taps)] = taps
    phases = phases.reshape(per_phase, up).T  # [phase, k] = taps[phase + k * up]
    x = np.concatenate([np.zeros(per_phase), samples.astype(np.float64)])
    out = np.empty(n_out)
    block = max(1, 2**22 // per_phase)
    for first in range(0, n_out, block):
        position = (np.arange(first, min(first + block, n_out)) + pre_remove) * down
        newest = position // up  # the last input sample each output reaches
        k = np.arange(per_phase)
        index = newest[:, None] - k[None, :] + per_phase  # into the zero-led x
        gathered = np.where(index < len(x), x[np.minimum(index, len(x) - 1)], 0.0)
        out[first : first + len(position)] = (gathered * phases[position % up]).sum(axis=1)
    return out


def mel_filters(mel_bins: int, rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Whisper's mel filter bank [n_fft // 2 + 1, mel_bins]: triangles on the Slaney mel
    scale from 0 to 8 kHz, each scaled to unit area (Slaney's norm), as transformers'
    mel_filter_bank(norm="slaney", mel_scale="slaney") builds it."""
    fft_freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    mels = np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), mel_bins + 2)
    edges = _mel_to_hz(mels)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (edges[2 : mel_bins + 2] - edges[:mel_bins]))[None, :]


def _hz_to_mel(hz: float | np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    linear = 3.0 * hz / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1000.0) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hz >= 1000.0, log, linear)


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    linear = 200.0 * mels / 3.0
    log = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels - 15.0))
    return np.where(mels >= 15.0, log, linear)


def log_mel(samples: np.ndarray, mel_bins: int, log_max: float | None = None) -> np.ndarray:
    """The log-mel spectrogram [mel_bins, len(samples) // HOP_LENGTH] of 16 kHz samples, as
    WhisperFeatureExtractor computes it: centered Hann windows (reflect-padded), power
    spectra through mel_filters, log10 floored at 1e-10, values under the maximum - 8
    raised to it, then (x + 4) / 4; float32. `log_max`: a fixed maximum instead of the
    spectrogram's own (Voxtral Realtime's global_log_mel_max)."""
    x = np.pad(samples.astype(np.float32).astype(np.float64), N_FFT // 2, mode="reflect")
    frames = 1 + (len(x) - N_FFT) // HOP_LENGTH
    window = np.hanning(N_FFT + 1)[:-1]  # periodic
    bank = mel_filters(mel_bins).T
    out = np.empty((mel_bins, frames))
    block = 4096
    for first in range(0, frames, block):
        count = min(block, frames - first)
        view = np.lib.stride_tricks.as_strided(
            x[first * HOP_LENGTH :], (count, N_FFT), (x.strides[0] * HOP_LENGTH, x.strides[0])
        )
        power = np.abs(np.fft.rfft(view * window, axis=1)) ** 2
        out[:, first : first + count] = np.log10(np.maximum(1e-10, bank @ power.T))
    out = out[:, :-1]
    out = np.maximum(out, (out.max() if log_max is None else log_max) - 8.0)
    return ((out + 4.0) / 4.0).astype(np.float32)


def chunked_features(clip: Clip, mel_bins: int, chunk_seconds: int = 30) -> np.ndarray:
    """A clip's log-mel features in chunks [n, mel_bins, chunk frames], as VoxtralProcessor
    makes them: the audio zero-padded to a whole number of chunks, its spectrogram taken
    whole (one maximum over all of it), then cut into chunks."""
    chunk = chunk_seconds * SAMPLE_RATE
    padded = np.zeros(-(-len(clip.samples) // chunk) * chunk, dtype=np.float32)
    padded[: len(clip.samples)] = clip.samples
    features = log_mel(padded, mel_bins)
    per_chunk = chunk // HOP_LENGTH
    return features.reshape(mel_bins, -1, per_chunk).transpose(1, 0, 2)

"""OmniASR's CTC recognizers against transformers: a tiny random OmniASRForCTC (OmniASR's
encoder of the raw samples and a CTC head) saved with a tokenizer laid out as
OmniASRConverter writes one, and OmniASRCTCProcessor make the reference for a 1.3-second
clip. The logits, generate's ids and the processor's decode(skip_special_tokens=True) of
them (repeats collapsed, the pad dropped) match; `run --audio` prints that text, serve's
/v1/audio/transcriptions answers it, and `show` names the folder a speech recognizer.
Unnormalized samples fail; a language is refused.

Tolerances: logits within 1e-4; ids and text exact.
"""

import pytest
import torch
from in_process import llmrun
from omniasr_helpers import ctc_processor, save_fuse_tokenizer, tiny_omniasr_ctc
from serving import served
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, omniasr_clips

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return tiny_omniasr_ctc()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("omniasr_ctc")
    model.save_pretrained(path)
    return save_fuse_tokenizer(path)


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("wavs") / "clip.wav"
    path.write_bytes(wav_bytes(chirp(1.3, 16000, seed=3), 16000))
    return path


def test_logits_ids_and_text_are_transformers(model, folder, wav, monkeypatch):
    clip = audio.open_audio(wav)
    made = ctc_processor(folder)
    inputs = made(clip.samples, sampling_rate=16000)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        ids = model.generate(**inputs)[0]
    text = made.decode(ids, skip_special_tokens=True)
    engine = api.load(str(folder), device="cpu", transcribe=True)
    samples = omniasr_clips.normalized(torch.tensor(clip.samples))
    with torch.no_grad():
        logits = engine.model.logits(samples)
        raw = engine.model.logits(torch.tensor(clip.samples))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (raw - expected).abs().max() > 1e-2
    transcript = engine.transcribe(clip)
    assert 3 in ids.tolist() and len(transcript.ids) < len(ids)  # pads and repeats dropped
    assert transcript.text == text and text
    result = llmrun("run", folder, "--audio", wav)
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    refused = llmrun("run", folder, "--audio", wav, "--language", "en")
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: OmniASR CTC takes no language (it transcribes the language it hears)"
    )
    client = served(engine, "omniasr-ctc")
    http = next(client)
    files = {"file": ("clip.wav", wav.read_bytes(), "audio/wav")}
    response = http.post("/v1/audio/transcriptions", data={"model": "omniasr-ctc"}, files=files)
    client.close()
    assert response.status_code == 200, response.text
    assert response.json()["text"] == text
    shown = llmrun("show", folder)
    assert "architecture   omniasr_ctc (speech recognition: 2 encoder layers" in shown.stdout
    assert f"({sum(p.numel() for p in model.parameters()):,})\n" in shown.stdout  # all it runs

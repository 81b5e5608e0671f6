"""Moonshine Streaming (llmrun.models.moonshine_streaming, llmrun.moonshine_streaming)
against transformers 5.25 on a tiny random MoonshineStreamingForConditionalGeneration
(tests/moonshine_streaming_helpers.py; a clip that ends in a part frame, which the
encoder zeroes): the samples equal
the processor's, the encoder's output (sliding windows, grouped keys and values) and the
decoder's logits (prefilled in two pieces through the self-attention cache) equal
transformers', and the transcript's ids equal generate's (greedy), its text
batch_decode(skip_special_tokens=True)'s, for a feature extractor with an attention mask
and for one without (full attention) that normalizes. An encoder that attends outside its
windows (the planted bug) fails. `llmrun run --audio` prints the transcript, `show` says
what the folder is; a language, a translation, a prompt and a clip over the decoder's
positions are one error line each.

Tolerances: samples, encoder output and logits 1e-4; ids and text exact.
"""

import json
import shutil

import pytest
import torch
from in_process import llmrun
from moonshine_streaming_helpers import tiny_moonshine_streaming_dir, transcript
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, moonshine_streaming
from llmrun.models import moonshine_streaming as streaming_model

transformers = pytest.importorskip("transformers")
# 3 s and 45 samples: 600 frames and a part one, which (an odd 601st) the convolutions read.
SAMPLES = 48045


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("moonshine_streaming")
    hf, processor = tiny_moonshine_streaming_dir(path)
    samples = chirp(3.1, 16000, seed=1)[:SAMPLES]
    (path / "clip.wav").write_bytes(wav_bytes(samples, 16000))
    return path, hf, processor


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder[0]), device="cpu", transcribe=True)


@pytest.fixture(scope="module")
def clip(folder):
    return audio.open_audio(folder[0] / "clip.wav")


def test_samples_encoder_and_cached_logits_equal_transformers(folder, engine, clip, monkeypatch):
    _, hf, processor = folder
    inputs = processor(clip.samples, sampling_rate=16000)
    mine = moonshine_streaming.samples(clip, normalize=False, masked=True)
    assert (torch.from_numpy(mine) - inputs["input_values"][0]).abs().max() < 1e-4
    model, frames = engine.model, SAMPLES // streaming_model.FRAME
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        expected = hf.model.encoder(**inputs).last_hidden_state
        encoded = model.encode(torch.from_numpy(mine)[None], frames)
        assert (encoded - expected).abs().max() < 1e-4
        unmasked = model.encode(torch.from_numpy(mine)[None], frames + 1)
        assert (unmasked - expected).abs().max() > 1e-2  # the part frame matters
        logits = hf(**inputs, decoder_input_ids=ids).logits
        cache, cross = model.new_cache(), model.cross_cache(encoded)
        mine_logits = torch.cat(
            [model.decode(ids[:, :2], cache, 0, cross), model.decode(ids[:, 2:], cache, 2, cross)],
            dim=1,
        )
        assert (mine_logits - logits).abs().max() < 1e-4
        # The planted bug: every position sees every other, outside its layer's window.
        monkeypatch.setattr(
            streaming_model, "window", lambda n, left, right, device: torch.ones(n, n).bool()
        )
        wrong = model.encode(torch.from_numpy(mine)[None], frames)
        assert (wrong - expected).abs().max() > 1e-2


def test_the_transcript_equals_transformers_generate(folder, engine, clip):
    ids, text = transcript(*folder[1:], clip.samples)
    result = engine.transcribe(clip)
    assert (result.ids, result.text, result.language) == (ids, text, None)
    assert len(ids) > 10 and len(set(ids)) > 2  # a transcript that the decoder's state shapes


def test_without_an_attention_mask_the_encoder_attends_everywhere(folder, clip, tmp_path):
    """As transformers runs a feature extractor that returns no mask: full attention, the
    part frame kept, the padded samples normalized with the clip's."""
    path, hf, _ = folder
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    settings = json.loads((path / "processor_config.json").read_text())
    changed = {"return_attention_mask": False, "do_normalize": True}
    settings["feature_extractor"].update(changed)
    (tmp_path / "processor_config.json").write_text(json.dumps(settings))
    processor = transformers.MoonshineStreamingProcessor.from_pretrained(tmp_path)
    assert "attention_mask" not in processor(clip.samples, sampling_rate=16000)
    ids, text = transcript(hf, processor, clip.samples)
    result = api.load(str(tmp_path), device="cpu", transcribe=True).transcribe(clip)
    assert (result.ids, result.text) == (ids, text)
    assert ids != transcript(*folder[1:], clip.samples)[0]


def test_run_prints_the_transcript_and_show_says_what_it_is(folder, clip):
    path = folder[0]
    _, text = transcript(*folder[1:], clip.samples)
    result = llmrun("run", str(path), "--audio", str(path / "clip.wav"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert (
        "moonshine_streaming (speech recognition: 2 encoder (sliding-window) and 2 decoder "
        "layers over raw 16 kHz audio)"
    ) in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--audio", "clip.wav", "--language", "en"], "Moonshine Streaming takes no language"),
        (["--audio", "clip.wav", "--task", "translate"], "Moonshine Streaming transcribes;"),
        (["the quick fox", "--audio", "clip.wav"], "Moonshine Streaming takes no prompt"),
        (
            ["--audio", "long.wav"],
            "{path}/long.wav: 6.0 s, over the 5.1 s Moonshine Streaming encodes (256 positions",
        ),
    ],
    ids=["language", "translate", "prompt", "long"],
)
def test_a_bad_option_is_one_error_line(folder, args, message):
    path = folder[0]
    (path / "long.wav").write_bytes(wav_bytes(chirp(6.0, 16000), 16000))
    args = [str(path / a) if a.endswith(".wav") else a for a in args]
    result = llmrun("run", str(path), *args)
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message.format(path=path))
    assert result.stderr.count("\n") == 1

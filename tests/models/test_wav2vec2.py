"""wav2vec 2.0, HuBERT, data2vec-audio and WavLM CTC (llmrun.models.wav2vec2, llmrun.wav2vec2,
llmrun.wav2vec2_tokenizer) against transformers 5.25 on tiny random Wav2Vec2ForCTC folders of
the base kind (a group-normalized convolution, post-LayerNorm layers) and the large/XLSR kind
(layer norms, pre-LayerNorm layers), a HubertForCTC without the projection's LayerNorm
and without a tokenizer_class, a Data2VecAudioForCTC and a WavLMForCTC
(tests/wav2vec2_helpers.py): the normalized samples equal
Wav2Vec2FeatureExtractor's, the logits equal transformers' forward, also from a file with
the Hub's weight_g / weight_v names of the positional convolution, the transcripts' ids and
text equal the argmax decode and the processor's batch_decode for a long and a short clip,
and the tokenizer's ids equal Wav2Vec2CTCTokenizer's. Decoding without CTC's grouping (the
planted bug) fails. `llmrun run --audio` prints the transcript, `show` says what the folder
is; a language and `chat` are one error line each.

Tolerances: samples 1e-6, logits 1e-4; ids and text exact.
"""

import shutil

import pytest
import torch
from audio_checks import chirp_wavs
from in_process import llmrun
from wav2vec2_helpers import tiny_wav2vec2_dir, transcript

from llmrun import api, audio, wav2vec2

transformers = pytest.importorskip("transformers")
KINDS = ("base", "large", "hubert", "data2vec", "wavlm")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        made[kind] = (path, *tiny_wav2vec2_dir(path, kind, seed=1))
    chirp_wavs(made["base"][0], 3.0, 1.3)
    return made


@pytest.fixture(scope="module")
def engines(folders):
    return {k: api.load(str(folders[k][0]), device="cpu", transcribe=True) for k in KINDS}


@pytest.fixture(scope="module")
def clips(folders):
    path = folders["base"][0]
    return [audio.open_audio(path / name) for name in ("long.wav", "short.wav")]


def logits(folder, engine, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and llmrun's for a clip's samples."""
    path, hf, processor = folder
    inputs = processor(samples, sampling_rate=16000, return_tensors="pt")
    x = wav2vec2.samples(samples, wav2vec2.normalizes(path))
    assert (x - inputs["input_values"][0]).abs().max() < 1e-6
    with torch.no_grad():
        return hf(**inputs).logits[0], engine.model.logits(x)


@pytest.mark.parametrize("kind", KINDS)
def test_samples_logits_and_transcripts_equal_transformers(folders, engines, clips, kind):
    expected, got = logits(folders[kind], engines[kind], clips[0].samples)
    assert (got - expected).abs().max() < 1e-4
    for clip in reversed(clips):
        ids, text = transcript(*folders[kind][1:], clip.samples)
        result = engines[kind].transcribe(clip)
        assert (result.ids, result.text) == (ids, text)
    assert len(set(ids)) > 2  # the long clip's: characters the audio shapes


def test_the_hubs_weight_norm_names_load_as_transformers_reads_them(folders, clips, tmp_path):
    from safetensors.torch import load_file, save_file

    path = folders["base"][0]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    prefix = "wav2vec2.encoder.pos_conv_embed.conv."
    for old, new in (("original0", "weight_g"), ("original1", "weight_v")):
        weights[prefix + new] = weights.pop(f"{prefix}parametrizations.weight.{old}")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.Wav2Vec2ForCTC.from_pretrained(tmp_path).eval()
    engine = api.load(str(tmp_path), device="cpu", transcribe=True)
    expected, got = logits((tmp_path, hf, folders["base"][2]), engine, clips[1].samples)
    assert (got - expected).abs().max() < 1e-4


def test_the_tokenizer_and_the_planted_bug(folders, engines, clips, monkeypatch):
    tokenizer = engines["base"].tokenizer
    reference = folders["base"][2].tokenizer
    for text in ("HELLO WORLD", "IT'S A <unk> DAY", "A <s> B"):
        assert tokenizer.encode(text) == reference(text).input_ids
    ids, text = transcript(*folders["base"][1:], clips[0].samples)
    monkeypatch.setattr(wav2vec2, "groupby", lambda ids: ((i, None) for i in ids))
    assert engines["base"].transcribe(clips[0]).text != text


def test_run_prints_the_transcript_and_show_says_what_it_is(folders, clips):
    path, hf, processor = folders["large"]
    _, text = transcript(hf, processor, clips[0].samples)
    result = llmrun("run", str(path), "--audio", str(folders["base"][0] / "long.wav"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    # transformers' parameters, the encoder's too, but for the masking one only training uses
    run = sum(p.numel() for n, p in hf.named_parameters() if "masked_spec_embed" not in n)
    assert f"({run:,}); {hf.wav2vec2.masked_spec_embed.numel()} more in parts only " in (
        shown.stdout
    )
    assert (
        "wav2vec2 (speech recognition: 2 encoder layers and a CTC head over raw 16 kHz audio)"
    ) in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--audio", "long.wav", "--language", "en"], "wav2vec2 takes no language"),
        (["chat"], "{path} is a speech recognition model (wav2vec2): transcribe with"),
    ],
    ids=["language", "chat"],
)
def test_what_it_cannot_do_is_one_error_line(folders, args, message):
    path = folders["base"][0]
    command, *rest = args
    rest = [str(path / a) if a.endswith(".wav") else a for a in rest]
    result = llmrun(command, str(path), *rest, input="")
    assert result.returncode != 0
    assert result.stderr.startswith("error: " + message.format(path=path)), result.stderr
    assert result.stderr.count("\n") == 1

"""Muse Spark with audio against transformers: a tiny random
MuseSparkForConditionalGeneration (tests/muse_spark_helpers.py: an audio tower of three
stages folding 4, 2 and 2 steps, 16 samples a token, kernels of 3) and MuseSparkProcessor
with MuseSparkFeatureExtractor. A WAV file decodes to 16 kHz (llmrun.audio) and is
resampled to 24 kHz; transformers is given that waveform. The prompt ids (the audio part
written as <|audio|>, expanded by the processor's own code), the audio features, the
logits and 8 greedy tokens match; `llmrun run --audio` replies as transformers. A
convolution that sees the next steps as well as the last ones fails.

Tolerances: features and logits 1e-4 (absolute), tokens exact.
"""

import json
from unittest.mock import patch

import pytest
import torch
from helpers import needs_templates
from in_process import llmrun
from muse_glimmer_helpers import TEMPLATE, greedy_tokens
from muse_spark_helpers import SAMPLES_PER_TOKEN, folder_of, tiny_muse_spark
from voxtral_helpers import chirp, wav_bytes

from llmrun import api, audio, muse_spark_clips
from llmrun.models import muse_spark_audio
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = needs_templates  # the chat template is llama.cpp's muse-glimmer.jinja
QUESTION = "What is said?"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_muse_spark()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_of(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", audio=True)


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("muse_spark_audio") / "clip.wav"
    path.write_bytes(wav_bytes(chirp(0.0125, 16000, seed=3)[:, None], 16000))  # 200 samples
    return path


def processor_inputs(folder, clip: audio.Clip) -> dict:
    """MuseSparkProcessor's inputs for one user message of the clip then QUESTION: the
    clip as llmrun resamples it, the audio place as llmrun writes it."""
    original = transformers.ProcessorMixin.check_argument_for_proper_class

    def check(self, name: str, arg) -> None:
        if name not in ("image_processor", "video_processor"):  # audio alone
            original(self, name, arg)

    with patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", check):
        made = transformers.MuseSparkProcessor(
            image_processor=None,
            video_processor=None,
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            feature_extractor=transformers.MuseSparkFeatureExtractor(
                samples_per_token=SAMPLES_PER_TOKEN
            ),
            chat_template=TEMPLATE.read_text(),
        )
    messages = [{"role": "user", "content": muse_spark_clips.AUDIO + QUESTION}]
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    waveform = muse_spark_clips._waveform(clip)
    inputs = made(
        text=text,
        audio=[waveform],
        return_tensors="pt",
        add_special_tokens=False,
        sampling_rate=24000,
    )
    return {k: inputs[k] for k in ("input_ids", "input_values", "input_values_mask")}


def test_ids_features_logits_and_greedy_tokens_match_transformers(model, folder, engine, wav):
    clip = audio.open_audio(wav)
    content = [{"type": "audio"}, {"type": "text", "text": QUESTION}]
    ids, clips = engine.audio_prompt(engine.render([{"role": "user", "content": content}]), [clip])
    reference = processor_inputs(folder, clip)
    assert ids == reference["input_ids"][0].tolist()
    assert len(clips.embeds[0]) == 19 == engine.audio_tokens(clip)  # 300 samples at 24 kHz
    with torch.no_grad():
        features = model.model.get_audio_features(
            reference["input_values"], reference["input_values_mask"]
        ).pooler_output
        expected = model(**reference).logits[0]
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=clips.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    torch.testing.assert_close(clips.embeds[0], features, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    greedy = [r.token for r in engine.generate(ids, GREEDY, 8, images=clips) if r.token]
    assert len(greedy) == 8
    assert greedy == greedy_tokens(model, reference)


def test_a_convolution_that_sees_ahead_fails(model, folder, engine, wav, monkeypatch):
    def centered(self, x):
        half = (self.conv.kernel_size[0] - 1) // 2
        steps = torch.nn.functional.pad(x.transpose(1, 2), (half, half))
        return x + self.mlp(self.norm(self.conv(steps).transpose(1, 2)))

    clip = audio.open_audio(wav)
    reference = processor_inputs(folder, clip)
    with torch.no_grad():
        features = model.model.get_audio_features(
            reference["input_values"], reference["input_values_mask"]
        ).pooler_output
    monkeypatch.setattr(muse_spark_audio.ConvBlock, "forward", centered)
    planted = muse_spark_clips.encode(engine.audio, [clip])[0]
    assert (planted - features).abs().max() > 1e-2


def test_run_with_audio_replies_as_transformers(model, folder, wav):
    reference = processor_inputs(folder, audio.open_audio(wav))
    args = [str(folder), "--audio", str(wav), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    ids = [e["id"] for e in json.loads(result.stdout)["logprobs"]]
    assert ids == greedy_tokens(model, reference)

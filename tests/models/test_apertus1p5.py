"""Apertus 1.5's language model (llmrun/models/apertus.py with a pruned output head)
against transformers: Apertus1p5TextForCausalLM's folder, and the language model of an
Apertus1p5ForConditionalGeneration folder (its image and audio tokenizers left out), both
saved by save_pretrained with stories260K's tokenizer. The tiny model: vocabulary 600
(the tokenizer's 512 and 88 media codes), its output head pruned to the first 512
(output_vocab_size), 2 layers, Apertus's xIELU and Llama 3 RoPE scaling.

Tolerances: f32 logits (within about ±5) of the head's 512 ids 1e-4 max abs against
transformers, whole and through the KV cache (prefills in chunks, then one token at a
time), the 88 ids past the head -inf; `llmrun run` picks transformers' 8 greedy token ids.
"""

import pytest
import torch
from family_checks import check_run_token_ids, check_show, hf_model_of, max_diff
from helpers import BASE, cached_logits, randomize, save_hf_dir
from in_process import llmrun

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import apertus

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.apertus1p5")

CPU = torch.device("cpu")
HEAD = BASE["vocab_size"]  # stories260K's 512 tokens: the pruned head's ids
TEXT = dict(BASE, model_type="apertus1p5_text", vocab_size=600, output_vocab_size=HEAD)
# Tiny tokenizers: Apertus1p5Config checks that the image codes end where audio's begin.
VISION = dict(
    codebook_size=32, embed_dim=8, latent_channels=8, base_channels=32,
    channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], resolution=32,
)  # fmt: skip
AUDIO = dict(
    model_type="wavtokenizer_encoder", codebook_dim=16, codebook_size=16, hidden_size=16,
    num_filters=4, num_lstm_layers=1, upsampling_ratios=[2, 2], decoder_hidden_size=32,
    decoder_attention_num_groups=8, decoder_intermediate_size=16, decoder_num_layers=1,
)  # fmt: skip
IDS = torch.randint(3, HEAD, (1, 40), generator=torch.Generator().manual_seed(1))


def check_logits(logits: torch.Tensor, expected: torch.Tensor) -> None:
    """The head's ids within 1e-4 of transformers' logits, the ids past it -inf."""
    assert logits.shape[-1] == TEXT["vocab_size"]
    assert max_diff(logits[..., :HEAD], expected) < 1e-4
    assert torch.isneginf(logits[..., HEAD:]).all()


@pytest.fixture(scope="module")
def text_hf():
    return hf_model_of(TEXT)


@pytest.fixture(scope="module")
def text_folder(text_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("apertus1p5") / "Apertus-1.5-text"
    return save_hf_dir(text_hf, path, tokenizer=True)


def test_the_text_folder_matches_transformers_and_runs(text_hf, text_folder):
    with torch.no_grad():
        expected = text_hf(IDS).logits
    assert expected.shape[-1] == HEAD
    loaded = load_model(text_folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "apertus1p5_text"
    with torch.no_grad():
        check_logits(loaded.model(IDS, torch.arange(IDS.shape[1])[None]), expected)
    check_logits(cached_logits(loaded.model, IDS), expected)
    check_run_token_ids(text_hf, text_folder, tokens=8, text=False)
    # 2 layers' keys and values: 2 KV heads of 16, f32, 8192 positions.
    check_show(text_folder, "apertus1p5_text", 2 * 2 * 2 * 16 * 4 * 8192)


def test_the_multimodal_folders_language_model_matches_transformers(tmp_path):
    config = transformers.Apertus1p5Config(
        text_config=TEXT, vision_config=VISION, audio_config=AUDIO, image_token_id=510,
        audio_token_id=511, image_token_offset=HEAD, audio_token_offset=HEAD + 32,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Apertus1p5ForConditionalGeneration(config).eval()
    randomize(hf)
    with torch.no_grad():
        expected = hf(input_ids=IDS).logits
    folder = save_hf_dir(hf, tmp_path / "Apertus-1.5", tokenizer=True)
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "apertus1p5_text"
    assert any("without the vision tower" in note for note in loaded.checkpoint.notes)
    check_logits(cached_logits(loaded.model, IDS), expected)
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    assert "apertus1p5" in shown.stdout


def test_a_head_wider_than_the_vocabulary_is_refused():
    with pytest.raises(ModelFormatError, match=r"output_vocab_size \(700\) must be in"):
        apertus.ModelArgs.from_config({**TEXT, "output_vocab_size": 700})

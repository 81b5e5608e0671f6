"""A tiny random Granite Speech (transformers' GraniteSpeechForConditionalGeneration with a
PEFT LoRA adapter on its language model's q_proj and v_proj) and Granite Speech Plus
(GraniteSpeechPlusForConditionalGeneration, without one) for the audio tests, each as a
Hugging Face folder (stories260K's tokenizer plus Granite's role tokens and <|audio|>, a
Granite chat template that reads content as text), and transformers'
GraniteSpeechProcessor on it.

GraniteSpeechFeatureExtractor takes its mel spectrogram from torchaudio, which is not
installed: MelSpectrogram here is the same transform (a 400-sample periodic Hann window
centred in an FFT of 512, hop 160, reflection padding, power 2, HTK mels without norm)
made of transformers.audio_utils' numpy functions (in float64: up to 2e-5 from
torchaudio's float32 after the extractor's scaling); the extractor's own code does the
rest (log10, the clip's floor, scaling, the stacking of frame pairs, the token counts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import torch
from helpers import STORIES_HF, randomize

GRANITE_TOKENS = ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|audio|>")
AUDIO = 515  # <|audio|>
VOCAB = 512 + len(GRANITE_TOKENS)
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] "
    "+ '<|end_of_text|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}"
    "{%- endif -%}"
)

_TEXT = dict(
    model_type="granite",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.1,
    logits_scaling=2.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_ENCODER = dict(
    input_dim=160,
    num_layers=2,
    hidden_dim=32,
    feedforward_mult=2,
    num_heads=2,
    dim_head=16,
    output_dim=8,
    context_size=16,
    max_pos_emb=16,
    conv_kernel_size=5,
)
_PROJECTOR = dict(
    model_type="blip_2_qformer",
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    encoder_hidden_size=32,
    cross_attention_frequency=1,
)


def tiny_granite_speech(path: Path, seed: int = 0):
    """A random GraniteSpeechForConditionalGeneration saved to `path`: a Granite of width
    64 (2 layers, muP multipliers away from 1), a conformer of width 32 (2 blocks of 2
    heads, context blocks of 16 frames), a 1-layer Q-Former of width 32; then a random
    PEFT LoRA adapter (rank 4, alpha 8) saved beside it, as the Hub's folders hold one.
    Returns the PEFT model: its forward runs the adapter; disable_adapter() runs without,
    as GraniteSpeechForConditionalGeneration.generate turns it on for audio alone."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.GraniteSpeechConfig(
        text_config={**_TEXT},
        encoder_config={**_ENCODER},
        projector_config={**_PROJECTOR},
        audio_token_index=AUDIO,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.GraniteSpeechForConditionalGeneration(config).eval()
    _randomize(model)
    model.save_pretrained(path)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft = get_peft_model(model, lora).eval()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.3)
    peft.save_pretrained(path)
    _save_tokenizer(path)
    return peft


def tiny_granite_speech_plus(path: Path, seed: int = 0, cat_hidden_layers=(0, 1)):
    """A random GraniteSpeechPlusForConditionalGeneration saved to `path`, without a LoRA
    adapter (as ibm-granite/granite-speech-4.1-2b-plus: has_lora_adapter false): a Granite
    of width 64 (2 layers), a conformer of width 32 (3 blocks of 2 heads, context blocks of
    16 frames) whose layers `cat_hidden_layers` names (by default the input layer and the
    middle block) go to the projector beside its last block, a 2-layer Q-Former of width 32
    taking them all.
    Returns the model."""
    import transformers

    encoder = {**_ENCODER, "num_layers": 3, "cat_hidden_layers": list(cat_hidden_layers)}
    width = _ENCODER["hidden_dim"] * (len(cat_hidden_layers) + 1)
    config = transformers.GraniteSpeechPlusConfig(
        # The Hub's names its language model's class, which llama.cpp's converter reads.
        text_config={**_TEXT, "architectures": ["GraniteForCausalLM"]},
        encoder_config=encoder,
        # 2 layers, as the Hub's and as llama.cpp's clip loader takes.
        projector_config={**_PROJECTOR, "num_hidden_layers": 2, "encoder_hidden_size": width},
        audio_token_index=AUDIO,
        has_lora_adapter=False,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.GraniteSpeechPlusForConditionalGeneration(config).eval()
    _randomize(model)
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model


def _randomize(model) -> None:
    """Random weights, norms near 1 and batch norms' running statistics away from 0 and 1."""
    randomize(model, {"embed_tokens.weight": 0.5})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "LayerNorm.weight", "layernorm.weight")):
                p.normal_(1.0, 0.1)
        for layer in model.model.encoder.layers:
            layer.conv.batch_norm.running_mean.normal_(0, 0.2)
            layer.conv.batch_norm.running_var.uniform_(0.5, 1.5)


def _save_tokenizer(path: Path) -> None:
    """stories260K's tokenizer with Granite's tokens, and the chat template."""
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(GRANITE_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))


class MelSpectrogram:
    """torchaudio.transforms.MelSpectrogram's transform for the extractor's settings."""

    def __init__(self, sample_rate: int, n_fft: int, win_length: int, hop_length: int, n_mels: int):
        from transformers.audio_utils import mel_filter_bank, window_function

        self.n_fft, self.hop_length = n_fft, hop_length
        self.window = window_function(win_length, "hann", frame_length=n_fft, center=True)
        self.filters = mel_filter_bank(
            n_fft // 2 + 1, n_mels, 0.0, sample_rate / 2, sample_rate, None, "htk"
        )

    def to(self, device):
        return self

    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        from transformers.audio_utils import spectrogram

        spectra = [
            spectrogram(
                x.double().numpy(),
                self.window,
                self.n_fft,
                self.hop_length,
                power=2.0,
                mel_filters=self.filters,
                mel_floor=0.0,
                dtype=np.float64,
            )
            for x in audio
        ]
        return torch.from_numpy(np.stack(spectra)).float()


@contextmanager
def _torchaudio_shim() -> Iterator[None]:
    """GraniteSpeechFeatureExtractor's module with MelSpectrogram as torchaudio's."""
    from transformers.models.granite_speech import feature_extraction_granite_speech as module

    shim = SimpleNamespace(transforms=SimpleNamespace(MelSpectrogram=MelSpectrogram))
    with (
        patch.object(module, "torchaudio", shim, create=True),
        patch.object(module, "requires_backends", lambda *args: None),
    ):
        yield


def extracted(clips: list[np.ndarray], **settings):
    """GraniteSpeechFeatureExtractor's output for `clips` (16 kHz float samples)."""
    from transformers import GraniteSpeechFeatureExtractor

    with _torchaudio_shim():
        return GraniteSpeechFeatureExtractor(**settings)([torch.from_numpy(c) for c in clips])


def processor_inputs(folder: Path, clips: list[np.ndarray], question: str, history=()):
    """GraniteSpeechProcessor's inputs (input_ids, attention_mask, input_features,
    input_features_mask) for the messages of `history` then a user message of an
    <|audio|> per clip (16 kHz float samples) and `question`, with the generation prompt."""
    import transformers

    messages = [*history, {"role": "user", "content": "<|audio|>" * len(clips) + question}]
    with _torchaudio_shim():
        proc = transformers.GraniteSpeechProcessor(
            audio_processor=transformers.GraniteSpeechFeatureExtractor(),
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
            chat_template=TEMPLATE,
        )
        text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = proc(
            text=text,
            audio=[torch.from_numpy(c) for c in clips] if clips else None,
            return_tensors="pt",
            add_special_tokens=False,
        )
    inputs.pop("audio_embed_sizes", None)
    return inputs


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation (of the PEFT model: with the adapter)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()

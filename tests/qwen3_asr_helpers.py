"""A tiny random Qwen3-ASR (Qwen3ASRForConditionalGeneration: a Qwen3 under Qwen3-Omni's
audio tower) for the audio and transcription tests: as a Hugging Face folder (save_pretrained's
layout, stories260K's tokenizer plus Qwen3-ASR's chat, audio and <asr_text> tokens, a chat
template of its markers, Qwen3ASRFeatureExtractor's preprocessor_config.json), as Qwen's own
files lay it out (thinker_config, thinker.* weights, the projector as the tower's proj1 and
proj2), the text GGUF and mmproj GGUF that llama.cpp's converter writes of the latter, and
transformers' Qwen3ASRProcessor for it."""

from __future__ import annotations

import json
from pathlib import Path

import llama_converter
import torch
from helpers import STORIES_HF, randomize
from safetensors.torch import load_file, save_file

# Ids 512 on, after stories260K's 512 tokens; <asr_text> is not a special token.
ASR_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<asr_text>",
)
IM_START, IM_END, AUDIO_START, AUDIO_END, AUDIO, ASR_TEXT = range(512, 518)
VOCAB = 518  # no padding rows: llama.cpp takes the vocabulary's size from the token list
# Qwen's ChatML with the audio parts written as Qwen3-Omni's are.
ASR_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # The Hub's carry Qwen3-Omni's interleaved M-RoPE sections (which llama.cpp's qwen3vl
    # requires), which turn a prompt of text and audio as plain RoPE: 8 pairs a head.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [3, 2, 3],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=True,
)
# Attention windows of 2 chunks (26 tokens), so that a 2.5-second clip spans two. Four
# layers: llama.cpp's converter maps the tower's conv2d1..3 by block number, so only
# below the block count.
AUDIO_CONFIG = dict(
    d_model=32,
    encoder_ffn_dim=64,
    encoder_layers=4,
    encoder_attention_heads=2,
    num_mel_bins=128,
    output_dim=64,
    downsample_hidden_size=8,
    n_window=50,
    n_window_infer=200,
)
PROCESSOR = {
    "feature_extractor_type": "Qwen3ASRFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "n_window": 50,
    "min_length": 8000,
}


def tiny_qwen3_asr(seed: int = 0):
    """A random transformers Qwen3ASRForConditionalGeneration of TEXT and AUDIO_CONFIG."""
    import transformers

    config = transformers.Qwen3ASRConfig(
        text_config={**TEXT, "model_type": "qwen3"},
        audio_config=AUDIO_CONFIG,
        audio_token_id=AUDIO,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ASRForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_qwen3_asr_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and
    PROCESSOR."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # Qwen's tokenizer adds no BOS
    for i, content in enumerate(ASR_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        special = content != "<asr_text>"
        tok["added_tokens"].append({**added, "normalized": not special, "special": special})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": ASR_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def qwen_layout(folder: Path, path: Path) -> Path:
    """The folder as Qwen's own files lay it out (Qwen/Qwen3-ASR-*): config.json's
    thinker_config holding audio_config and text_config, every weight under thinker.
    (thinker.model.*, thinker.lm_head.*, thinker.audio_tower.* with the projector as its
    proj1 and proj2)."""
    path.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (path / file.name).write_bytes(file.read_bytes())
    hf = json.loads((folder / "config.json").read_text())
    thinker = {
        "model_type": "qwen3_asr_thinker",
        "audio_config": {k: v for k, v in hf["audio_config"].items() if k != "model_type"},
        "text_config": hf["text_config"],
        "audio_token_id": hf["audio_token_id"],
    }
    config = {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "thinker_config": thinker,
    }
    (path / "config.json").write_text(json.dumps(config))
    renamed = {
        "model.language_model.": "thinker.model.",
        "lm_head.": "thinker.lm_head.",
        "model.audio_tower.": "thinker.audio_tower.",
        "model.multi_modal_projector.linear_1.": "thinker.audio_tower.proj1.",
        "model.multi_modal_projector.linear_2.": "thinker.audio_tower.proj2.",
    }
    state = {}
    for key, value in load_file(folder / "model.safetensors").items():
        old = next(p for p in renamed if key.startswith(p))
        state[renamed[old] + key[len(old) :]] = value
    if "thinker.lm_head.weight" not in state:  # tied: Qwen's files hold the head as well
        state["thinker.lm_head.weight"] = state["thinker.model.embed_tokens.weight"].clone()
    save_file(state, path / "model.safetensors")
    return path


def processor(folder: Path):
    """transformers' Qwen3ASRProcessor for the folder (Qwen3ASRFeatureExtractor of
    PROCESSOR's settings, the folder's tokenizer with Qwen3-ASR's audio token names)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.audio_token = "<|audio_pad|>"
    tokenizer.audio_bos_token = "<|audio_start|>"
    tokenizer.audio_eos_token = "<|audio_end|>"
    tokenizer.pad_token = "<unk>"  # the processor pads its one row
    features = transformers.Qwen3ASRFeatureExtractor(
        **{k: v for k, v in PROCESSOR.items() if k != "feature_extractor_type"}
    )
    return transformers.Qwen3ASRProcessor(
        feature_extractor=features, tokenizer=tokenizer, chat_template=ASR_TEMPLATE
    )


def processor_inputs(folder: Path, messages: list[dict], clips: list, made=None):
    """The processor's inputs for `messages` (their audio parts take `clips`, 16 kHz float
    samples, in order), with the generation prompt."""
    made = made or processor(folder)
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return made(text=text, audio=clips, sampling_rate=16000, add_special_tokens=False)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# llama.cpp's converter's patch (llama_converter.convert): the tiny
# tokenizer (stories260K's, not Qwen2's byte-level BPE, which the converter would refuse)
# written as the SentencePiece-style tokenizer.json it is: the tensors and other metadata
# are the converter's own.
CONVERT_PATCH = "base.TextModel._set_vocab_gpt2 = lambda self: self._set_vocab_llama_hf()"


def converted(folder: Path, out: Path) -> tuple[Path, Path]:
    """The text GGUF and the mmproj GGUF (F32, but what the converter keeps F16) that
    llama.cpp's converter writes of Qwen's layout of the model (`folder`, qwen_layout's), in
    `out`."""
    text, mmproj = out / "model.gguf", out / "mmproj.gguf"
    common = [str(folder), "--outtype", "f32", "--outfile"]
    runs = [[*common, str(text)], ["--mmproj", *common, str(mmproj)]]
    llama_converter.convert(runs, CONVERT_PATCH)
    return text, mmproj

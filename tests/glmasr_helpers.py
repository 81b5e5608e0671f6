"""A tiny random GLM-ASR (GlmAsrForConditionalGeneration: a Llama under a Whisper-style
audio tower with RoPE) for the audio and transcription tests: as a Hugging Face folder
(save_pretrained's layout, stories260K's tokenizer plus GLM's chat and audio tokens,
the Hub's chat template), as zai-org's original files lay it out (GlmasrModel: lm_config,
whisper_config, audio_encoder.* weights with the tower's RoPE pairs interleaved, which
transformers' converter undoes), the text GGUF and mmproj GGUF that llama.cpp's
converter writes of the latter, and transformers' GlmAsrProcessor for it."""

from __future__ import annotations

import json
from pathlib import Path

import llama_converter
import torch
from helpers import STORIES_HF, randomize
from safetensors.torch import load_file, save_file

# Ids 512 on, after stories260K's 512 tokens.
GLM_TOKENS = (
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
    "<|pad|>",
)
ENDOFTEXT, SYSTEM, USER, ASSISTANT, BEGIN_AUDIO, END_AUDIO, AUDIO = range(512, 519)
VOCAB = 519  # no padding rows: llama.cpp takes the vocabulary's size from the token list
# The Hub's (transformers' convert_glmasr_weights_to_hf.py writes it).
TEMPLATE = """{%- macro to_text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}
{%- if item is mapping and item.type == 'text' and item.text is defined -%}
{{- item.text -}}
{%- elif item is mapping and (item.type == 'audio' or 'audio' in item) -%}
<|begin_of_audio|><|pad|><|end_of_audio|><|user|>
{% elif item is string -%}
{{- item -}}
{%- endif -%}
{%- endfor -%}
{%- else -%}
{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>
{{ to_text(m.content) | trim }}
{%- elif m.role == 'user' -%}
<|user|>
{{ to_text(m.content) | trim }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{{ to_text(m.content) | trim }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{% endif -%}"""
TEXT = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Heads of 16 dimensions, 8 of them turned; intermediate_size is 4 frames' width, which the
# projector takes a token. Three layers: llama.cpp's converter maps the projector's
# linear_1 and linear_2 by block number, so only below the block count.
AUDIO_CONFIG = dict(
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_mel_bins=128,
)
WHISPER_POSITIONS = 1500


def tiny_glmasr(seed: int = 0):
    """A random transformers GlmAsrForConditionalGeneration of TEXT and AUDIO_CONFIG."""
    import transformers

    config = transformers.GlmAsrConfig(
        text_config=TEXT, audio_config=AUDIO_CONFIG, audio_token_id=AUDIO
    )
    torch.manual_seed(seed)
    model = transformers.GlmAsrForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_glmasr_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and
    WhisperFeatureExtractor's preprocessor_config.json."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # GLM's tokenizer adds no BOS
    for i, content in enumerate(GLM_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    features = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128}
    (path / "preprocessor_config.json").write_text(json.dumps(features))
    return path


def rope_order(heads: int, head_dim: int) -> torch.Tensor:
    """transformers' permute_rope as row indices: its row i is the original's row
    order[i] (each head's turned half, interleaved pairs in the original, as halves)."""
    half = head_dim // 2
    within = torch.cat(
        [torch.arange(0, half, 2), torch.arange(1, half, 2), torch.arange(half, head_dim)]
    )
    return torch.cat([h * head_dim + within for h in range(heads)])


def original_layout(folder: Path, path: Path, seed: int = 0) -> Path:
    """The folder as zai-org's original files lay it out (architectures GlmasrModel, which
    llama.cpp's converter takes): lm_config and whisper_config, model.* and lm_head.*, the
    tower as audio_encoder.whisper.* under Whisper's names with its q/k rows in the
    original's order, learned positions it never used, the final norm as
    audio_encoder.layer_norm, the projector as audio_encoder.adapting.0/2, and
    audio_bos_eos_token (the embeddings of <|begin_of_audio|> and
    <|end_of_audio|>)."""
    path.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (path / file.name).write_bytes(file.read_bytes())
    hf = json.loads((folder / "config.json").read_text())
    audio, text = hf["audio_config"], hf["text_config"]
    whisper = {
        "model_type": "whisper",
        "d_model": audio["hidden_size"],
        "encoder_layers": audio["num_hidden_layers"],
        "encoder_attention_heads": audio["num_attention_heads"],
        "encoder_ffn_dim": audio["intermediate_size"],
        "num_mel_bins": audio["num_mel_bins"],
        "max_source_positions": WHISPER_POSITIONS,
    }
    config = {
        "architectures": ["GlmasrModel"],
        "model_type": "glmasr",
        "lm_config": {**text, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
        "whisper_config": whisper,
        "merge_factor": 4,
        "use_rope": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    heads = audio["num_attention_heads"]
    order = rope_order(heads, audio["hidden_size"] // heads)
    layer_names = {
        "self_attn.o_proj.": "self_attn.out_proj.",
        "input_layernorm.": "self_attn_layer_norm.",
        "post_attention_layernorm.": "final_layer_norm.",
        "mlp.fc1.": "fc1.",
        "mlp.fc2.": "fc2.",
    }
    state = {}
    for key, value in load_file(folder / "model.safetensors").items():
        if key.startswith("language_model."):
            state[key[len("language_model.") :]] = value
        elif key.startswith("multi_modal_projector.linear_"):
            index = "0" if key.startswith("multi_modal_projector.linear_1.") else "2"
            state[f"audio_encoder.adapting.{index}.{key.rsplit('.', 1)[1]}"] = value
        elif key.startswith("audio_tower.norm."):
            state["audio_encoder.layer_norm." + key.rsplit(".", 1)[1]] = value
        else:
            name = key[len("audio_tower.") :]
            for new, old in layer_names.items():
                name = name.replace(new, old)
            if ".q_proj." in name or ".k_proj." in name:
                original = torch.empty_like(value)
                original[order] = value
                value = original
            state["audio_encoder.whisper." + name] = value
    embeddings = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embeddings.clone()  # tied: the original files hold the head
    generator = torch.Generator().manual_seed(seed)
    width = audio["hidden_size"]
    state["audio_encoder.whisper.embed_positions.weight"] = torch.randn(
        WHISPER_POSITIONS, width, generator=generator
    )
    state["audio_encoder.audio_bos_eos_token.weight"] = embeddings[[BEGIN_AUDIO, END_AUDIO]].clone()
    save_file(state, path / "model.safetensors")
    return path


def processor(folder: Path):
    """transformers' GlmAsrProcessor for the folder (WhisperFeatureExtractor of 128 mel
    bins, the folder's tokenizer and chat template)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    features = transformers.WhisperFeatureExtractor(feature_size=128)
    return transformers.GlmAsrProcessor(
        feature_extractor=features, tokenizer=tokenizer, chat_template=TEMPLATE
    )


def processor_inputs(made, messages: list[dict], clips: list):
    """The processor's inputs for `messages` (their audio parts take `clips`, 16 kHz float
    samples, in order), with the generation prompt."""
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return made(text=text, audio=clips, sampling_rate=16000)


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# llama.cpp's converter's patch (llama_converter.convert): the tiny
# tokenizer (stories260K's, not GLM's byte-level BPE, which the converter would refuse)
# written as the SentencePiece-style tokenizer.json it is: the tensors and other metadata
# are the converter's own.
CONVERT_PATCH = "base.TextModel._set_vocab_glmedge = lambda self: self._set_vocab_llama_hf()"


def converted(folder: Path, out: Path) -> tuple[Path, Path]:
    """The text GGUF and the mmproj GGUF (F32, but what the converter keeps F16) that
    llama.cpp's converter writes of the original layout of the model (`folder`,
    original_layout's), in `out`."""
    text, mmproj = out / "model.gguf", out / "mmproj.gguf"
    common = [str(folder), "--outtype", "f32", "--outfile"]
    runs = [[*common, str(text)], ["--mmproj", *common, str(mmproj)]]
    llama_converter.convert(runs, CONVERT_PATCH)
    return text, mmproj

"""A tiny random OmniASR (OmniASRForConditionalGeneration: a Llama under a wav2vec2-style
encoder of the raw samples) for the audio and transcription tests: its folder as
save_pretrained writes it, with stories260K's tokenizer plus the audio placeholder and
language tokens and a chat template of OmniASR's prompt (the clip's placeholders, the
language token, then BOS), and transformers' OmniASRProcessor for it.

The chat template is written here: the Hub's checkpoints keep theirs in files these tests
cannot fetch. It lays the prompt out as OmniASRProcessor documents it (the audio
placeholders, the language marker, and the BOS the transcription is decoded from)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
OMNI_TOKENS = ("<extra_id_1>", "<|lang:auto|>", "<|lang:eng_latn|>", "<|lang:fra_latn|>")
AUDIO, LANG_AUTO, LANG_ENG, LANG_FRA = range(512, 516)
VOCAB = 516
BOS = 1
TEMPLATE = (
    "{%- for message in messages -%}{%- set ns = namespace(lang='auto') -%}"
    "{%- for item in message.content -%}"
    "{%- if item.type == 'audio' -%}<extra_id_1>"
    "{%- elif item.type == 'language' -%}{%- set ns.lang = item.language -%}"
    "{%- endif -%}{%- endfor -%}<|lang:{{ ns.lang }}|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ bos_token }}{%- endif -%}"
)
TEXT = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=2,
    pad_token_id=0,
)
# Three convolutions of 320 samples a frame (50 a second, as the 7 of the real one).
AUDIO_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    conv_dim=[16, 16, 16],
    conv_kernel=[10, 8, 4],
    conv_stride=[5, 16, 4],
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)


def tiny_omniasr(seed: int = 0):
    """A random transformers OmniASRForConditionalGeneration of TEXT and AUDIO_CONFIG."""
    import transformers

    config = transformers.OmniASRConfig(
        text_config=TEXT,
        audio_config=AUDIO_CONFIG,
        audio_token_id=AUDIO,
        bos_token_id=BOS,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.OmniASRForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_omniasr_dir(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it, with the tokenizer files (BOS <s>,
    added by the template, not the tokenizer), the chat template and
    OmniASRFeatureExtractor's preprocessor_config.json."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None
    for i, content in enumerate(OMNI_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    features = {"feature_extractor_type": "OmniASRFeatureExtractor", "sampling_rate": 16000}
    (path / "preprocessor_config.json").write_text(json.dumps(features))
    return path


def processor(folder: Path):
    """transformers' OmniASRProcessor for the folder (its tokenizer and chat template, the
    tiny encoder's convolutions)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.OmniASRProcessor(
        feature_extractor=transformers.OmniASRFeatureExtractor(),
        tokenizer=tokenizer,
        chat_template=TEMPLATE,
        conv_kernel=AUDIO_CONFIG["conv_kernel"],
        conv_stride=AUDIO_CONFIG["conv_stride"],
    )


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of the processor's inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def save_fuse_tokenizer(path: Path) -> Path:
    """A folder with a tokenizer.json laid out as transformers' OmniASRConverter writes one
    (a Unigram model; whitespace stripped and runs of spaces made one; pieces split before
    each space, which they keep; the Fuse decoder joining them as written), with BOS <s>."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pieces = ["<unk>", "<s>", "</s>", "<pad>", " ", "h", "e", "l", "o", "w", "r", "d", "é"]
    pieces += [" wor", "ld", "hel", "lo", " ça", " va"]
    vocab = [(piece, -1.0 - len(piece) % 3) for piece in pieces]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>"])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def tiny_omniasr_ctc(seed: int = 0):
    """A random transformers OmniASRForCTC of AUDIO_CONFIG over save_fuse_tokenizer's 19
    pieces, its pad <pad> (3) the blank generate writes past a clip."""
    import transformers

    config = transformers.OmniASRCTCConfig(
        audio_config=AUDIO_CONFIG, vocab_size=19, pad_token_id=3, blank_token_id=0
    )
    torch.manual_seed(seed)
    model = transformers.OmniASRForCTC(config).eval()
    randomize(model)
    with torch.no_grad():  # the pad about as likely as the likeliest piece, so it is written
        head = model.ctc_head
        head.weight[3] = head.weight[7] + 0.2 * torch.randn_like(head.weight[7])
        head.bias[3] = head.bias[7]
    return model


def ctc_processor(folder: Path):
    """transformers' OmniASRCTCProcessor for a CTC folder (its ParakeetTokenizer)."""
    import transformers

    tokenizer = transformers.ParakeetTokenizer.from_pretrained(folder)
    return transformers.OmniASRCTCProcessor(transformers.OmniASRFeatureExtractor(), tokenizer)

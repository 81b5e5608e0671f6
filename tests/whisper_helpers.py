"""A tiny random Whisper (WhisperForConditionalGeneration, d_model 32, 2 + 2 layers, 80 mel
bins) saved as a Hugging Face folder: safetensors, config.json, generation_config.json and
preprocessor_config.json as the Hub's Whisper folders hold them, and a small byte-level BPE
tokenizer.json (the real Whisper tokenizer is not offline) with the special tokens Whisper's
generate reads (<|endoftext|>, <|startoftranscript|>, language, task, <|startofprev|>,
<|notimestamps|>, ...) and the timestamp tokens after them, in the Hub's order; transformers'
timestamped segments of a clip, and the cues of an srt or vtt body."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize

LANGUAGES = ("en", "de", "fr", "es", "ja")
SPECIALS = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    *(f"<|{code}|>" for code in LANGUAGES),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
)
# <|0.00|> to <|30.00|>, after the special tokens and not special, as the Hub's are.
TIMESTAMPS = tuple(f"<|{i * 0.02:.2f}|>" for i in range(1501))
CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "speech to text, and text to speech! ",
    "whisper listens to thirty seconds of audio at a time? ",
    "der schnelle braune fuchs, le renard brun rapide. ",
] * 20


def write_tokenizer(path: Path, base_vocab: int = 330) -> dict[str, int]:
    """A byte-level BPE tokenizer.json of `base_vocab` tokens and SPECIALS after them, with
    tokenizer_config.json as Whisper's; the special tokens' ids by text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TIMESTAMPS])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 1024,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return {s: tokenizer.token_to_id(s) for s in SPECIALS}


def tiny_whisper_dir(
    path: Path,
    seed: int = 0,
    timestamp_scale: float = 0.5,
    alignment_heads: list[list[int]] | None = None,
):
    """A random tiny Whisper saved in `path` with its tokenizer and configs, the head's
    timestamp rows scaled by `timestamp_scale`, generation_config.json's alignment_heads
    (the [layer, head] pairs that time words) where given; the transformers model read back
    from it (with its generation_config.json)."""
    import transformers

    ids = write_tokenizer(path)
    vocab = max(ids.values()) + 1 + len(TIMESTAMPS)
    eot = ids["<|endoftext|>"]
    config = transformers.WhisperConfig(
        vocab_size=vocab,
        num_mel_bins=80,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=1500,
        max_target_positions=48,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        # Timestamps' head rows shrunk: a random head picks them after <|notimestamps|>
        # (1501 of the vocabulary), which a trained Whisper does not.
        model.model.decoder.embed_tokens.weight[vocab - len(TIMESTAMPS) :] *= timestamp_scale
    model.save_pretrained(path)
    space = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]["Ġ"]
    generation = {
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "max_length": 48,
        "begin_suppress_tokens": [space, eot],
        # Every third token, as many as the Hub's list has (~90), so that some greedy pick
        # of the random model is suppressed.
        "suppress_tokens": [*range(1, 300, 3), ids["<|startofprev|>"]],
        "is_multilingual": True,
        "lang_to_id": {f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGUAGES},
        "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
    }
    if alignment_heads is not None:
        generation["alignment_heads"] = alignment_heads
    (path / "generation_config.json").write_text(json.dumps(generation))
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(path)
    return transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()


def reference_segments(hf, path: Path, features, **kwargs) -> list[dict]:
    """transformers' segments of a clip's features: generate(return_timestamps=True,
    return_segments=True) with the folder's generation config as saved; each with its
    start, end, tokens, text (decode(skip_special_tokens=True)) and its window's decoder
    prompt, generated tokens (end-of-text included) and scores."""
    import transformers

    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    out = hf.generate(
        features,
        return_timestamps=True,
        return_segments=True,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    segments, starts = [], {}
    for segment in out["segments"][0]:
        window = segment["result"]
        # A window's first segment begins right after its decoder prompt.
        prompt = starts.setdefault(id(window), segment["idxs"][0])
        segments.append(
            {
                "start": float(segment["start"]),
                "end": float(segment["end"]),
                "tokens": segment["tokens"].tolist(),
                "text": tokenizer.decode(segment["tokens"], skip_special_tokens=True),
                "window": id(window),
                "prompt": window["sequences"][:prompt].tolist(),
                "generated": window["sequences"][prompt:].tolist(),
                "scores": torch.stack(window["scores"]).float(),
            }
        )
    return segments


def subtitle_cues(body: str, marker: str) -> list[tuple[int, int, str]]:
    """The cues of an srt (`marker` ",") or vtt (".") body, as (start, end) milliseconds
    and text, each cue checked for its format: srt's numbered from 1, vtt's after WEBVTT,
    times hh:mm:ss{marker}mmm, a blank line after each."""
    import re

    stamp = rf"(\d\d):(\d\d):(\d\d){re.escape(marker)}(\d\d\d)"
    number = r"(\d+)\n" if marker == "," else ""
    cue = re.compile(rf"{number}{stamp} --> {stamp}\n((?:[^\n]+\n)+)\n")
    if marker == ".":
        assert body.startswith("WEBVTT\n\n")
        body = body[len("WEBVTT\n\n") :]
    cues, at = [], 0
    while at < len(body):
        found = cue.match(body, at)
        assert found, body[at:]
        groups = [int(g) for g in found.groups()[:-1]]
        if marker == ",":
            assert groups.pop(0) == len(cues) + 1
        h1, m1, s1, ms1, h2, m2, s2, ms2 = groups
        start = ((h1 * 60 + m1) * 60 + s1) * 1000 + ms1
        end = ((h2 * 60 + m2) * 60 + s2) * 1000 + ms2
        cues.append((start, end, found.group(found.lastindex)[:-1]))
        at = found.end()
    return cues

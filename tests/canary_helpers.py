"""A tiny random Canary (CanaryForConditionalGeneration: a 2-layer FastConformer of width
32 over 16 mel bins, a 2-layer decoder of width 32 with grouped keys and values) saved as
a Hugging Face folder: safetensors (the output head untied), config.json,
generation_config.json, processor_config.json (ParakeetFeatureExtractor's settings),
Cohere Transcribe's small Metaspace BPE tokenizer
(tests/cohere_asr_helpers.py: the same special tokens at Canary's ids) and a chat template
that renders the decoder prompt transformers' processor test expects of the Hub's (the
real processor files are not offline)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from cohere_asr_helpers import write_tokenizer
from helpers import randomize

# The prompt of tests/models/canary/test_processing_canary.py's _get_prompt.
CHAT_TEMPLATE = (
    "{%- set text = messages[0]['content'] | selectattr('type', 'equalto', 'text') | first -%}"
    "<|startofcontext|><|startoftranscript|><|emo:undefined|>"
    "<|{{ text['source_language'] }}|><|{{ text['target_language'] }}|>"
    "{{ '<|pnc|>' if text['punctuation'] else '<|nopnc|>' }}"
    "<|noitn|><|notimestamp|><|nodiarize|>"
)


def tiny_canary_dir(path: Path, seed: int = 0):
    """A random tiny Canary saved in `path` with its tokenizer and configs; the transformers
    model read back from it, and its processor."""
    import transformers

    ids = write_tokenizer(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    encoder = transformers.ParakeetEncoderConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_mel_bins=16,
        subsampling_conv_channels=8,
        scale_input=False,
    )
    decoder = transformers.CanaryDecoderConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    # Untied: a random head tied to the embedding repeats the token it reads, ever.
    config = transformers.CanaryConfig(
        encoder_config=encoder,
        decoder_config=decoder,
        vocab_size=len(vocab),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.CanaryForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():  # trained batch norms' statistics, not 0 and 1
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_(0, 0.2)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
        # The end token raised: the random model ends some transcripts before max_length.
        model.proj_out.bias[ids["<|endoftext|>"]] += 1.1
    model.save_pretrained(path)
    generation = {
        "decoder_start_token_id": ids["<|startofcontext|>"],
        "bos_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<pad>"],
        "max_length": 40,
        # The special tokens but the end (the random model picks them), and some other
        # greedy picks, suppressed.
        "suppress_tokens": [i for i in range(19) if i != ids["<|endoftext|>"]]
        + list(range(30, 200, 4)),
    }
    (path / "generation_config.json").write_text(json.dumps(generation))
    extractor = transformers.ParakeetFeatureExtractor(feature_size=16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.CanaryProcessor(extractor, tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    hf = transformers.CanaryForConditionalGeneration.from_pretrained(path).eval()
    return hf, transformers.CanaryProcessor.from_pretrained(path)


def transcript(
    hf, processor, samples, source: str, target: str | None = None
) -> tuple[list[int], str]:
    """transformers' greedy ids after apply_transcription_request's decoder prompt (up to
    the end token), and the text, batch_decode(skip_special_tokens=True)'s."""
    inputs = processor.apply_transcription_request(
        audio=samples, source_language=source, target_language=target
    )
    out = hf.generate(**inputs)
    prompt = inputs["decoder_input_ids"].shape[1]
    row = out[0].tolist()[prompt:]
    eos = hf.generation_config.eos_token_id
    ids = row[: row.index(eos)] if eos in row else row
    return ids, processor.batch_decode(out, skip_special_tokens=True)[0]

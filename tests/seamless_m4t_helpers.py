"""A tiny random SeamlessM4T v2 (SeamlessM4Tv2Model) or v1 (SeamlessM4TModel, its BatchNorm
statistics drawn too): a 2-layer Conformer speech encoder and a 1-layer length adaptor, a
1-layer text encoder and a 2-layer text decoder of width 32, and the tiniest text-to-unit
model and vocoder transformers builds, saved as a Hugging Face folder:
safetensors, config.json, generation_config.json (text_decoder_lang_to_code_id for eng, fra,
deu), and SeamlessM4TProcessor's files: SeamlessM4TFeatureExtractor's settings and
SeamlessM4TTokenizer's (a small SentencePiece BPE trained here, <pad> 0, <unk> 1, <s> 2, </s> 3
as the real vocabulary has them, and the __eng__-style language codes); v2's speech encoder
attends in chunks of 6 frames and one chunk back.

The reference runs eager attention with its boolean masks applied (masks_applied):
transformers 5.25's default sdpa drops the speech encoder's relative-position scores (its
position_bias argument), and its eager attention adds the boolean chunk and padding masks to
the scores, which masks nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from helpers import randomize
from unigram_helpers import CORPUS

CODES = ["__eng__", "__fra__", "__deu__"]


@contextmanager
def masks_applied() -> Iterator[None]:
    """transformers' SeamlessM4T eager attention with a boolean mask applied as a mask (the
    smallest float where it is False), as its sdpa applies one."""
    import transformers.models.seamless_m4t.modeling_seamless_m4t as v1
    import transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2 as v2

    originals = {module: module.eager_attention_forward for module in (v1, v2)}

    def masked(original):
        def attend(module, query, key, value, mask, *args, **kwargs):
            if mask is not None and mask.dtype == torch.bool:
                low = torch.finfo(query.dtype).min
                mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, low)
            return original(module, query, key, value, mask, *args, **kwargs)

        return attend

    for module, original in originals.items():
        module.eager_attention_forward = masked(original)
    try:
        yield
    finally:
        for module, original in originals.items():
            module.eager_attention_forward = original


def write_tokenizer(path: Path):
    """SeamlessM4TTokenizer's files in `path`: a 200-piece SentencePiece BPE and CODES."""
    import transformers
    from tokenizers import SentencePieceBPETokenizer

    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(
        CORPUS * 4,
        vocab_size=200,
        min_frequency=1,
        special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
    )
    model = json.loads(bpe.to_str())["model"]
    tokenizer = transformers.SeamlessM4TTokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        extra_special_tokens=CODES,
        src_lang="eng",
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def seamless_folder(path: Path, seed: int = 0, version: int = 2):
    """The tiny model (SeamlessM4T `version` 2 or 1) saved in `path`; transformers' model
    read back (eager attention) and the processor."""
    import transformers

    tokenizer = write_tokenizer(path)
    if version == 2:
        kind, config_kind = transformers.SeamlessM4Tv2Model, transformers.SeamlessM4Tv2Config
        own = dict(
            left_max_position_embeddings=8,
            right_max_position_embeddings=4,
            speech_encoder_chunk_size=6,
            speech_encoder_left_chunk_num=1,
            char_vocab_size=30,
            t2u_variance_predictor_embed_dim=8,
            t2u_variance_predictor_hidden_dim=8,
        )
    else:
        kind, config_kind = transformers.SeamlessM4TModel, transformers.SeamlessM4TConfig
        own = dict(max_source_positions=256)
    config = config_kind(
        **own,
        vocab_size=len(tokenizer),
        hidden_size=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        speech_encoder_layers=2,
        speech_encoder_attention_heads=2,
        speech_encoder_intermediate_size=48,
        conv_depthwise_kernel_size=5,
        adaptor_kernel_size=4,
        adaptor_stride=4,
        max_position_embeddings=64,
        max_new_tokens=12,
        t2u_vocab_size=20,
        t2u_encoder_layers=1,
        t2u_decoder_layers=1,
        t2u_encoder_ffn_dim=16,
        t2u_decoder_ffn_dim=16,
        t2u_encoder_attention_heads=2,
        t2u_decoder_attention_heads=2,
        t2u_max_position_embeddings=64,
        unit_embed_dim=8,
        upsample_initial_channel=8,
        upsample_rates=[2],
        upsample_kernel_sizes=[4],
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1]],
        unit_hifi_gan_vocab_size=10,
        vocoder_num_langs=2,
        vocoder_num_spkrs=2,
        vocoder_offset=4,
        # v2's head its own (a random head tied to the embedding repeats one token, ever;
        # its stacks' embeddings stay the shared one below); v1's tied to it, as the
        # released models' are.
        tie_word_embeddings=version != 2,
    )
    torch.manual_seed(seed)
    model = kind(config).eval()
    randomize(model)
    with torch.no_grad():  # v1's BatchNorm statistics, as a trained model has them
        model.text_encoder.embed_tokens.weight.copy_(model.shared.weight)
        model.text_decoder.embed_tokens.weight.copy_(model.shared.weight)
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_(0.0, 0.1)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
    codes = {code.strip("_"): tokenizer.convert_tokens_to_ids(code) for code in CODES}
    model.generation_config.text_decoder_lang_to_code_id = codes
    model.save_pretrained(path)
    extractor = transformers.SeamlessM4TFeatureExtractor()
    transformers.SeamlessM4TProcessor(extractor, tokenizer).save_pretrained(path)
    hf = kind.from_pretrained(path, attn_implementation="eager").eval()
    hf.generation_config.text_decoder_lang_to_code_id = codes  # from_pretrained drops it
    # v1's generate asks for the speech output's codes even when it writes text alone.
    hf.generation_config.t2u_lang_code_to_id = dict.fromkeys(codes, 0)
    hf.generation_config.vocoder_lang_code_to_id = dict.fromkeys(codes, 0)
    return hf, transformers.SeamlessM4TProcessor.from_pretrained(path)

"""llmrun.text_to_text's Rules against transformers 5.25's logits processors on random
scores and random token sequences of a small vocabulary (so that n-grams repeat):
encoder_no_repeat_ngram_size bans what EncoderNoRepeatNGramLogitsProcessor bans, for
n-grams of 1 to 4 tokens, given the encoder's ids; the rule left out (the planted bug) does
not. The decoding with it: tests/models/test_bart_kin.py (Blenderbot's generation config).

Tolerances: exact (the same scores set to -inf).
"""

import dataclasses

import pytest
import torch

from llmrun.text_to_text import Rules

transformers = pytest.importorskip("transformers")


def test_encoder_no_repeat_ngram_is_transformers():
    from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    vocab, banned = 7, 0
    for size in (1, 2, 3, 4):
        source = torch.randint(vocab, (1, 24), generator=generator)
        rules = Rules.of({"encoder_no_repeat_ngram_size": size}, {}, vocab)
        rules = dataclasses.replace(rules, source=tuple(source[0].tolist()))
        processor = EncoderNoRepeatNGramLogitsProcessor(size, source)
        for length in range(1, 9):
            tokens = torch.randint(vocab, (1, length), generator=generator)
            scores = torch.randn(1, vocab, generator=generator)
            expected = processor(tokens, scores.clone())[0]
            mine = scores[0].clone()
            rules.apply(mine, tokens[0].tolist(), 64, [])
            assert torch.equal(mine, expected), (size, length)
            planted = scores[0].clone()
            Rules().apply(planted, tokens[0].tolist(), 64, [])
            banned += not torch.equal(planted, expected)
    assert banned > 10  # the rule banned something, often

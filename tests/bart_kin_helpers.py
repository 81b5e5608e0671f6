"""Tiny random folders of BART's kin (llmrun.models.bart's LAYOUTS beyond BART, mBART,
Marian and M2M100, and llmrun.models.pegasus_x): PEGASUS, PEGASUS-X (blocks of 4 tokens, 3
global tokens, staggered blocks), Blenderbot, Blenderbot Small, MVP and LED (windows of 4
and 6 tokens, its own encoder and decoder positions), each saved by transformers (d_model 32,
2 + 2 layers, scaled embeddings where the Hub's configs scale them, final_logits_bias drawn
where the family has one) with its tokenizer class's files:
- PEGASUS and PEGASUS-X: PegasusTokenizer's tokenizer.json over a SentencePiece Unigram
  trained here (<pad> 0, </s> 1, its masks and <unk_n> before the pieces; ... </s>);
- Blenderbot: the Hub's kind, vocab.json, merges.txt and a tokenizer_config.json naming no
  class (read by llmrun.byte_level_bpe; transformers 5 frames nothing);
- Blenderbot Small: Blenderbot's byte-level BPE as a tokenizer.json framed as version 4's
  converter framed it (... </s>); its Hub folders ship BlenderbotSmallTokenizer's vocab.json
  and merges.txt, which llmrun does not read;
- MVP and LED: RoBERTa's (<s> ... </s>).
generation_config.json as the Hub's, beams left out: </s> forced last; Blenderbot's
min_length, and no_repeat_ngram_size 3 for all but the PEGASUS ones; MVP's forced <s> first."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import randomize
from unigram_helpers import CORPUS, processor, train

PROMPT = "The quick brown fox jumps over the lazy dog, and she sells sea shells by the shore."
# family -> (transformers class prefix, config beyond the shared fields, generation_config.json
# beyond the ids)
FAMILIES = {
    "pegasus": ("Pegasus", {"activation_function": "relu"}, {}),
    # blocks of 4 tokens (the prompt's last one padded), staggered in the second layer
    "pegasus_x": (
        "PegasusX",
        {"block_size": 4, "num_global_tokens": 3, "scale_embedding": False},
        {},
    ),
    "blenderbot": (
        "Blenderbot",
        {"scale_embedding": True},
        {"min_length": 12, "no_repeat_ngram_size": 3},
    ),
    "blenderbot-small": ("BlenderbotSmall", {"scale_embedding": True}, {"no_repeat_ngram_size": 3}),
    "mvp": ("Mvp", {}, {"forced_bos_token_id": 0, "no_repeat_ngram_size": 3}),
    # windows of 4 and 6 tokens (the prompt padded to a multiple of 6), 32 decoder positions
    "led": (
        "LED",
        {
            "attention_window": [4, 6],
            "max_encoder_position_embeddings": 64,
            "max_decoder_position_embeddings": 32,
        },
        {"no_repeat_ngram_size": 3},
    ),
}
SEEDS = {"led": 1, "pegasus": 0, "pegasus_x": 1, "blenderbot": 0, "blenderbot-small": 3, "mvp": 0}


def _byte_level_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE's vocabulary and merges, trained on CORPUS, <s> <pad> </s> <unk>
    <mask> first."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        CORPUS * 4,
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def vocab_and_merges(
    path: Path, vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None
) -> None:
    """A byte-level BPE's vocab.json and merges.txt at `path` (CORPUS's, by default)."""
    if vocab is None or merges is None:
        vocab, merges = _byte_level_bpe()
    (path / "vocab.json").write_text(json.dumps(vocab))
    lines = ["#version: 0.2", *(" ".join(m) for m in merges)]
    (path / "merges.txt").write_text("\n".join(lines) + "\n")


def _tokenizer(path: Path, family: str) -> dict[str, int]:
    """The family's tokenizer files at `path`; its pad, eos, bos ids and vocabulary size."""
    import transformers

    if family in ("pegasus", "pegasus_x"):
        sp = processor(train(vocab_size=250))  # SentencePiece's <unk> 0, <s> 1, </s> 2
        pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(3, sp.get_piece_size())]
        specials = ["<pad>", "</s>", "<mask_1>", "<mask_2>", "<unk_2>", "<unk>"]
        vocab = [(token, 0.0) for token in specials] + pieces
        tokenizer = transformers.PegasusTokenizer(vocab=vocab, offset=3)
        tokenizer.save_pretrained(path)
        return {"pad": 0, "eos": 1, "bos": 0, "vocab_size": len(vocab)}
    vocab, merges = _byte_level_bpe()
    if family in ("mvp", "led"):
        tokenizer = getattr(transformers, "MvpTokenizer" if family == "mvp" else "LEDTokenizer")
        tokenizer = tokenizer(vocab=vocab, merges=merges)
        tokenizer.save_pretrained(path)
    elif family == "blenderbot":  # the Hub's files: no tokenizer.json, no tokenizer class
        vocab_and_merges(path, vocab, merges)
        (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    else:
        transformers.BlenderbotTokenizer(vocab=vocab, merges=merges).save_pretrained(path)
        # The Hub's tokenizer.json (BlenderbotConverter's): </s> after the text.
        file = path / "tokenizer.json"
        data = json.loads(file.read_text())
        eos = {"SpecialToken": {"id": "</s>", "type_id": 0}}
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, eos],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 0}},
                eos,
            ],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}},
        }
        file.write_text(json.dumps(data))
    return {"pad": 1, "eos": 2, "bos": 0, "vocab_size": len(vocab)}


def kin_folder(path: Path, family: str) -> Path:
    """The tiny `family` (FAMILIES) folder at `path`."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(path, family)
    kind, switches, generation = FAMILIES[family]
    # Blenderbot's and PEGASUS's decoders start from <pad> (their Hub configs' start token),
    # BART's kin from </s>.
    start = ids["eos"] if family in ("mvp", "led") else ids["pad"]
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=ids["vocab_size"],
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        **({} if family == "led" else {"max_position_embeddings": 64}),
        bos_token_id=ids["bos"],
        pad_token_id=ids["pad"],
        eos_token_id=ids["eos"],
        decoder_start_token_id=start,
        forced_eos_token_id=ids["eos"],
        **switches,
    )
    torch.manual_seed(SEEDS[family])  # greedy tokens vary
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    randomize(model, {"q_proj.weight": 2.5, "k_proj.weight": 2.5})
    with torch.no_grad():
        if family != "pegasus_x":  # which has none
            model.final_logits_bias.normal_(0, 0.3)
        if family == "pegasus":  # its sinusoid tables, which randomize drew over
            for stack in (model.model.encoder, model.model.decoder):
                stack.embed_positions.weight.copy_(stack.embed_positions.create_weight())
    model.save_pretrained(path)
    transformers.GenerationConfig(
        bos_token_id=ids["bos"],
        pad_token_id=ids["pad"],
        eos_token_id=ids["eos"],
        decoder_start_token_id=start,
        forced_eos_token_id=ids["eos"],
        max_length=64,
        **generation,
    ).save_pretrained(path)
    return path


def reference(folder: Path, family: str):
    import transformers

    kind = FAMILIES[family][0]
    return getattr(transformers, f"{kind}ForConditionalGeneration").from_pretrained(folder).eval()

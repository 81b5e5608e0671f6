"""Rerankers against transformers' AutoModelForSequenceClassification: tiny BERT (WordPiece,
token types 0 then 1, pooler + classifier), RoBERTa and XLM-RoBERTa (byte-level BPE,
<s> q </s></s> d </s>, classifier.dense + out_proj) cross-encoders of one label, from the
HF folder and from GGUFs written as llama.cpp's converter writes them (tests/rerank_helpers.py),
F32 and Q8_0, every pair alone and in padded batches; and a Qwen3-Reranker GGUF (a causal
LM's P(yes) after its rerank prompt) against transformers' Qwen3ForCausalLM.

Tolerances: the logits (within about ±3) 1e-4 max abs against transformers'; a Q8_0 GGUF
1e-4 against transformers run on the weights gguf dequantizes (the products of dequantized
blocks are exact in f32); Qwen3's probabilities 1e-5. What llmrun must follow to match
(the pair's tokens, the token types, the dense + tanh before the projection) moves the
scores by far more (asserted).
"""

import json

import gguf
import numpy as np
import pytest
import torch
from rerank_helpers import (
    DOCUMENTS,
    QUERY,
    causal_reference,
    hf_causal_reranker,
    hf_reranker,
    hf_tokenizer,
    reference_scores,
    write_causal_reranker_gguf,
    write_reranker_dir,
    write_reranker_gguf,
)

from llmrun import api, reranking
from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import inspect
from llmrun.loading.loader import open_checkpoint

transformers = pytest.importorskip("transformers")

KINDS = ("bert", "roberta", "xlm-roberta")


@pytest.fixture(scope="module", params=KINDS)
def reranker(request, tmp_path_factory):
    """(kind, transformers model, its folder, transformers' scores of QUERY, DOCUMENTS)."""
    hf = hf_reranker(request.param)
    folder = write_reranker_dir(tmp_path_factory.mktemp(request.param), hf)
    return request.param, hf, folder, reference_scores(hf, folder)


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory):
    """`reranker`'s tuple for BERT alone, for what only BERT has (token types, a pooler)."""
    hf = hf_reranker("bert")
    folder = write_reranker_dir(tmp_path_factory.mktemp("bert-only"), hf)
    return "bert", hf, folder, reference_scores(hf, folder)


def load(path) -> api.Engine:
    return api.load(str(path), device="cpu", generate=False)


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def test_the_folder_scores_as_transformers_alone_and_batched(reranker):
    kind, _, folder, expected = reranker
    assert max(expected) - min(expected) > 0.2  # the documents score apart
    engine = load(folder)
    assert engine.reranks and not engine.generates
    batched = engine.rerank(QUERY, DOCUMENTS)
    alone = engine.rerank(QUERY, DOCUMENTS, batch_size=1)
    assert max_diff(batched.scores, expected) < 1e-4
    assert max_diff(alone.scores, batched.scores) < 1e-5
    encoded = [hf_tokenizer(folder)(QUERY, d)["input_ids"] for d in DOCUMENTS]
    assert batched.tokens == [len(ids) for ids in encoded]


def test_a_gguf_that_keeps_the_head_scores_as_transformers(reranker, tmp_path):
    """XLM-RoBERTa's whole head is in the converter's file; a BERT file that keeps the
    pooler as `cls` scores as transformers too."""
    _, hf, folder, expected = reranker
    engine = load(write_reranker_gguf(tmp_path / "r.gguf", hf, folder, pooler=True))
    assert max_diff(engine.rerank(QUERY, DOCUMENTS).scores, expected) < 1e-4


def test_the_converters_bert_gguf_scores_without_the_pooler(bert_reranker, tmp_path):
    """The converter drops BERT's pooler, so the file scores classifier(h[CLS]), as
    llama.cpp's rank pooling does."""
    _, hf, folder, expected = bert_reranker
    engine = load(write_reranker_gguf(tmp_path / "r.gguf", hf, folder, pooler=False))
    got = engine.rerank(QUERY, DOCUMENTS).scores
    tokenizer = hf_tokenizer(folder)
    headless = []
    with torch.no_grad():
        for document in DOCUMENTS:
            hidden = hf.bert(**tokenizer(QUERY, document, return_tensors="pt"))[0][0, 0]
            headless.append(hf.classifier(hidden).item())
    assert max_diff(got, headless) < 1e-4
    assert max_diff(headless, expected) > 0.1  # the pooler's dense + tanh


def test_a_gguf_pair_is_the_tokenizers_pair(reranker, tmp_path):
    """The pair llama.cpp's server builds from the GGUF's vocabulary (BOS, query, EOS, SEP,
    document, EOS as its add_* flags say) is transformers' tokenizer's pair, and BERT's
    types are 0 to its first [SEP], then 1."""
    kind, hf, folder, _ = reranker
    engine = load(write_reranker_gguf(tmp_path / "r.gguf", hf, folder))
    metadata = engine.checkpoint.gguf.metadata
    pairs = reranking.encode_pairs(engine.tokenizer, metadata, QUERY, DOCUMENTS, 128)
    tokenizer = hf_tokenizer(folder)
    for pair, document in zip(pairs, DOCUMENTS, strict=True):
        encoded = tokenizer(QUERY, document)
        assert pair.ids == encoded["input_ids"]
        if kind == "bert":
            assert pair.types == encoded["token_type_ids"]
            assert tokenizer.convert_ids_to_tokens(pair.ids[:2]) == ["[CLS]", "how"]
        else:
            sep = pair.ids.index(2)
            assert pair.ids[0] == 0 and pair.ids[sep : sep + 2] == [2, 2] and pair.ids[-1] == 2


def test_token_types_move_a_bert_score(bert_reranker):
    """BERT's document tokens are type 1 (llama.cpp gives every token type 0)."""
    _, _, folder, expected = bert_reranker
    engine = load(folder)
    pairs = reranking.encode_pairs(engine.tokenizer, None, QUERY, DOCUMENTS, 128, False, False)
    assert max_diff(reranking.score_pairs(engine.model, pairs), expected) > 0.1


def test_a_q8_0_gguf_scores_as_its_dequantized_weights(reranker, tmp_path):
    kind, hf, folder, expected = reranker
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_reranker_gguf(tmp_path / "q.gguf", hf, folder, qtype=q8, pooler=True)
    tensors = open_checkpoint(path).gguf.tensors
    assert tensors["cls.output.weight"].ggml_type == q8
    assert tensors["token_types.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    got = load(path).rerank(QUERY, DOCUMENTS).scores
    dequantized = hf_reranker(kind)
    # Only what the file quantizes: the position and token-type tables stay F32.
    kept = [
        n
        for n, _ in dequantized.named_parameters()
        if "position_embeddings" in n or "token_type" in n
    ]
    with torch.no_grad():
        for n, p in dequantized.named_parameters():
            if p.dim() == 2 and n not in kept:
                blocks = gguf.quants.quantize(p.numpy(), q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, q8)))
    assert max_diff(got, reference_scores(dequantized, folder)) < 1e-4
    assert 1e-4 < max_diff(got, expected) < 0.05


def test_a_long_document_is_refused_or_cut(reranker):
    """A pair past the context is an error naming its length; --truncate cuts the
    document (transformers' truncation="only_second")."""
    kind, hf, folder, _ = reranker
    engine = api.load(str(folder), device="cpu", generate=False, ctx_size=24)
    long = " ".join(["berlin has a river"] * 10)
    with pytest.raises(
        ContextOverflowError, match="document 1: its pair .* more than the context of 24"
    ):
        engine.rerank(QUERY, ["berlin", long])
    got = engine.rerank(QUERY, ["berlin", long], truncate=True)
    assert got.tokens[1] == 24
    encoded = hf_tokenizer(folder)(
        QUERY, long, truncation="only_second", max_length=24, return_tensors="pt"
    )
    with torch.no_grad():
        expected = hf(**encoded).logits[0, 0].item()
    assert abs(got.scores[1] - expected) < 1e-4


def test_ranked_sorts_best_first_and_keeps_the_top_n():
    result = reranking.Reranked([0.5, 2.0, -1.0, 2.0], [3, 4, 5, 6])
    assert [(r.index, r.score) for r in result.ranked()] == [
        (1, 2.0),
        (3, 2.0),
        (0, 0.5),
        (2, -1.0),
    ]
    assert [r.index for r in result.ranked(2)] == [1, 3]
    assert result.prompt_tokens == 18
    assert reranking.sigmoid([0.0])[0] == 0.5


def test_what_is_not_a_one_label_cross_encoder_is_refused(reranker, tmp_path):
    kind, hf, folder, _ = reranker
    engine = load(folder)
    with pytest.raises(UsageError, match="is a reranker; use `llmrun rerank`"):
        engine.embed(["berlin"])
    with pytest.raises(UsageError, match="no document to rerank"):
        engine.rerank(QUERY, [])
    if kind != "bert":
        return
    # The file's head and pooling checked before its weights load.
    two = hf_reranker(kind)
    two.classifier = torch.nn.Linear(64, 2)
    with pytest.raises(UnsupportedError, match="cls.output.weight has 2 rows"):
        open_checkpoint(write_reranker_gguf(tmp_path / "2.gguf", two, folder))
    config = (folder / "config.json").read_text()
    labels = {**json.loads(config), "id2label": {"0": "LABEL_0", "1": "LABEL_1"}}
    (folder / "config.json").write_text(json.dumps(labels))
    try:
        with pytest.raises(UnsupportedError, match="a sequence classifier of 2 labels"):
            open_checkpoint(folder)
    finally:
        (folder / "config.json").write_text(config)


def test_a_file_without_a_head_is_no_reranker(bert_reranker, tmp_path):
    """pooling_type rank names a reranker, whose classifier tensors the file must hold;
    without them and that pooling, the file is an encoder that does not rerank."""
    _, hf, folder, _ = bert_reranker
    rank = gguf.PoolingType.RANK
    path = write_reranker_gguf(tmp_path / "r.gguf", hf, folder, pooling=rank, drop=("cls",))
    with pytest.raises(ModelFormatError, match="rank .a reranker., but the file has no classifier"):
        open_checkpoint(path)
    engine = load(write_reranker_gguf(tmp_path / "e.gguf", hf, folder, drop=("cls",)))
    assert not engine.reranks
    with pytest.raises(UsageError, match="is not a reranker"):
        engine.rerank(QUERY, DOCUMENTS)


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0])
def test_a_causal_reranker_gguf_scores_as_transformers(tmp_path, qtype):
    """Qwen3-Reranker as llama.cpp converts it: the file's rerank prompt around the query
    and each document, P(yes) against no at the last token; batched as alone. Q8_0 against
    transformers on the weights gguf dequantizes."""
    hf = hf_causal_reranker()
    path = write_causal_reranker_gguf(tmp_path / "r.gguf", hf, qtype)
    engine = load(path)
    assert engine.reranks and not engine.generates
    got = engine.rerank(QUERY, DOCUMENTS)
    alone = engine.rerank(QUERY, DOCUMENTS, batch_size=1)
    assert max_diff(got.scores, alone.scores) < 1e-5
    if qtype is not None:
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:
                    blocks = gguf.quants.quantize(p.numpy(), qtype)
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    expected = causal_reference(hf)
    assert max(expected) - min(expected) > 0.1
    assert max_diff(got.scores, expected) < 1e-5
    with pytest.raises(UsageError, match="is a reranker; use `llmrun rerank`"):
        api.load(str(path), device="cpu")
    assert inspect.describe(path)["reranker"]
    if qtype is None:
        unprompted = write_causal_reranker_gguf(tmp_path / "u.gguf", hf, prompt=False)
        with pytest.raises(ModelFormatError, match="without a tokenizer.chat_template.rerank"):
            open_checkpoint(unprompted)


def test_a_qwen3_vl_reranker_gguf_scores_as_transformers(tmp_path):
    """Qwen3-VL-Reranker's language model as conversion/qwen3vl.py writes it: Qwen3's
    reranker keys and tensors under arch qwen3vl (whose M-RoPE turns text alone as plain
    RoPE), scored as its Qwen3 twin in transformers."""
    hf = hf_causal_reranker()
    engine = load(write_causal_reranker_gguf(tmp_path / "vl.gguf", hf, arch="qwen3vl"))
    assert engine.reranks and not engine.generates
    assert max_diff(engine.rerank(QUERY, DOCUMENTS).scores, causal_reference(hf)) < 1e-5

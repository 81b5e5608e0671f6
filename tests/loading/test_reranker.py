"""Qwen3-Reranker HF folders (a Qwen3ForCausalLM scored by its "yes" and "no" logits),
recognized as llama.cpp's converter recognizes them, against transformers' Qwen3ForCausalLM
run as the model card runs it: the prompt's prefix, body and suffix tokenized by
transformers' tokenizer, the yes and no ids from convert_tokens_to_ids, P(yes) the softmax
over the two logits at the last token (= sigmoid(logit yes - logit no), what llama.cpp's
rank pooling returns for the converted GGUF). Tolerance 1e-5 on probabilities.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import randomize
from rerank_helpers import DOCUMENTS, QUERY

from llmrun import api
from llmrun.errors import UnsupportedError, UsageError
from llmrun.loading import inspect

transformers = pytest.importorskip("transformers")

# The model card's prompt (huggingface.co/Qwen/Qwen3-Reranker-0.6B), written out here.
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)


def write_folder(path: Path, tied: bool = True, readme: str | None = "# Qwen3-Reranker-0.6B"):
    """A tiny random Qwen3ForCausalLM saved in `path` with a byte-level BPE tokenizer that
    has ChatML's tokens, <think> and </think>, and "yes" and "no" as tokens of their own."""
    from tokenizers import ByteLevelBPETokenizer

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG, tie_word_embeddings=tied)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf)
    hf.save_pretrained(path)
    tokenizer = ByteLevelBPETokenizer()
    corpus = [PREFIX, SUFFIX, INSTRUCTION, QUERY, *DOCUMENTS, '"yes" "no" yes no'] * 8
    tokenizer.train_from_iterator(corpus, vocab_size=310, min_frequency=1, special_tokens=SPECIALS)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if readme is not None:
        (path / "README.md").write_text(f"---\nlicense: apache-2.0\n---\n{readme}\n")
    return hf


@torch.no_grad()
def model_card_scores(hf, folder: Path, documents=DOCUMENTS) -> list[float]:
    """The model card's P(yes) of each document, run alone."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    assert tokenizer.unk_token_id not in (yes, no) and yes != no
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    scores = []
    for document in documents:
        body = f"<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {document}"
        ids = prefix + tokenizer.encode(body, add_special_tokens=False) + suffix
        logits = hf(torch.tensor([ids])).logits[0, -1]
        pair = torch.stack([logits[no], logits[yes]])
        scores.append(torch.log_softmax(pair, dim=0)[1].exp().item())
    return scores


def load(path: Path, generate: bool = False) -> api.Engine:
    return api.load(str(path), device="cpu", generate=generate)


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen3_reranker_folder_scores_as_its_model_card(tmp_path, tied):
    """Tied (0.6B) and untied (4B, 8B) heads; batched as alone; generation refused as for
    the converted GGUF; `show` calls it a reranker."""
    folder = tmp_path / "model"
    hf = write_folder(folder, tied)
    engine = load(folder)
    assert engine.reranks and not engine.generates
    got = engine.rerank(QUERY, DOCUMENTS)
    alone = engine.rerank(QUERY, DOCUMENTS, batch_size=1)
    expected = model_card_scores(hf, folder)
    assert max(expected) - min(expected) > 0.05
    for scores in (got.scores, alone.scores):
        assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) < 1e-5
    with pytest.raises(UsageError, match="is a reranker; use `llmrun rerank`"):
        load(folder, generate=True)
    assert inspect.describe(folder)["reranker"]


def test_a_qwen3_folder_is_a_reranker_as_llama_cpp_decides(tmp_path):
    """By a `# Qwen3-Reranker` heading in README.md, or the folder's name; a plain Qwen3
    folder still generates."""
    plain = tmp_path / "qwen3-tiny"
    write_folder(plain, readme="# Qwen3-0.6B")
    engine = load(plain, generate=True)
    assert engine.generates and not engine.reranks
    with pytest.raises(UsageError, match="a '# Qwen3-Reranker' heading"):
        engine.rerank(QUERY, DOCUMENTS)
    assert not inspect.describe(plain)["reranker"]
    named = tmp_path / "Qwen3-Reranker-tiny"
    write_folder(named, readme=None)
    assert load(named).reranks


def test_a_qwen3_sequence_classifier_is_refused(tmp_path):
    folder = tmp_path / "seq-cls"
    write_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="Qwen3ForSequenceClassification is not supported"):
        load(folder)


def test_a_qwen3_vl_reranker_folder_scores_as_transformers(tmp_path):
    """Qwen3-VL-Reranker, a Qwen3VLForConditionalGeneration recognized as llama.cpp's
    converter recognizes it (conversion/qwen3vl.py's Qwen3VLTextModel is a Qwen3Model): its
    language model scores text as the model card scores transformers' whole model; `show`
    calls it a reranker."""
    folder = tmp_path / "model"
    write_folder(folder, readme="# Qwen3-VL-Reranker-2B")  # the tokenizer and README
    text = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}
    text["rope_scaling"] = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        num_position_embeddings=16, deepstack_visual_indexes=[],
    )  # fmt: skip
    config = transformers.Qwen3VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(config).eval()
    randomize(hf)
    hf.save_pretrained(folder)
    engine = load(folder)
    assert engine.reranks and not engine.generates
    expected = model_card_scores(hf, folder)
    assert max(expected) - min(expected) > 0.01
    got = engine.rerank(QUERY, DOCUMENTS).scores
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-5
    assert inspect.describe(folder)["reranker"]

"""Tiny cross-encoders for the reranking tests, as the Hub and llama.cpp's converter lay
them out, and transformers' scores of them.

The HF folder is what transformers saves of a `*ForSequenceClassification` of one label
(BERT: `bert.` names, its pooler and a `classifier`; XLM-RoBERTa: `roberta.` names and a
`classifier.dense` + `classifier.out_proj`), with a tokenizer.json whose post-processor
joins a pair as the family's does: a WordPiece vocabulary and BERT's template for BERT, a
byte-level BPE one and RoBERTa's (RobertaProcessing) for RoBERTa and XLM-RoBERTa.

The GGUF is what conversion/bert.py writes of it, names mapped by gguf-py's own
TensorNameMap: the pooler dropped (`pooler=True` keeps it as `cls`, a file the converter
does not write but llama.cpp runs as the full head), BERT's classifier renamed
classifier.out_proj (its labels are not AutoConfig's dummy pair), RoBERTa's position table
cut by padding_idx + 1 rows; the vocabulary as the converter writes it (WordPiece words
with the phantom space, special tokens and add_* flags by gguf-py's SpecialVocab from
the folder).
"""

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import randomize

BERT = dict(
    model_type="bert",
    architectures=["BertForSequenceClassification"],
    num_labels=1,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=512,
    max_position_embeddings=128,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    pad_token_id=0,
)
# RoBERTa-style: positions from padding_idx + 1 = 2 (the table two rows longer), one type.
XLM_ROBERTA = dict(
    BERT,
    model_type="xlm-roberta",
    architectures=["XLMRobertaForSequenceClassification"],
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    max_position_embeddings=130,
    type_vocab_size=1,
)
ROBERTA = dict(
    XLM_ROBERTA, model_type="roberta", architectures=["RobertaForSequenceClassification"]
)
KINDS = {"bert": BERT, "roberta": ROBERTA, "xlm-roberta": XLM_ROBERTA}
QUERY = "how many people live in berlin?"
DOCUMENTS = [
    "berlin has a population of about four million people.",
    "the cat sat on the mat.",
    "berlin",
    "people live in many cities, and berlin is one of them, with a river and parks.",
]
_WORDS = "how many people live in berlin has a population of about four million the cat sat"
_WORDS += " on mat cities and is one them with river parks ? , ."


def hf_reranker(kind: str = "bert"):
    """A tiny random transformers cross-encoder (f32, eval) of KINDS[kind]: weights
    N(0, 0.2), LayerNorm scales 1 + N(0, 0.1)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**KINDS[kind])
    model = transformers.AutoModelForSequenceClassification.from_config(config).float().eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.normal_(1.0, 0.1)
    return model


def write_reranker_dir(path: Path, hf) -> Path:
    """hf saved with its family's tokenizer (the module's docstring)."""
    hf.save_pretrained(path)
    if hf.config.model_type == "bert":
        write_wordpiece(path)
    else:
        _write_roberta_bpe(path)
    return path


def write_wordpiece(path: Path) -> None:
    from tokenizers.implementations import BertWordPieceTokenizer
    from tokenizers.processors import TemplateProcessing

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *("##" + c for c in letters)]
    words = sorted(set(_WORDS.split()) - set(vocab))
    vocab += words + [f"w{i}" for i in range(512 - len(vocab) - len(words))]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertWordPieceTokenizer(str(path / "vocab.txt"))
    # BERT's pair template as the Hub's tokenizer.json files write it (the library's
    # default BertProcessing gives the same ids, but gguf-py reads no add_* flags from it).
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _write_roberta_bpe(path: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer = ByteLevelBPETokenizer()
    corpus = [QUERY, *DOCUMENTS, _WORDS] * 4
    tokenizer.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=specials)
    tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "XLMRobertaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def hf_tokenizer(folder: Path):
    """transformers' fast tokenizer of the folder's tokenizer.json (token types where the
    family's tokenizer gives them: BERT's, not XLM-RoBERTa's)."""
    import transformers

    config = json.loads((folder / "tokenizer_config.json").read_text())
    names = ["input_ids", "attention_mask"]
    if config["tokenizer_class"] == "BertTokenizer":
        names.insert(1, "token_type_ids")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        model_input_names=names,
        **{k: v for k, v in config.items() if k.endswith("_token")},
    )


@torch.no_grad()
def reference_scores(hf, folder: Path, query: str = QUERY, documents=DOCUMENTS) -> list[float]:
    """transformers' logits of each (query, document) pair, each run alone, tokenized by
    transformers' tokenizer of the folder."""
    tokenizer = hf_tokenizer(folder)
    out = []
    for document in documents:
        encoded = tokenizer(query, document, return_tensors="pt")
        out.append(hf(**encoded).logits[0, 0].item())
    return out


def converted(hf, pooler: bool = False) -> dict[str, np.ndarray]:
    """hf's tensors as conversion/bert.py writes them (the module's docstring)."""
    config = hf.config
    offset = config.pad_token_id + 1 if config.model_type != "bert" else 0
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)
    out = {}
    for name, t in hf.state_dict().items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith("pooler.dense."):
            if not pooler:
                continue
            name = name.replace("pooler.dense.", "classifier.dense.")
        if name in ("embeddings.position_ids", "embeddings.token_type_ids"):
            continue
        if name in ("classifier.weight", "classifier.bias"):
            name = name.replace("classifier.", "classifier.out_proj.")
        data = t.detach().float()
        if name == "embeddings.position_embeddings.weight":
            data = data[offset:]
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = np.ascontiguousarray(data.numpy())
    return out


def write_reranker_gguf(
    path: Path, hf, folder: Path, qtype=None, pooler: bool = False, pooling=None, drop=()
) -> Path:
    """hf (saved in `folder` with its tokenizer) as conversion/bert.py writes it; 2-D
    weights in `qtype` (default F32) but the position and token-type tables; `pooler`:
    keep BERT's pooler as cls; `pooling`: a pooling_type to write (the converter writes one
    only for a folder with a sentence-transformers Pooling module); `drop`: the tensors
    whose names start so to leave out."""
    config = hf.config
    offset = config.pad_token_id + 1 if config.model_type != "bert" else 0
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings - offset)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(float(config.layer_norm_eps))
    writer.add_causal_attention(False)
    writer.add_file_type(0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_classifier_output_labels(["LABEL_0"])
    if pooling is not None:
        writer.add_pooling_type(pooling)
    writer.add_token_type_count(config.type_vocab_size)
    _add_vocabulary(writer, folder, config.model_type == "bert", config.vocab_size)
    for name, data in converted(hf, pooler).items():
        if drop and name.startswith(tuple(drop)):
            continue
        kept = name.startswith(("position_embd", "token_types"))
        if data.ndim == 1 or qtype is None or kept:
            writer.add_tensor(name, data.astype(np.float32))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(writer: gguf.GGUFWriter, folder: Path, wordpiece: bool, size: int) -> None:
    """The folder's vocabulary as the converter writes it (TextModel.get_vocab_base: the
    ids past the tokenizer's, up to the model's `size`, as unused [PADi] tokens; then
    BertModel.set_vocab's phantom space for WordPiece, RoBERTa's _set_vocab_gpt2 for BPE)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    if wordpiece:
        for i, text in enumerate(tokens):
            if types[i] == gguf.TokenType.NORMAL:
                tokens[i] = text[2:] if text.startswith("##") else "\u2581" + text
        writer.add_tokenizer_model("bert")
        writer.add_tokenizer_pre("default")
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("roberta-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=not wordpiece, n_vocab=len(tokens)).add_to_gguf(writer)


# A causal reranker (Qwen3-Reranker as conversion/qwen.py writes it): a tiny Qwen3 with
# stories260K's vocabulary, its output head's rows of two tokens as "yes" and "no".
YES, NO = 400, 401
RERANK_PROMPT = "Query: {query}\nDocument: {document}\nRelevant:"


def hf_causal_reranker():
    """The tiny random transformers Qwen3ForCausalLM (f32, eval) of embedding_helpers'
    CONFIG (its head tied to the embeddings), 256 positions."""
    import transformers
    from embedding_helpers import CONFIG

    torch.manual_seed(0)
    # Positions for the prompts, which stories260K's small vocabulary makes long.
    config = transformers.AutoConfig.for_model(**{**CONFIG, "max_position_embeddings": 256})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def write_causal_reranker_gguf(
    path: Path, hf, qtype=None, prompt: bool = True, arch: str = "qwen3"
) -> Path:
    """hf as conversion/qwen.py writes a Qwen3-Reranker: pooling_type rank, `cls.output`
    the output head's "yes" and "no" rows, a rerank prompt template (RERANK_PROMPT; none
    without `prompt`), the labels; 2-D weights in `qtype` (default F32). `arch` "qwen3vl":
    as conversion/qwen3vl.py writes Qwen3-VL-Reranker's language model (the same keys and
    tensors under Qwen3-VL's architecture)."""
    from helpers import write_gguf

    head = hf.lm_head.weight.detach().float()
    rows = torch.stack([head[YES], head[NO]]).numpy()

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        if prompt:
            writer.add_chat_template([{"name": "rerank", "template": RERANK_PROMPT}])
        if qtype is None:
            writer.add_tensor("cls.output.weight", rows)
        else:
            raw = gguf.quants.quantize(rows, qtype)
            writer.add_tensor("cls.output.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)

    return write_gguf(
        path, hf.config.to_dict(), hf.state_dict(), qtype=qtype, arch=arch, extra=extra
    )


@torch.no_grad()
def causal_reference(hf, query: str = QUERY, documents=DOCUMENTS) -> list[float]:
    """transformers' probability of "yes" against "no" after each document's prompt (the
    template filled in, tokenized by stories260K's tokenizer.json without BOS), alone."""
    from helpers import STORIES_HF
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(STORIES_HF / "tokenizer.json"))
    out = []
    for document in documents:
        text = RERANK_PROMPT.replace("{query}", query).replace("{document}", document)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        logits = hf(torch.tensor([ids])).logits[0, -1]
        out.append(torch.softmax(logits[[YES, NO]], dim=-1)[0].item())
    return out

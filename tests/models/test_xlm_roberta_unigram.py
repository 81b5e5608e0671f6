"""An XLM-RoBERTa GGUF with its Unigram vocabulary, shaped as bge-m3's (CLS pooling) but tiny:
a real SentencePiece Unigram model trained here (nmt_nfkc, so the file carries a real
precompiled charsmap), written as llama.cpp's converter writes XLMRobertaModel
(conversion/bert.py: "bert" arch, tokenizer model "t5", fairseq's ids), end to end through
`llmrun embed`, `tokenize` and `show`.

The reference: the ids are sentencepiece's own encode of the text, moved to fairseq's ids,
between <s> and </s> (what transformers' XLMRobertaTokenizer gives); the vector is
transformers' XLMRobertaModel's first hidden state of those ids, normalized. Tolerance 1e-4
(f32 states within about ±4).
"""

import json

import gguf
import pytest
import torch
from family_checks import max_diff
from in_process import llmrun
from test_bert import converted, hf_model, reference
from unigram_helpers import add_tokenizer, processor, trained, xlmr_ids

TEXT = "Le café est très bon à Paris, 日本語のテキスト。 Ｆｕｌｌ－ｗｉｄｔｈ １２３ ﬁne?"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """(the GGUF, the transformers model, the SentencePiece model)."""
    proto, metadata = trained("nfkc-xlmr")
    hf = hf_model("xlm-roberta", vocab_size=len(metadata[gguf.Keys.Tokenizer.LIST]))
    path = write_xlmr_gguf(tmp_path_factory.mktemp("xlmr") / "m.gguf", hf, metadata)
    return path, hf, processor(proto)


def write_xlmr_gguf(path, hf, metadata: dict, pooling=gguf.PoolingType.CLS):
    """hf (XLMRobertaModel) as conversion/bert.py writes it, F32, with the tokenizer
    `metadata` (unigram_helpers.xlmr_metadata's); `pooling` the file's (bge-m3's: CLS)."""
    config = hf.config
    offset = config.pad_token_id + 1  # the position rows before padding_idx + 1 are cut
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(config.max_position_embeddings - offset)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(float(config.layer_norm_eps))
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_file_type(0)
    writer.add_token_type_count(config.type_vocab_size)
    add_tokenizer(writer, metadata)
    for name, data in converted(hf).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_ids(sp, text: str) -> list[int]:
    return [0, *xlmr_ids(sp.encode(text)), 2]


def test_embed_matches_transformers_on_sentencepieces_ids(model_files):
    path, hf, sp = model_files
    ids = expected_ids(sp, TEXT)
    assert 3 not in ids  # every character is in the vocabulary
    expected = reference(hf, torch.tensor([ids]))[0][0]
    # The first native call of a test session builds the kernels: minutes on a busy machine.
    result = llmrun("embed", str(path), TEXT, "--json")
    assert result.returncode == 0, result.stderr
    vector = torch.tensor(json.loads(result.stdout)["data"][0]["embedding"])
    assert max_diff(vector, expected / expected.norm()) < 1e-4


def test_tokenize_and_show_name_what_they_read(model_files):
    path, _, sp = model_files
    result = llmrun("tokenize", str(path), TEXT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == expected_ids(sp, TEXT)[:-1]  # <s>, no </s>
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "Unigram" in result.stdout

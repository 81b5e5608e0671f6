"""BERT, RoBERTa and XLM-RoBERTa encoders against transformers' BertModel, RobertaModel and
XLMRobertaModel (last_hidden_state), from a config.json folder (transformers 5's state dict,
and the Hub's BertForMaskedLM-style files with a "bert." prefix, the pooler and MLM heads
and old gamma/beta names) and from a "bert" GGUF written as llama.cpp's converter writes it
(conversion/bert.py: TextModel's shape keys, attention.layer_norm_epsilon, attention.causal
false, tokenizer.ggml.token_type_count; no pooler or heads; RoBERTa's position table cut by
padding_idx + 1 rows and its context length as much).

Its features each move the hidden states by far more than the tolerance (asserted below):
RoBERTa's positions past the padding index, the token-type row added, the position
embeddings, the masking of padded keys, the post-norm placement (the embeddings' LayerNorm
and each sublayer's), the exact GELU against its tanh approximation.

The tiny models: 2 layers, hidden 64, 4 heads of 16, a feed-forward of 96, 128 learned
positions, a 512-token vocabulary (stories260K's, so the GGUFs can be tokenized end to end).

Tolerances: f32 hidden states (LayerNorm'd, within about ±4) 1e-4 max abs against
transformers, whole or in a padded batch against each text alone. A Q8_0 GGUF against
transformers run on the weights gguf dequantizes: 1e-4 (llmrun computes the products of the
dequantized blocks exactly in f32), and against the f32 weights within 0.05.
"""

import json

import numpy as np
import pytest
import torch
from family_checks import dequantize_2d_weights, max_diff, write_keyed_gguf
from helpers import randomize
from in_process import llmrun

from llmrun.embeddings import pool
from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError
from llmrun.loading import bert as loading
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import Weight, load_model
from llmrun.models import bert
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
BERT = dict(
    model_type="bert",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=512,  # stories260K's tokenizer, so the GGUFs can be run end to end
    max_position_embeddings=128,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    pad_token_id=0,
)
# RoBERTa-style: positions from padding_idx + 1 = 2 (the table two rows longer).
ROBERTA = dict(BERT, model_type="roberta", pad_token_id=1, max_position_embeddings=130)
XLM_ROBERTA = dict(ROBERTA, model_type="xlm-roberta", type_vocab_size=1)
KINDS = {"bert": BERT, "roberta": ROBERTA, "xlm-roberta": XLM_ROBERTA}
SEQ = 24
# Ids past the padding ids (0 and 1), so transformers' RoBERTa counts every token.
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(kind: str = "bert", **overrides):
    """A tiny random transformers encoder (BertModel, RobertaModel or XLMRobertaModel;
    f32, eval, no pooler) of KINDS[kind] with `overrides`: weights N(0, 0.2), LayerNorm
    scales 1 + N(0, 0.1)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**KINDS[kind], **overrides})
    model = transformers.AutoModel.from_config(config, add_pooling_layer=False)
    model = model.float().eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.normal_(1.0, 0.1)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).last_hidden_state


def ours(hf) -> torch.nn.Module:
    state = {k: Weight(v) for k, v in hf.state_dict().items()}
    config, weights = loading.hf_checkpoint(hf.config.to_dict(), state, Weight)
    model = bert.Model(bert.ModelArgs.from_config(config))
    model.load_state_dict({k: w.tensor for k, w in weights.items()})
    return model.eval()


def hidden(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.hidden_states(
            ids, torch.arange(ids.shape[1])[None], torch.tensor([ids.shape[1]])
        )


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping for bert).
_NAMES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}


def converted(hf, fuse_qkv: bool = False) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, RoBERTa's position table cut by padding_idx + 1
    rows as RobertaModel.modify_tensors and XLMRobertaModel.modify_tensors cut it; with
    `fuse_qkv`, each layer's queries, keys and values in one attn_qkv (--fuse-qkv)."""
    offset = hf.config.pad_token_id + 1 if hf.config.model_type != "bert" else 0
    out = {}
    for name, t in hf.state_dict().items():
        module, _, suffix = name.rpartition(".")
        data = t.detach().float()
        if module == "embeddings.position_embeddings":
            data = data[offset:]
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = data.numpy()
            continue
        _, _, layer, rest = module.split(".", 3)
        out[f"blk.{layer}.{_NAMES[rest]}.{suffix}"] = np.ascontiguousarray(data.numpy())
    if fuse_qkv:
        for layer in range(hf.config.num_hidden_layers):
            for suffix in ("weight", "bias"):
                parts = [out.pop(f"blk.{layer}.attn_{p}.{suffix}") for p in "qkv"]
                out[f"blk.{layer}.attn_qkv.{suffix}"] = np.concatenate(parts)
    return out


def write_bert_gguf(path, hf, qtype=None, fuse_qkv=False, drop=(), **keys):
    """The model as llama.cpp's converter writes BERT, RoBERTa and XLM-RoBERTa ("bert"):
    BertModel's keys, the position table and context length cut for RoBERTa, 2-D weights
    in `qtype` (default F32) but the position and token-type tables (kept F32, as the
    converter keeps them), stories260K's vocabulary. `keys`: metadata to change
    ("{arch}.…" -> value, None leaves one out); `drop`: tensors to leave out."""
    config = hf.config
    offset = config.pad_token_id + 1 if config.model_type != "bert" else 0
    metadata = {
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.context_length": config.max_position_embeddings - offset,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": config.num_attention_heads,
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_eps),
        "{arch}.attention.causal": False,
        "{arch}.pooling_type": int(gguf.PoolingType.MEAN),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.token_type_count": config.type_vocab_size,
        **keys,
    }
    tensors = {k: v for k, v in converted(hf, fuse_qkv).items() if k not in drop}
    return write_keyed_gguf(
        path, "bert", metadata, tensors, qtype, keep_f32=("position_embd", "token_types")
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_config_json_matches_transformers(kind):
    hf = hf_model(kind)
    expected = reference(hf)
    assert expected.abs().max() > 2
    assert max_diff(hidden(ours(hf)), expected) < 1e-4


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_saved_folder_loads_and_matches_transformers(kind, tmp_path):
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert type(loaded.model).generates is False
    # RoBERTa's table cut by padding_idx + 1 rows: 128 positions either way.
    assert loaded.checkpoint.config["max_position_embeddings"] == 128
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_a_half_precision_folder_matches_its_rounded_weights(kind, tmp_path):
    """Folders saved in f16 (as most of the Hub's embedders are): every table and matrix
    kept half in memory (f16 blocks), computed in f32, as transformers computes the weights
    rounded to f16 in f32."""
    hf = hf_model(kind)
    hf.half().save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(hidden(loaded.model), reference(hf.float())) < 1e-4


def test_the_hubs_masked_lm_names_load_as_transformers_runs_them(tmp_path):
    """BertForMaskedLM-style files: every name under "bert.", LayerNorm gamma/beta, a
    pooler and the MLM head (cls.predictions...), which an encoder's output leaves out."""
    from safetensors.torch import save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    tensors = {}
    for name, t in hf.state_dict().items():
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma")
        tensors["bert." + name.replace("LayerNorm.bias", "LayerNorm.beta")] = t.contiguous()
    tensors["bert.pooler.dense.weight"] = torch.zeros(64, 64)
    tensors["bert.pooler.dense.bias"] = torch.zeros(64)
    tensors["cls.predictions.bias"] = torch.zeros(512)
    tensors["bert.embeddings.position_ids"] = torch.arange(128)[None]
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_padded_batch_gives_each_text_its_states_alone(kind):
    """Rows of 24, 9 and 1 tokens padded on the right to 24 (with ids that are not the
    padding id, so the mask alone keeps them out): each row's real tokens get the states
    the text gets alone; mean and CLS pooling of the batch equal each text's own."""
    hf = hf_model(kind)
    model = ours(hf)
    lengths = torch.tensor([SEQ, 9, 1])
    ids = IDS.repeat(3, 1)
    ids[1:, 9:] = 7
    positions = torch.arange(SEQ).expand(3, SEQ)
    with torch.no_grad():
        batch = model.hidden_states(ids, positions, lengths)
    for row, n in enumerate(lengths.tolist()):
        alone = reference(hf, IDS[:, :n])[0]
        assert max_diff(batch[row, :n], alone) < 1e-4
        for pooling, expected in (("mean", alone.mean(dim=0)), ("cls", alone[0])):
            pooled = pool(batch, lengths, pooling)[row]
            assert max_diff(pooled, expected) < 1e-4, pooling


def test_each_feature_moves_the_hidden_states():
    """What llmrun must follow to match (above) moves transformers' output by far more than
    the tolerance: RoBERTa's position offset, the token-type row, the position embeddings,
    padded keys (unmasked), the exact GELU; and the embeddings' LayerNorm bias."""
    hf = hf_model("roberta")
    expected = reference(hf)
    # RoBERTa's positions past the padding index: position p reads row p + 2 (uncut, row p).
    as_bert = bert.Model(bert.ModelArgs.from_config(hf.config.to_dict()))
    as_bert.load_state_dict(hf.state_dict())
    assert max_diff(hidden(as_bert.eval()), expected) > 0.1
    for suffix in (
        "token_type_embeddings.weight",
        "position_embeddings.weight",
        "embeddings.LayerNorm.bias",
    ):
        changed = hf_model("roberta")
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        assert max_diff(reference(changed), expected) > 0.1, suffix
    # The two GELUs differ by at most 1e-3 an activation: several times the tolerance here.
    tanh = hf_model("roberta", hidden_act="gelu_new")
    assert max_diff(reference(tanh), expected) > 3e-4
    # Padding that is attended to moves the real tokens' states.
    model = ours(hf)
    ids = torch.cat([IDS[:, :9], torch.full((1, 15), 7)], dim=1)
    with torch.no_grad():
        unmasked = model.hidden_states(ids, torch.arange(SEQ)[None], torch.tensor([SEQ]))
    assert max_diff(unmasked[0, :9], reference(hf, IDS[:, :9])[0]) > 0.1


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_gguf_matches_transformers(kind, tmp_path):
    hf = hf_model(kind)
    path = write_bert_gguf(tmp_path / "m.gguf", hf)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "bert" and config["max_position_embeddings"] == 128
    assert loaded.checkpoint.pooling == "mean"
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


def test_a_gguf_with_fused_qkv_and_without_token_types_matches(tmp_path):
    """The converter's --fuse-qkv writes attn_qkv (weight and bias); a file without
    token_types (llama.cpp's tensor is optional) adds nothing for the token type."""
    hf = hf_model()
    path = write_bert_gguf(tmp_path / "f.gguf", hf, fuse_qkv=True)
    assert "blk.0.attn_qkv.weight" in read_gguf(path, with_tensors=False).tensors
    assert max_diff(hidden(load_model(path, CPU, "f32").model), reference(hf)) < 1e-4
    with torch.no_grad():
        hf.embeddings.token_type_embeddings.weight.zero_()
    path = write_bert_gguf(tmp_path / "t.gguf", hf, drop=("token_types.weight",))
    assert max_diff(hidden(load_model(path, CPU, "f32").model), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model("xlm-roberta")
    f32 = reference(hf)
    path = write_bert_gguf(tmp_path / "q.gguf", hf, q8)
    tensors = read_gguf(path, with_tensors=False).tensors
    assert tensors["blk.0.attn_q.weight"].ggml_type == q8
    assert tensors["token_embd.weight"].ggml_type == q8
    assert tensors["position_embd.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    got = hidden(load_model(path, CPU, "f32").model)
    # Only what the file quantizes: the position and token-type tables stay F32.
    dequantized = hf_model("xlm-roberta")
    kept = {
        n: p.clone()
        for n, p in dequantized.named_parameters()
        if "position_embeddings" in n or "token_type" in n
    }
    dequantize_2d_weights(dequantized, q8)
    with torch.no_grad():
        for n, p in dequantized.named_parameters():
            if n in kept:
                p.copy_(kept[n])
    assert max_diff(got, reference(dequantized)) < 1e-4
    assert 1e-4 < max_diff(got, f32) < 0.05


def test_what_the_encoder_cannot_run_is_refused(tmp_path):
    hf = hf_model()
    with pytest.raises(UnsupportedError, match="decoder"):
        bert.ModelArgs.from_config({**hf.config.to_dict(), "is_decoder": True})
    with pytest.raises(UnsupportedError, match="relative_key"):
        bert.ModelArgs.from_config(
            {**hf.config.to_dict(), "position_embedding_type": "relative_key"}
        )
    causal = write_bert_gguf(tmp_path / "c.gguf", hf, **{"{arch}.attention.causal": True})
    with pytest.raises(UnsupportedError, match="causal is true"):
        load_model(causal, CPU, "f32")
    unsaid = write_bert_gguf(tmp_path / "u.gguf", hf, **{"{arch}.attention.causal": None})
    with pytest.raises(UnsupportedError, match="causal is missing"):
        load_model(unsaid, CPU, "f32")
    no_types = write_bert_gguf(tmp_path / "n.gguf", hf, **{"tokenizer.ggml.token_type_count": None})
    with pytest.raises(ModelFormatError, match="token_type_count"):
        load_model(no_types, CPU, "f32")
    no_eps = write_bert_gguf(
        tmp_path / "e.gguf", hf, **{"{arch}.attention.layer_norm_epsilon": None}
    )
    with pytest.raises(ModelFormatError, match="layer_norm_epsilon"):
        load_model(no_eps, CPU, "f32")


def test_a_reranker_head_makes_a_reranker_not_an_embedder(tmp_path):
    """A classifier head (cls.output) is a cross-encoder's: `embed` refuses it with a
    pointer to `rerank` (tests/test_reranking.py holds its scores to transformers')."""
    hf = hf_model()
    path = tmp_path / "r.gguf"
    tensors = converted(hf)
    tensors["cls.output.weight"] = np.zeros((1, 64), dtype=np.float32)
    keys = {
        "{arch}.block_count": 2,
        "{arch}.context_length": 128,
        "{arch}.embedding_length": 64,
        "{arch}.feed_forward_length": 96,
        "{arch}.attention.head_count": 4,
        "{arch}.attention.layer_norm_epsilon": 1e-12,
        "{arch}.attention.causal": False,
        "tokenizer.ggml.token_type_count": 2,
    }
    write_keyed_gguf(path, "bert", keys, tensors)
    assert load_model(path, CPU, "f32").checkpoint.config["classifier_labels"] == 1
    result = llmrun("embed", str(path), "Once upon a time")
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {path} is a reranker; use `llmrun rerank`\n"


def test_positions_past_the_table_are_a_full_context():
    model = ours(hf_model("roberta"))
    ids = torch.randint(3, 512, (1, 129))
    with pytest.raises(ContextOverflowError, match="128 learned positions"):
        hidden(model, ids)


def test_no_decode_step_or_cache_is_attached(tmp_path):
    """An encoder runs whole sequences without a KV cache: the native decode step (for
    causal families) does not take it, and the model offers no cache."""
    loaded = load_model(write_bert_gguf(tmp_path / "m.gguf", hf_model()), CPU, "f32")
    assert decode_step.attach(loaded.model) is False
    assert getattr(loaded.model, "decode_step", None) is None
    assert not hasattr(loaded.model, "new_cache")


def test_show_describes_the_gguf_and_a_folder(tmp_path):
    path = write_bert_gguf(tmp_path / "m.gguf", hf_model())
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "bert (embedding model)" in result.stdout
    assert "none (an encoder)" in result.stdout
    assert inspect.describe(path)["architecture"] == "bert"
    hf_model("xlm-roberta").save_pretrained(tmp_path / "hf")
    info = inspect.describe(tmp_path / "hf")
    # RoBERTa's 130 rows less the padding_idx + 1 never read.
    assert info["context_length"] == 128 and info["kv_cache_bytes_8k"] == 0


def test_run_refuses_an_encoder(tmp_path):
    path = write_bert_gguf(tmp_path / "m.gguf", hf_model())
    result = llmrun("run", str(path), "Once upon a time", "-n", "4")
    assert result.returncode != 0
    assert "embedding model" in result.stderr and "llmrun embed" in result.stderr
    assert "Traceback" not in result.stderr


def test_embed_prints_the_pooled_normalized_vector(tmp_path):
    """`llmrun embed` on a bert GGUF: the file's mean pooling of transformers' states of the
    tokens the GGUF's tokenizer gives, normalized."""
    from llmrun.tokenizer import load_tokenizer

    hf = hf_model()
    path = write_bert_gguf(tmp_path / "m.gguf", hf)
    ids = load_tokenizer(path).encode_sequence("Once upon a time")
    expected = reference(hf, torch.tensor([ids]))[0].mean(dim=0)
    expected = expected / expected.norm()
    result = llmrun("embed", str(path), "Once upon a time", "--json")
    assert result.returncode == 0, result.stderr
    vector = torch.tensor(json.loads(result.stdout)["data"][0]["embedding"])
    assert max_diff(vector, expected) < 1e-4


def write_sentence_transformers_folder(path, hf, pooling: str):
    """hf saved as a sentence-transformers model is: the transformers folder, a BERT
    tokenizer.json over a 512-token vocabulary, modules.json naming the Transformer, a
    Pooling module (`pooling`: "mean" or "cls") and Normalize."""
    from tokenizers.implementations import BertWordPieceTokenizer

    hf.save_pretrained(path)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = ["once", "upon", "time", "hello", "world", ",", "!", "."]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *("##" + c for c in letters)]
    vocab += words + [f"w{i}" for i in range(512 - len(vocab) - len(words))]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertWordPieceTokenizer(str(path / "vocab.txt")).save(str(path / "tokenizer.json"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = {
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": pooling == "cls",
    }
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **flags})
    )
    (path / "2_Normalize").mkdir()
    return path


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embed_on_a_sentence_transformers_folder(pooling, tmp_path):
    """`llmrun embed` on a BERT folder: its tokenizer.json's [CLS] text [SEP], the pooling
    its Pooling module names, normalized as its Normalize module says."""
    from tokenizers import Tokenizer as Backend

    hf = hf_model()
    folder = write_sentence_transformers_folder(tmp_path / "st", hf, pooling)
    text = "Once upon a time, hello world!"
    ids = Backend.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert ids[0] == 2 and ids[-1] == 3 and 1 not in ids  # [CLS] ... [SEP], no [UNK]
    states = reference(hf, torch.tensor([ids]))[0]
    expected = states[0] if pooling == "cls" else states.mean(dim=0)
    result = llmrun("embed", str(folder), text, "--json")
    assert result.returncode == 0, result.stderr
    vector = torch.tensor(json.loads(result.stdout)["data"][0]["embedding"])
    assert max_diff(vector, expected / expected.norm()) < 1e-4

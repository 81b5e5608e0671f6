"""EuroBERT against transformers' EuroBertModel (last_hidden_state; pooled by hand and
normalized as the folder's sentence-transformers modules say), from a folder (EuroBertModel's
names as transformers saves them, and the Hub's EuroBertForMaskedLM layout: a "model." prefix
and an lm_head) and from the GGUFs llama.cpp's converter writes of that folder (F32, Q8_0,
and F16 with --fuse-qkv: each layer's q, k and v rows in one attn_qkv).

The folder is a sentence-transformers one (embedding_helpers.write_embedding_dir: last-token
pooling, normalized, as jina-embeddings-v5-text-nano pools its EuroBERT; stories260K's
tokenizer with a `</s>` appended), its config.json's classifier_pooling "mean": transformers
5 writes its default "late", which the converter refuses (conversion/base.py
_try_set_pooling_type takes cls or mean); it concerns the classifier head alone.

Planted bugs move the states by far more than the tolerance (asserted below): a causal mask,
a wrong RoPE base, and llama.cpp's q/k permutation undone where the converter made none.

The tiny model: 2 layers, hidden 64, 4 heads of 16 over 2 KV heads, a feed-forward of 96,
128 positions, stories260K's 512-token vocabulary; texts of 24 tokens.

Tolerances: f32 hidden states (within about ±4) and unit vectors 1e-4 max abs against
transformers, whole or in a padded batch against each text alone. The F16 and Q8_0 GGUFs
against transformers run on the weights rounded to f16 or through gguf's Q8_0: 1e-4.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from embedding_helpers import TEXTS, reference, write_embedding_dir
from family_checks import dequantize_2d_weights, max_diff, write_keyed_gguf
from helpers import needs_converter, randomize
from in_process import llmrun
from llama_converter import run_converter
from serving import served

from llmrun import api
from llmrun.embeddings import embed_ids
from llmrun.errors import UnsupportedError
from llmrun.loading import gguf_config
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model, open_checkpoint
from llmrun.models import eurobert
from llmrun.models.base import RotaryEmbedding

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="eurobert",
    architectures=["EuroBertModel"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # stories260K's tokenizer, so the files can be run end to end
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    mask_token_id=3,
)
SEQ = 24
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def hf_model():
    """The tiny random EuroBertModel (f32, eval) of CONFIG: weights N(0, 0.2), RMSNorm
    scales 1 + N(0, 0.1)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModel.from_config(config).float().eval()
    randomize(model)
    return model


def reference_states(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).last_hidden_state


def states(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.hidden_states(ids, torch.arange(ids.shape[1])[None], torch.tensor([SEQ]))


def rounded(hf, qtype):
    """A copy of `hf` whose 2-D weights are those a GGUF of `qtype` holds (F16 or Q8_0)."""
    copy = hf_model()
    copy.load_state_dict(hf.state_dict())
    if qtype == gguf.GGMLQuantizationType.F16:
        with torch.no_grad():
            for p in copy.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
    else:
        dequantize_2d_weights(copy, qtype)
    return copy


def ids_of(model_path, texts):
    engine = api.load(str(model_path), device="cpu", generate=False)
    return [engine.tokenizer.encode_sequence(t) for t in texts]


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def write_folder(path, hf):
    """`hf` as the sentence-transformers folder of the module's docstring, at `path`."""
    write_embedding_dir(path, hf, "pooling_mode_lasttoken")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "classifier_pooling": "mean"}))
    return path


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("eurobert"), hf)


@pytest.fixture(scope="module")
def ggufs(folder, tmp_path_factory):
    """The converter's GGUFs of the folder: "f32", "q8_0" and "f16" (with --fuse-qkv)."""
    out = tmp_path_factory.mktemp("eurobert-gguf")
    flags = {"f32": "--outtype f32", "q8_0": "--outtype q8_0", "f16": "--outtype f16 --fuse-qkv"}
    files = {kind: out / f"{kind}.gguf" for kind in flags}
    run_converter(folder, {files[kind]: flags[kind] for kind in flags})
    return files


def test_the_folder_matches_transformers(hf, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "eurobert"
    assert (loaded.checkpoint.pooling, loaded.checkpoint.normalized) == ("last", True)
    assert type(loaded.model).generates is False
    expected = reference_states(hf)
    assert expected.abs().max() > 2
    assert max_diff(states(loaded.model), expected) < 1e-4
    engine = api.load(str(folder), device="cpu", generate=False)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    assert max_diff(engine.embed(TEXTS, batch_size=4).vectors, reference(hf, ids)) < 1e-4


def test_a_padded_batch_gives_each_text_its_states_and_vectors_alone(hf, folder):
    model = load_model(folder, CPU, "f32").model
    lengths = torch.tensor([SEQ, 9, 1])
    ids = IDS.repeat(3, 1)
    ids[1:, 9:] = 7
    with torch.no_grad():
        batch = model.hidden_states(ids, torch.arange(SEQ).expand(3, SEQ), lengths)
    for row, n in enumerate(lengths.tolist()):
        assert max_diff(batch[row, :n], reference_states(hf, IDS[:, :n])[0]) < 1e-4
    inputs = [IDS[0, :n].tolist() for n in lengths.tolist()]
    for pooling in ("last", "mean", "cls"):
        got = embed_ids(model, inputs, pooling, batch_size=3)
        assert max_diff(got, reference(hf, inputs, pooling)) < 1e-4, pooling


def test_the_hubs_masked_lm_files_load_and_a_classifier_is_refused(hf, tmp_path):
    from safetensors.torch import save_file

    hf.save_pretrained(tmp_path)
    tensors = {f"model.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    tensors["lm_head.weight"] = torch.zeros(512, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    assert max_diff(states(load_model(tmp_path, CPU, "f32").model), reference_states(hf)) < 1e-4
    save_file({**tensors, "classifier.weight": torch.zeros(2, 64)}, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedError, match="'classifier.weight' is a classifier head"):
        open_checkpoint(tmp_path)


def test_a_jina_v5_folder_with_task_adapters_is_refused(hf, tmp_path):
    """Its base weights alone are not jina-embeddings-v5: an adapter per task goes on them."""
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["JinaEmbeddingsV5Model"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "adapters" / "retrieval").mkdir(parents=True)
    with pytest.raises(UnsupportedError, match="a LoRA adapter per task"):
        open_checkpoint(tmp_path)


def test_planted_bugs_move_the_states(hf, folder, monkeypatch):
    """A causal mask or a RoPE of another base each move llmrun's states by far more than
    the tolerance."""
    expected = reference_states(hf)
    model = load_model(folder, CPU, "f32").model

    def causal(q, k, v, mask):
        batch, heads, tokens, head_dim = q.shape
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)

    with monkeypatch.context() as patched:
        patched.setattr(eurobert, "encoder_attention", causal)
        assert max_diff(states(model), expected) > 0.1
    model.rotary_emb = RotaryEmbedding({"rope_type": "default", "rope_theta": 100.0}, 16, 128)
    assert max_diff(states(model), expected) > 0.1


@needs_converter
def test_the_converters_ggufs_match_transformers(hf, ggufs, monkeypatch):
    expected = reference_states(hf)
    for kind, path in ggufs.items():
        loaded = load_model(path, CPU, "f32")
        assert loaded.checkpoint.config["model_type"] == "eurobert", kind
        assert loaded.checkpoint.pooling == "last", kind
        got = states(loaded.model)
        if kind == "f32":
            assert max_diff(got, expected) < 1e-4
            continue
        qtype = gguf.GGMLQuantizationType.F16 if kind == "f16" else Q8_0
        assert read_gguf(path, with_tensors=False).tensors["token_embd.weight"].ggml_type == qtype
        assert max_diff(got, reference_states(rounded(hf, qtype))) < 1e-4, kind
        assert max_diff(got, expected) > 1e-5, kind  # the rounding is seen
    assert "blk.0.attn_qkv.weight" in read_gguf(ggufs["f16"], with_tensors=False).tensors
    # llama.cpp rotates EuroBERT's halves (NEOX): undoing Llama's permutation breaks it.
    monkeypatch.setattr(
        gguf_config, "QK_PERMUTED_ARCHS", (*gguf_config.QK_PERMUTED_ARCHS, "eurobert")
    )
    assert max_diff(states(load_model(ggufs["f32"], CPU, "f32").model), expected) > 0.1


@needs_converter
def test_llmrun_embed_serve_and_show_on_the_folder_and_the_gguf(hf, folder, ggufs):
    result = llmrun("embed", str(folder), *TEXTS[:2])
    assert result.returncode == 0, result.stderr
    got = torch.tensor([json.loads(line) for line in result.stdout.splitlines()])
    assert max_diff(got, reference(hf, ids_of(folder, TEXTS[:2]))) < 1e-4
    engine = api.load(str(ggufs["f32"]), device="cpu", generate=False)
    for http in served(engine, "eurobert"):
        response = http.post("/v1/embeddings", json={"input": TEXTS, "model": "eurobert"})
        assert response.status_code == 200, response.text
        vectors = torch.tensor([d["embedding"] for d in response.json()["data"]])
    assert max_diff(vectors, reference(hf, ids_of(ggufs["f32"], TEXTS))) < 1e-4
    result = llmrun("show", str(ggufs["f32"]))
    assert result.returncode == 0, result.stderr
    assert "eurobert" in result.stdout and "none (an encoder)" in result.stdout


def test_a_gguf_that_attends_causally_is_refused(hf, tmp_path):
    """A "eurobert" file without attention.causal false: llama.cpp would attend causally."""
    config = hf.config
    keys = {
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": config.num_attention_heads,
        "{arch}.attention.head_count_kv": config.num_key_value_heads,
        "{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
    }
    path = write_keyed_gguf(tmp_path / "c.gguf", "eurobert", keys, {})
    result = llmrun("embed", str(path), "hi")
    assert result.returncode != 0
    assert "error: " in result.stderr and "attention.causal is missing" in result.stderr

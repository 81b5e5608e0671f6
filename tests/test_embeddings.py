"""Embeddings against transformers: Qwen3-Embedding (last-token pooling, an appended
end-of-text token, normalized) from a sentence-transformers folder and from a GGUF as
llama.cpp's converter writes it, single texts and padded batches; mean pooling of a tiny
Llama and of stories260K's GGUF (--pooling on a model that names none); the pooling math
by hand; the tokens, the context limit and the refusals."""

import json
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import pytest
import torch
from embedding_helpers import (
    EOS,
    TEXTS,
    cosine,
    hf_model,
    reference,
    write_embedding_dir,
    write_embedding_gguf,
)
from helpers import STORIES_GGUF, STORIES_HF, our_model, save_hf_dir, tiny_hf_model
from in_process import llmrun

from llmrun import api, embeddings
from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import inspect
from llmrun.loading.loader import open_checkpoint
from llmrun.models import llama
from llmrun.models.base import final_hidden_states
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

COSINE, ABS = 1e-5, 1e-4


@pytest.fixture(scope="module")
def qwen3():
    return hf_model()


@pytest.fixture(scope="module")
def st_dir(qwen3, tmp_path_factory):
    return write_embedding_dir(tmp_path_factory.mktemp("qwen3-embedding"), qwen3)


@pytest.fixture(scope="module")
def st_engine(st_dir):
    return api.load(str(st_dir), device="cpu", generate=False)


def close(ours: torch.Tensor, theirs: torch.Tensor, atol: float = ABS) -> None:
    assert ours.shape == theirs.shape
    assert (1 - cosine(ours, theirs)).max() < COSINE
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


# ---- pooling and normalization by hand ------------------------------------------------


def test_pooling_by_hand():
    hidden = torch.tensor(
        [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[7.0, 8.0], [9.0, 10.0], [99.0, 99.0]]]
    )
    lengths = torch.tensor([3, 2])
    assert embeddings.pool(hidden, lengths, "mean").tolist() == [[3.0, 4.0], [8.0, 9.0]]
    assert embeddings.pool(hidden, lengths, "cls").tolist() == [[1.0, 2.0], [7.0, 8.0]]
    assert embeddings.pool(hidden, lengths, "last").tolist() == [[5.0, 6.0], [9.0, 10.0]]
    unit = embeddings.normalize(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    # a zero vector stays zero, no NaN
    assert torch.equal(unit, torch.tensor([[0.6, 0.8], [0.0, 0.0]]))


def test_pooling_none_and_unknown_are_refused():
    with pytest.raises(UsageError, match="pooling none gives a vector per token"):
        embeddings.check_pooling("none", "m")
    with pytest.raises(UsageError, match="names no pooling"):
        embeddings.check_pooling(None, "m")
    with pytest.raises(UsageError, match="unknown pooling 'max'"):
        embeddings.check_pooling("max", "m")


# ---- Qwen3-Embedding ------------------------------------------------------------------


def test_sentence_transformers_folder_reads_pooling_and_base_model_weights(st_dir):
    checkpoint = open_checkpoint(st_dir)
    assert (checkpoint.pooling, checkpoint.normalized) == ("last", True)
    assert "model.embed_tokens.weight" in checkpoint.weights  # Qwen3Model's keys, renamed
    assert "lm_head.weight" not in checkpoint.weights
    assert checkpoint.generates  # tied: its embeddings are its head


def test_texts_get_the_tokenizers_end_of_text_as_transformers_adds_it(st_dir, st_engine):
    theirs = transformers.AutoTokenizer.from_pretrained(st_dir)(TEXTS)["input_ids"]
    ours = [st_engine.tokenizer.encode_sequence(t) for t in TEXTS]
    assert ours == theirs
    assert all(ids[-1] == EOS for ids in ours)
    assert all(
        ids[:-1] == st_engine.tokenizer.encode(t) for ids, t in zip(ours, TEXTS, strict=True)
    )


def test_qwen3_embedding_folder_equals_transformers(qwen3, st_engine):
    ids = [st_engine.tokenizer.encode_sequence(t) for t in TEXTS]
    theirs = reference(qwen3, ids)
    for text, vector in zip(TEXTS, theirs, strict=True):  # each alone
        close(st_engine.embed([text]).vectors[0], vector)
    batch = st_engine.embed(TEXTS, batch_size=4)  # one padded forward of four lengths
    close(batch.vectors, theirs)
    assert batch.tokens == [len(i) for i in ids]
    assert torch.linalg.vector_norm(batch.vectors, dim=-1).sub(1).abs().max() < 1e-6
    # The appended end-of-text token is what the model card pools: without it, another vector.
    without = reference(qwen3, [i[:-1] for i in ids])
    assert (1 - cosine(without, theirs)).min() > 1e-3


def test_batching_does_not_change_a_vector(st_engine):
    alone = torch.cat([st_engine.embed([t]).vectors for t in TEXTS])
    for size in (1, 2, 3):
        torch.testing.assert_close(
            st_engine.embed(TEXTS, batch_size=size).vectors, alone, atol=1e-6, rtol=0
        )


def test_pooling_option_overrides_the_files(qwen3, st_engine):
    ids = [st_engine.tokenizer.encode_sequence(t) for t in TEXTS]
    for pooling in ("mean", "cls"):
        ours = st_engine.embed(TEXTS, pooling=pooling, normalized=False).vectors
        close(ours, reference(qwen3, ids, pooling, normalize=False))
    raw = st_engine.embed(TEXTS, normalized=False).vectors
    close(raw, reference(qwen3, ids, normalize=False))
    assert (torch.linalg.vector_norm(raw, dim=-1) - 1).abs().min() > 1e-2  # normalizing matters


def test_token_ids_are_embedded_as_given(qwen3, st_engine):
    ids = [[5, 6, 7], [9, 10, 11, 12, 13]]
    close(st_engine.embed(ids).vectors, reference(qwen3, ids))


@pytest.mark.parametrize(
    "qtype, atol",
    [(gguf.GGMLQuantizationType.F32, ABS), (gguf.GGMLQuantizationType.Q8_0, None)],
)
def test_qwen3_embedding_gguf_equals_transformers(qwen3, st_engine, tmp_path, qtype, atol):
    path = write_embedding_gguf(tmp_path / "qwen3-embedding.gguf", qwen3, qtype)
    engine = api.load(str(path), device="cpu", generate=False)
    assert engine.checkpoint.pooling == "last"
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    # add_eos_token: the end-of-text token appended, as to the folder's texts
    assert all(
        i[-1] == EOS and i[:-1] == engine.tokenizer.encode(t)
        for i, t in zip(ids, TEXTS, strict=True)
    )
    assert ids == [st_engine.tokenizer.encode_sequence(t) for t in TEXTS]
    ours = engine.embed(TEXTS, batch_size=4).vectors
    if atol is not None:
        close(ours, reference(qwen3, ids))
        return
    # Q8_0 weights: against transformers with the same dequantized weights, exactly as F32
    # is; and within Q8_0's rounding of the f32 model.
    state = qwen3.state_dict()
    dequantized = {}
    for name, tensor in state.items():
        if tensor.dim() == 2:
            raw = gguf.quants.quantize(tensor.numpy(), qtype)
            tensor = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
        dequantized[name] = tensor
    rounded = hf_model()
    rounded.load_state_dict(dequantized)
    close(ours, reference(rounded, ids))
    assert (1 - cosine(ours, reference(qwen3, ids))).max() < 1e-3


def test_a_text_longer_than_the_context_is_an_error_or_cut(st_engine):
    long_text = " ".join(["dog"] * 100)
    tokens = len(st_engine.tokenizer.encode_sequence(long_text))
    with pytest.raises(ContextOverflowError, match=f"text 0 is {tokens} tokens long.*64 tokens"):
        st_engine.embed([long_text])
    cut = embeddings.tokenize(st_engine.tokenizer, [long_text], 64, truncate=True)[0]
    assert len(cut) == 64 and cut[-1] == EOS  # the end-of-text token kept last
    assert st_engine.embed([long_text], truncate=True).tokens == [64]


def test_inputs_are_texts_or_ids_in_the_vocabulary(st_engine):
    with pytest.raises(UsageError, match="token ids must be in"):
        st_engine.embed([[1, 600]])
    with pytest.raises(UsageError, match="all texts or all token ids"):
        st_engine.embed(["a", [1, 2]])
    with pytest.raises(UsageError, match="input 0 is empty"):
        st_engine.embed([[]])


def test_a_base_model_without_a_head_of_its_own_cannot_generate(tmp_path):
    untied = write_embedding_dir(tmp_path / "m", hf_model(tie_word_embeddings=False))
    assert not open_checkpoint(untied).generates
    with pytest.raises(UsageError, match="is an embedding model; use `llmrun embed`"):
        api.load(str(untied), device="cpu")
    engine = api.load(str(untied), device="cpu", generate=False)
    assert not engine.generates
    assert engine.embed(["hi"]).vectors.shape == (1, 64)


def test_a_dense_module_is_refused_by_name(qwen3, tmp_path):
    folder = write_embedding_dir(tmp_path / "m", qwen3)
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedError, match="'2_Dense' is a sentence_transformers.models.Dense"):
        open_checkpoint(folder)


def test_unsupported_poolings_are_refused(qwen3, tmp_path):
    folder = write_embedding_dir(tmp_path / "m", qwen3, pooling="pooling_mode_max_tokens")
    with pytest.raises(UnsupportedError, match="pooling_mode_max_tokens is not supported"):
        open_checkpoint(folder)

    # A reranker's pooling (tests/test_reranking.py), without the head it needs.
    path = write_embedding_gguf(tmp_path / "rank.gguf", qwen3, pooling=gguf.PoolingType.RANK)
    with pytest.raises(ModelFormatError, match="a qwen3 reranker's cls.output.weight is missing"):
        open_checkpoint(path)


def test_a_decoder_gguf_with_non_causal_attention_is_refused(qwen3, tmp_path):
    path = write_embedding_gguf(tmp_path / "b.gguf", qwen3, causal=False)
    with pytest.raises(UnsupportedError, match="non-causal attention"):
        api.load(str(path), device="cpu", generate=False)


# ---- mean pooling of causal models that name no pooling ---------------------------------


def test_mean_pooling_of_a_tiny_llama_folder_equals_transformers(tmp_path):
    model, _ = tiny_hf_model("llama")
    folder = save_hf_dir(model, tmp_path / "llama", tokenizer=True)
    engine = api.load(str(folder), device="cpu")
    assert engine.checkpoint.pooling is None
    with pytest.raises(UsageError, match="names no pooling"):
        engine.embed(TEXTS)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    assert all(i[0] == 1 for i in ids)  # BOS, as its tokenizer.json adds it
    theirs = reference(model.model, ids, "mean", normalize=False)
    close(engine.embed(TEXTS, pooling="mean", normalized=False).vectors, theirs)
    close(engine.embed(TEXTS, pooling="mean").vectors, torch.nn.functional.normalize(theirs))


def test_stories260k_gguf_mean_pooled_equals_transformers_llama_model():
    engine = api.load(str(STORIES_GGUF), device="cpu")
    model = transformers.AutoModel.from_pretrained(STORIES_HF, dtype=torch.float32).eval()
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    close(engine.embed(TEXTS, pooling="mean").vectors, reference(model, ids, "mean"))


def test_hidden_states_are_refused_for_a_forward_without_head_logits():
    class OwnForward(llama.Model):
        def forward(self, input_ids, positions, cache=None, last_only=False, last=None):
            return self.lm_head(self.model.embed_tokens(input_ids))

    model, config = tiny_hf_model("llama")
    ours = OwnForward(llama.ModelArgs.from_config(config))
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(UnsupportedError, match="hidden states for embeddings are not supported"):
        ours.hidden_states(ids, torch.arange(3)[None], torch.tensor([3]))


def test_show_prints_the_pooling(qwen3, st_dir, tmp_path):
    path = write_embedding_gguf(tmp_path / "m.gguf", qwen3)
    assert inspect.describe(path)["pooling"] == "last"
    assert not inspect.describe(path)["embedding_model"]  # a decoder: it may generate
    assert inspect.describe(st_dir)["pooling"] == "last, normalized"
    assert inspect.describe(STORIES_GGUF)["pooling"] is None
    shown = llmrun("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "\npooling        last\n" in shown.stdout
    assert "\narchitecture   qwen3\n" in shown.stdout
    # An encoder's GGUF (non-causal attention, as conversion/bert.py writes it) is marked.
    marked = write_embedding_gguf(
        tmp_path / "e.gguf", qwen3, pooling=gguf.PoolingType.CLS, causal=False
    )
    described = inspect.describe(marked)
    assert described["embedding_model"] and described["pooling"] == "cls"
    ui_lines = llmrun("show", str(marked)).stdout
    assert "\narchitecture   qwen3 (embedding model)\n" in ui_lines


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3", "phi3", "gemma", "gemma2", "gemma3"])
def test_hidden_states_are_the_base_models_for_families_with_their_own_forward(name):
    """final_hidden_states through each family's own forward (Gemma's scaled embeddings,
    Gemma 2/3's soft-capped logits, sliding windows of 5 under rows of 12) equals
    transformers' base model's last_hidden_state, row by row of a padded batch."""
    model, config = tiny_hf_model(name)
    ours = our_model(config, model.state_dict())
    lengths = torch.tensor([12, 7, 3])
    ids = torch.randint(3, 500, (3, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(3, 12)
    with torch.no_grad():
        states = final_hidden_states(ours, ids, positions, lengths)
        for row, length in enumerate(lengths.tolist()):
            theirs = model.model(ids[row : row + 1, :length]).last_hidden_state[0]
            torch.testing.assert_close(states[row, :length], theirs, atol=ABS, rtol=0)


def test_embedding_beside_generation_on_another_thread_changes_neither():
    """serve's scheduler generates on its thread while /v1/embeddings runs the same model
    on another: hidden states are taken per thread (base._HIDDEN), so the logits stay
    logits and the vectors stay the vectors."""
    engine = api.load(None, device="cpu")
    prompt = engine.tokenizer.encode("Once upon a time")

    def story() -> str:
        greedy = SamplingParams(temperature=0)
        return "".join(r.text for r in engine.generate(prompt, greedy, 60))

    def vectors() -> torch.Tensor:
        return torch.cat([engine.embed(TEXTS, "mean").vectors for _ in range(6)])

    alone = story(), vectors()
    with ThreadPoolExecutor(2) as pool:
        told, embedded = pool.submit(story), pool.submit(vectors)
        assert told.result() == alone[0]
        assert torch.equal(embedded.result(), alone[1])

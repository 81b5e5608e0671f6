"""The KL-divergence pair: a base model's log-probs saved as a safetensors file that the
safetensors library reads, then another model compared with them; the statistics held
to the same quantities computed with transformers in float64, and a base file of
another tokenizer, a truncated one and a model's weights refused in one line."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import STORIES_GGUF, STORIES_HF, save_hf_dir
from test_perplexity import BOS, STORY, reference_tokens

from llmrun import api, perplexity
from llmrun import kl_divergence as kld
from llmrun.errors import ModelFormatError, UsageError
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

CTX = 48


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """stories260K (the base) and a copy with noise on every weight (the "quantized" one),
    as transformers models, and the copy's folder."""
    base = transformers.AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    other = transformers.AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std())
    folder = save_hf_dir(other, tmp_path_factory.mktemp("noisy") / "noisy", tokenizer=True)
    return base.eval(), other.eval(), folder


def scored_logprobs(model, tokens: list[int], chunks: int) -> torch.Tensor:
    """float64 log-probs [chunks, CTX - 1 - CTX // 2, vocab] at llama-perplexity's scored
    positions, BOS first in each chunk."""
    rows = []
    with torch.no_grad():
        for i in range(chunks):
            ids = [BOS, *tokens[i * CTX + 1 : (i + 1) * CTX]]
            logits = model.double()(torch.tensor([ids])).logits[0]
            rows.append(torch.log_softmax(logits, dim=-1)[CTX // 2 : CTX - 1])
    model.float()
    return torch.stack(rows)


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    engine = api.load(str(STORIES_HF), device="cpu", ctx_size=CTX)
    chunks = perplexity.text_chunks(engine.tokenizer, STORY, CTX)
    path = tmp_path_factory.mktemp("base") / "stories.kld"
    estimates = list(
        kld.save_base(engine.model, engine.new_cache, engine.tokenizer, chunks, path, "stories")
    )
    return path, chunks, estimates[-1]


def test_base_file_is_safetensors_of_the_chunks_and_their_log_probs(models, base_file):
    path, chunks, estimate = base_file
    assert not path.with_name(path.name + ".part").exists()
    tensors = safetensors_numpy.load_file(str(path))
    assert tensors["tokens"].dtype == np.int32 and tensors["log_probs"].dtype == np.float16
    assert tensors["tokens"].tolist() == chunks.tolist()
    tokens = reference_tokens()
    count = len(tokens) // CTX
    assert chunks.shape == (count, CTX)
    expected = scored_logprobs(models[0], tokens, count)
    saved = torch.from_numpy(tensors["log_probs"].astype(np.float32)).double()
    # f16 keeps 11 significant bits: 2^-11 relative, and the model's f32 arithmetic
    torch.testing.assert_close(saved, expected, rtol=1e-3, atol=1e-4)
    # the saving run measured the perplexity as it went
    targets = chunks[:, CTX // 2 + 1 :]
    nll = -expected.gather(2, targets[..., None])[..., 0]
    assert estimate.ppl == pytest.approx(math.exp(float(nll.mean())), rel=1e-4)


def test_comparison_equals_the_statistics_computed_with_transformers(models, base_file):
    base_model, other_model, folder = models
    path, chunks, _ = base_file
    engine = api.load(str(folder), device="cpu", ctx_size=CTX)
    steps = list(kld.compare(engine.model, engine.new_cache, kld.read_base(path, engine.tokenizer)))
    assert [s.chunks for s in steps] == list(range(1, len(chunks) + 1))
    got = steps[-1].divergence.summary()

    tokens = reference_tokens()
    p_log = scored_logprobs(base_model, tokens, len(chunks)).flatten(0, 1)
    q_log = scored_logprobs(other_model, tokens, len(chunks)).flatten(0, 1)
    targets = chunks[:, CTX // 2 + 1 :].flatten()
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    nll_q = -q_log.gather(1, targets[:, None])[:, 0]
    nll_p = -p_log.gather(1, targets[:, None])[:, 0]
    dp = nll_q.neg().exp() - nll_p.neg().exp()
    same = float((q_log.argmax(-1) == p_log.argmax(-1)).double().mean())

    assert got["tokens"] == len(targets)
    assert got["ppl"] == pytest.approx(math.exp(float(nll_q.mean())), rel=1e-4)
    assert got["base_ppl"] == pytest.approx(math.exp(float(nll_p.mean())), rel=1e-4)
    assert got["ln_ppl_ratio"] == pytest.approx(float(nll_q.mean() - nll_p.mean()), abs=1e-4)
    assert 0.01 < got["kld"]["mean"] < 1  # the noise moves the distributions, not wildly
    assert got["kld"]["mean"] == pytest.approx(float(kl.mean()), rel=1e-3)
    assert got["kld"]["max"] == pytest.approx(float(kl.max()), rel=1e-3)
    assert got["kld"]["median"] == pytest.approx(float(np.median(kl)), rel=1e-3)
    assert got["kld"]["99.0%"] == pytest.approx(float(np.percentile(kl, 99)), rel=1e-3)
    assert got["delta_p"]["mean"] == pytest.approx(float(dp.mean()), abs=1e-4)
    assert got["delta_p"]["rms"] == pytest.approx(float(dp.square().mean().sqrt()), rel=1e-3)
    assert 0.5 < same < 1
    assert got["same_top_p"] == pytest.approx(same, abs=1.5 / len(targets))


def test_a_model_compared_with_itself_diverges_by_nothing(base_file):
    path, _, estimate = base_file
    engine = api.load(str(STORIES_GGUF), device="cpu", ctx_size=CTX)
    base = kld.read_base(path, engine.tokenizer)  # the same tokenizer, from the GGUF
    got = list(kld.compare(engine.model, engine.new_cache, base, limit=2))[-1]
    assert got.total == 2
    summary = got.divergence.summary()
    assert abs(summary["kld"]["mean"]) < 1e-6 and summary["same_top_p"] == 1.0


def test_a_base_of_another_vocabulary_is_refused(base_file, tmp_path):
    path, _, _ = base_file
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(STORIES_HF / "tokenizer_config.json", folder)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        dict(id=512, content="<x>", single_word=False, lstrip=False, rstrip=False,
             normalized=False, special=True)
    )  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UsageError, match="was computed with another tokenizer"):
        kld.read_base(path, load_tokenizer(folder))


def test_truncated_files_and_model_weights_are_refused(base_file, tmp_path):
    path, _, _ = base_file
    tokenizer = load_tokenizer(STORIES_HF)
    cut = tmp_path / "cut.kld"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelFormatError, match="the file may be truncated"):
        kld.read_base(cut, tokenizer)
    with pytest.raises(ModelFormatError, match="not a base file of llmrun's log-probabilities"):
        kld.read_base(STORIES_HF / "model.safetensors", tokenizer)
    with pytest.raises(UsageError, match="no such file"):
        kld.base_ctx(tmp_path / "missing.kld")


def test_an_interrupted_save_leaves_no_file(tmp_path):
    engine = api.load(str(STORIES_GGUF), device="cpu", ctx_size=CTX)
    chunks = perplexity.text_chunks(engine.tokenizer, STORY, CTX)
    path = tmp_path / "base.kld"
    saving = kld.save_base(engine.model, engine.new_cache, engine.tokenizer, chunks, path, "x")
    next(saving)
    saving.close()
    assert list(tmp_path.iterdir()) == []

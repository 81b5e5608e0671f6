"""`llmrun embed` as a user runs it: texts piped in or given, one JSON array per text, an
OpenAI-shaped object with --json, --pooling and --no-normalize, and one-line errors."""

import json

import pytest
import torch
from embedding_helpers import TEXTS, hf_model, reference, write_embedding_dir
from helpers import STORIES_GGUF, STORIES_HF
from in_process import llmrun

from llmrun import api

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3():
    return hf_model()


@pytest.fixture(scope="module")
def st_dir(qwen3, tmp_path_factory):
    return write_embedding_dir(tmp_path_factory.mktemp("qwen3-embedding"), qwen3)


def vectors(stdout: str) -> torch.Tensor:
    return torch.tensor([json.loads(line) for line in stdout.splitlines()])


def test_piped_lines_give_one_array_each_as_transformers(qwen3, st_dir):
    result = llmrun("embed", str(st_dir), input="\n".join(TEXTS) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    engine = api.load(str(st_dir), device="cpu", generate=False)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    torch.testing.assert_close(vectors(result.stdout), reference(qwen3, ids), atol=1e-4, rtol=0)


def test_json_is_openai_shaped_and_arguments_are_texts(st_dir):
    result = llmrun("embed", str(st_dir), "Once upon a time", "hi", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["object"] == "list" and out["model"] == str(st_dir)
    assert [(d["object"], d["index"]) for d in out["data"]] == [("embedding", 0), ("embedding", 1)]
    # 4 + 2 tokens of text, each text with its </s>
    assert out["usage"] == {"prompt_tokens": 5 + 3, "total_tokens": 5 + 3}
    plain = llmrun("embed", str(st_dir), "Once upon a time", "hi")
    assert [d["embedding"] for d in out["data"]] == vectors(plain.stdout).tolist()


def test_pooling_and_no_normalize_on_a_model_that_names_no_pooling():
    result = llmrun(
        "embed", str(STORIES_GGUF), *TEXTS[:2], "--pooling", "mean", "--no-normalize", "-b", "1"
    )
    assert result.returncode == 0, result.stderr
    model = transformers.AutoModel.from_pretrained(STORIES_HF, dtype=torch.float32).eval()
    engine = api.load(str(STORIES_GGUF), device="cpu")
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS[:2]]
    theirs = reference(model, ids, "mean", normalize=False)
    torch.testing.assert_close(vectors(result.stdout), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (("hi",), 2, "names no pooling (it is not an embedding model); choose one: --pooling"),
        (("hi", "--pooling", "max"), 2, "unknown --pooling 'max' (choose from mean, cls, last)"),
        (("hi", "--pooling", "mean", "-b", "0"), 2, "--batch-size must be positive, got 0"),
        (
            (" ".join(["dog"] * 300), "--pooling", "last", "-c", "64"),
            1,
            "text 0 is 601 tokens long, more than the context of 64 tokens",
        ),
    ],
)
def test_errors_are_one_line(args, code, message):
    result = llmrun("embed", str(STORIES_GGUF), *args)
    assert result.returncode == code
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_run_refuses_an_embedding_model(tmp_path):
    untied = write_embedding_dir(tmp_path / "m", hf_model(tie_word_embeddings=False))
    result = llmrun("run", str(untied), "hi")
    assert result.returncode == 2
    assert result.stderr == f"error: {untied} is an embedding model; use `llmrun embed`\n"

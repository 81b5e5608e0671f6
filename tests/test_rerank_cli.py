"""`llmrun rerank` as a user runs it: documents given or piped, printed best first with
their index and transformers' score, --top-n, --json in the rerank API's shape, --sigmoid;
run, embed and show on a reranker; one-line errors."""

import json
import math

import pytest
from in_process import llmrun
from rerank_helpers import DOCUMENTS, QUERY, hf_reranker, reference_scores, write_reranker_dir

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = hf_reranker("bert")
    path = write_reranker_dir(tmp_path_factory.mktemp("cross-encoder"), hf)
    return path, reference_scores(hf, path)


def test_documents_print_best_first_with_index_and_score(folder):
    path, expected = folder
    result = llmrun("rerank", str(path), QUERY, *DOCUMENTS)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert [int(index) for index, _, _ in rows] == order
    assert [text for _, _, text in rows] == [DOCUMENTS[i] for i in order]
    for index, score, _ in rows:
        assert abs(float(score) - expected[int(index)]) < 1e-4


def test_piped_documents_json_top_n_and_sigmoid(folder):
    path, expected = folder
    piped = "\n".join(DOCUMENTS) + "\n"
    result = llmrun("rerank", str(path), QUERY, "--json", "--top-n", "2", input=piped)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["object"] == "list" and out["model"] == str(path)
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in out["results"]] == best
    assert all(abs(r["relevance_score"] - expected[r["index"]]) < 1e-4 for r in out["results"])
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 4 * len(DOCUMENTS)
    result = llmrun("rerank", str(path), QUERY, DOCUMENTS[0], "--sigmoid")
    assert result.returncode == 0, result.stderr
    score = float(result.stdout.split("\t")[1])
    assert abs(score - 1 / (1 + math.exp(-expected[0]))) < 1e-4


def test_run_embed_and_show_know_a_reranker(folder):
    path, _ = folder
    for command in (["run", str(path), "hi"], ["embed", str(path), "hi"]):
        result = llmrun(*command)
        assert result.returncode == 2
        assert result.stderr == f"error: {path} is a reranker; use `llmrun rerank`\n"
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "bert (reranker)" in result.stdout


def test_errors_are_one_line(folder):
    path, _ = folder
    result = llmrun("rerank", str(path), QUERY, input="")
    assert (result.returncode, result.stderr) == (2, "error: no document: stdin was empty\n")
    result = llmrun("rerank", str(path), QUERY, " ".join(["berlin"] * 200))
    assert result.returncode != 0
    assert result.stderr.startswith("error: document 0: its pair with the query is 210 tokens")
    assert "Traceback" not in result.stderr

"""`llmrun perplexity` as a user runs it: llama-perplexity's running estimate and final
line, --json, the text piped in, the KL-divergence pair, and one-line errors."""

import json
import re

import pytest
from helpers import STORIES_GGUF, STORIES_HF
from in_process import llmrun
from test_perplexity import STORY

from llmrun import api, perplexity


@pytest.fixture(scope="module")
def story_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(STORY + "\n")  # the last newline is dropped, as llama.cpp's -f does
    return path


def test_running_estimate_and_final_line_as_llama_perplexity_prints_them(story_file):
    result = llmrun("perplexity", str(STORIES_GGUF), "-f", str(story_file), "-c", "64")
    assert result.returncode == 0, result.stderr
    engine = api.load(str(STORIES_GGUF), device="cpu", ctx_size=64)
    chunks = perplexity.text_chunks(engine.tokenizer, STORY, 64)
    estimates = list(perplexity.measure(engine.model, engine.new_cache, chunks))
    final = estimates[-1]
    assert result.stdout == (
        "".join(f"[{e.chunks}]{e.ppl:.4f}," for e in estimates)
        + f"\nFinal estimate: PPL = {final.ppl:.4f} +/- {final.error:.5f}\n"
    )
    assert result.stderr.startswith(
        "perplexity: 8 chunks of 64 tokens, the last 31 of each scored\n"
    )
    assert re.search(r"^248 tokens scored in \d+\.\d\d s$", result.stderr, re.M)


def test_json_from_a_piped_text_with_chunks_and_batch_size():
    result = llmrun(
        "perplexity", str(STORIES_HF), "-c", "32", "--chunks", "3", "-b", "16", "--json",
        input=STORY,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = json.loads(result.stdout)
    engine = api.load(str(STORIES_HF), device="cpu", ctx_size=32)
    chunks = perplexity.text_chunks(engine.tokenizer, STORY, 32, 3)
    estimates = list(perplexity.measure(engine.model, engine.new_cache, chunks))
    assert set(out) == {
        "model", "ctx_size", "chunks", "tokens", "ppl", "ppl_error", "running_ppl", "seconds",
    }  # fmt: skip
    assert (out["model"], out["ctx_size"], out["chunks"], out["tokens"]) == (
        str(STORIES_HF),
        32,
        3,
        45,
    )
    assert out["running_ppl"] == pytest.approx([e.ppl for e in estimates], rel=1e-6)
    assert out["ppl_error"] == pytest.approx(estimates[-1].error, rel=1e-6)


def test_kl_divergence_base_then_comparison(story_file, tmp_path):
    base = tmp_path / "stories.kld"
    saved = llmrun(
        "perplexity", str(STORIES_HF), "-f", str(story_file), "-c", "48",
        "--kl-divergence-base", str(base),
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    assert base.is_file() and "Final estimate: PPL = " in saved.stdout
    compared = llmrun(
        "perplexity", str(STORIES_GGUF), "--kl-divergence-base", str(base), "--kl-divergence"
    )
    assert compared.returncode == 0, compared.stderr
    lines = compared.stdout.splitlines()
    assert lines[0].split() == ["chunk", "PPL", "ln(PPL(Q)/PPL(base))", "KL", "Divergence"] + [
        "Δp", "RMS", "Same", "top", "p"
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[1:12]] == [str(i) for i in range(1, 12)]
    assert "====== KL divergence statistics ======" in lines
    assert "Same top p: 100.000 ± 0.000 %" in lines  # the same model, in another format
    as_json = llmrun(
        "perplexity", str(STORIES_GGUF), "--kl-divergence-base", str(base), "--kl-divergence",
        "--chunks", "2", "--json",
    )  # fmt: skip
    out = json.loads(as_json.stdout)
    assert (out["ctx_size"], out["chunks"], out["tokens"], out["base_model"]) == (
        48,
        2,
        2 * 23,
        str(STORIES_HF),
    )
    assert abs(out["kld"]["mean"]) < 1e-6 and out["same_top_p"] == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("-c", "512"),
            "error: the text is 532 tokens long; perplexity with a context of 512 needs at "
            "least 1024 tokens: give a longer text or a smaller --ctx-size\n",
        ),
        (
            ("--kl-divergence",),
            "error: --kl-divergence needs --kl-divergence-base FILE (the base model's "
            "log-probabilities, saved by a run without --kl-divergence)\n",
        ),
        (
            ("-f", "/nonexistent/text.txt"),
            "error: -f /nonexistent/text.txt: No such file or directory\n",
        ),
    ],
)
def test_errors_are_one_line(args, message):
    result = llmrun("perplexity", str(STORIES_GGUF), *args, input=STORY)
    assert result.returncode == 2
    assert result.stderr == message

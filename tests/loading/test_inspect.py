"""What `show` reads from a model's headers without loading it: the tokenizer model and its
pre-tokenizer, for GGUF metadata and tokenizer.json."""

import subprocess
import sys

from helpers import STORIES_GGUF, STORIES_HF, VOCAB_DIR, needs_vocab

from llmrun.loading.inspect import describe


@needs_vocab
def test_gguf_names_tokenizer_model_and_pre_tokenizer():
    info = describe(VOCAB_DIR / "ggml-vocab-qwen2.gguf")
    assert (info["tokenizer"], info["pre_tokenizer"]) == ("BPE", "qwen2")
    info = describe(VOCAB_DIR / "ggml-vocab-llama-spm.gguf")
    assert (info["tokenizer"], info["pre_tokenizer"]) == ("SentencePiece", None)


def test_hf_directory_names_its_pre_tokenizer():
    info = describe(STORIES_HF)
    assert (info["tokenizer"], info["pre_tokenizer"]) == ("BPE", "Metaspace")


@needs_vocab
def test_show_prints_the_tokenizer_line():
    def tokenizer_line(path) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "llmrun", "show", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return next(line for line in r.stdout.splitlines() if line.startswith("tokenizer"))

    assert tokenizer_line(VOCAB_DIR / "ggml-vocab-llama-bpe.gguf") == (
        "tokenizer      BPE, pre-tokenizer llama-bpe"
    )
    assert tokenizer_line(STORIES_GGUF) == "tokenizer      SentencePiece"

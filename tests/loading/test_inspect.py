"""What `show` reads from a model's headers without loading it: the tokenizer model and its
pre-tokenizer, for GGUF metadata and tokenizer.json."""

import pytest
from helpers import BASE, CONFIGS, STORIES_GGUF, STORIES_HF, VOCAB_DIR, needs_vocab
from in_process import llmrun

from llmrun.loading.inspect import describe, kv_cache_bytes


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
        r = llmrun("show", str(path))
        return next(line for line in r.stdout.splitlines() if line.startswith("tokenizer"))

    assert tokenizer_line(VOCAB_DIR / "ggml-vocab-llama-bpe.gguf") == (
        "tokenizer      BPE, pre-tokenizer llama-bpe"
    )
    assert tokenizer_line(STORIES_GGUF) == "tokenizer      SentencePiece"


@pytest.mark.parametrize(
    "config",
    [
        {**BASE, **CONFIGS["qwen2"]},
        {**BASE, **CONFIGS["gemma"]},
        {**BASE, **CONFIGS["gemma2"]},
        {**BASE, **CONFIGS["gemma3"]},
        {**BASE, **CONFIGS["gemma3"], "sliding_window_pattern": 3},
        {**BASE, **CONFIGS["gemma3"], "layer_types": ["full_attention"] * 6},
        {"model_type": "gemma3", "text_config": {**BASE, **CONFIGS["gemma3"]}},
    ],
    ids=["qwen2", "gemma", "gemma2", "gemma3", "gemma3-pattern", "gemma3-types", "multimodal"],
)
def test_show_counts_the_kv_cache_as_the_model_allocates_it(config):
    # inspect's count is torch-free (show stays fast); the models' own count is the reference.
    from llmrun.models import kv_cache_bytes as allocated

    model_config = config.get("text_config", config)
    for context in (1, 4, 5, 12, 8192):
        assert kv_cache_bytes(config, context) == allocated(model_config, context)

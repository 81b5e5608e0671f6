"""Fill-in-the-middle prompts (llmrun.infill) and `run --suffix`: the prompt ids on llama.cpp's
real code vocabularies equal the sequence llama.cpp's server writes (format_prompt_infill,
written out here from the special token ids), the FIM tokens an HF folder's tokenizer.json
gives are found, and the CLI prints what the model generates for that prompt."""

import json

import pytest
from gguf import TokenType
from helpers import FIM_TOKENS, STORIES_GGUF, VOCAB_DIR, fim_model_dir, needs_vocab
from in_process import llmrun

from llmrun.errors import ContextOverflowError, UnsupportedError
from llmrun.infill import check_fim, fim_prompt, infill_ids
from llmrun.loading.gguf_io import read_gguf
from llmrun.tokenizer import Tokenizer, load_tokenizer

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))  # <fim_middle> stays text\n"
EXTRA = [("utils.py", "import os\n\nX = 1\n"), ("b.py", "def sub(a, b):\n    return a - b\n")]
SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator where there is no <|file_sep|>
N_CTX = 4096  # llama-server -c 4096, --batch-size 2048, -n -1: nothing is cut


def plain(tok, text):
    return tok.encode(text, add_bos=False, parse_special=False)


def vocab(name):
    return load_tokenizer(VOCAB_DIR / f"ggml-vocab-{name}.gguf")


@pytest.fixture(scope="module")
def qwen_coder():
    """llama.cpp's qwen2 vocabulary with Qwen2.5-Coder's FIM tokens where Qwen2.5 has
    them (151659 to 151664; this file holds placeholders there), control tokens as
    llama.cpp's converter writes Qwen2.5-Coder's."""
    metadata = dict(read_gguf(VOCAB_DIR / "ggml-vocab-qwen2.gguf", with_tensors=False).metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata["tokenizer.ggml.token_type"])
    for i, text in enumerate(FIM_TOKENS[:6], start=151659):
        tokens[i], types[i] = text, int(TokenType.CONTROL)
    metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"] = tokens, types
    return Tokenizer.from_gguf_metadata(metadata, "qwen2.5-coder")


@needs_vocab
def test_repo_level_prompt_with_file_separators(qwen_coder):
    tok = qwen_coder
    pre, mid, suf, pad, rep, sep = range(151659, 151665)
    assert tok.fim_ids == dict(pre=pre, suf=suf, mid=mid, pad=pad, rep=rep, sep=sep)
    assert {pad, rep, sep} <= tok.eog_ids and not tok.add_bos
    prompt = "return"
    expected = [rep, *plain(tok, "myproject\n")]
    for name, text in EXTRA:
        expected += [sep, *plain(tok, name + "\n"), *plain(tok, text)]
    expected += [sep, *plain(tok, "filename\n")]
    expected += [pre, *plain(tok, PREFIX), *tok.encode(prompt, add_bos=False)]
    expected += [suf, *plain(tok, SUFFIX), mid]
    assert fim_prompt(tok, PREFIX, SUFFIX, EXTRA, prompt, n_ctx=N_CTX) == expected
    # Special-token text in the code is plain text, in the prompt a token.
    assert mid not in plain(tok, SUFFIX)
    assert fim_prompt(tok, "", "", (), "<|fim_pad|>", n_ctx=N_CTX)[-4:] == [pre, pad, suf, mid]


@needs_vocab
def test_starcoder_prompt_against_transformers_tokenizer():
    """The texts tokenized by transformers (its GGUF tokenizer of the same file), the
    snippet separator between other files: StarCoder has no <|file_sep|>."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(
        str(VOCAB_DIR), gguf_file="ggml-vocab-starcoder.gguf"
    )

    def hf(text):
        return ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    tok = vocab("starcoder")
    assert tok.fim_ids == dict(pre=1, suf=3, mid=2, pad=4)
    expected = []
    for _, text in EXTRA:
        expected += [*hf(SNIPPET), *hf(text)]
    expected += [1, *hf(PREFIX), 3, *hf(SUFFIX), 2]
    assert fim_prompt(tok, PREFIX, SUFFIX, EXTRA, n_ctx=N_CTX) == expected


@needs_vocab
def test_deepseek_coder_puts_bos_after_the_other_files():
    tok = vocab("deepseek-coder")
    begin, hole, end, bos = 32016, 32015, 32017, 32013
    assert (tok.fim_ids, tok.add_bos, tok.bos_id) == (dict(pre=begin, suf=hole, mid=end), True, bos)
    snippet = [*plain(tok, SNIPPET), *plain(tok, EXTRA[0][1])]
    expected = [*snippet, bos, begin, *plain(tok, PREFIX), hole, *plain(tok, SUFFIX), end]
    assert fim_prompt(tok, PREFIX, SUFFIX, EXTRA[:1], n_ctx=N_CTX) == expected


@needs_vocab
def test_refact_names_the_repo_without_file_separators():
    tok = vocab("refact")
    assert tok.fim_ids == dict(pre=1, suf=3, mid=2, pad=4, rep=18)
    expected = [18, *plain(tok, "myproject\n"), *plain(tok, SNIPPET), *plain(tok, EXTRA[1][1])]
    expected += [1, *plain(tok, PREFIX), 3, *plain(tok, SUFFIX), 2]
    assert fim_prompt(tok, PREFIX, SUFFIX, EXTRA[1:], n_ctx=N_CTX) == expected


@needs_vocab
def test_codellama_sentencepiece_prompt():
    """Llama 2's SentencePiece vocabulary given CodeLlama's FIM tokens (as ids 32000 to
    32003): each text gets the space prefix, as llama.cpp tokenizes each on its own."""
    metadata = dict(read_gguf(VOCAB_DIR / "ggml-vocab-llama-spm.gguf", with_tensors=False).metadata)
    added = ["\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"]
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], *added]
    metadata["tokenizer.ggml.scores"] = [*metadata["tokenizer.ggml.scores"], *[0.0] * 4]
    types = [*metadata["tokenizer.ggml.token_type"], *[int(TokenType.CONTROL)] * 4]
    metadata["tokenizer.ggml.token_type"] = types
    tok = Tokenizer.from_gguf_metadata(metadata, "codellama")
    assert tok.fim_ids == dict(pre=32000, suf=32001, mid=32002)
    assert plain(tok, "x")[0] == tok.token_id("\u2581x")
    expected = [1, 32000, *plain(tok, PREFIX), 32001, *plain(tok, SUFFIX), 32002]
    assert fim_prompt(tok, PREFIX, SUFFIX, n_ctx=N_CTX) == expected


@needs_vocab
def test_long_inputs_are_cut_as_llama_cpp_cuts_them(qwen_coder):
    """A batch of 16: the prefix keeps its last 12 tokens, the suffix its first
    16 / 4 - 2 - len(prompt), the other files their last n_ctx - 16 - 2 * n_predict."""
    tok = qwen_coder
    pre, mid, suf, _, rep, sep = range(151659, 151665)
    prefix, suffix = "a b c d e f g h i j k l m n o p", "q r s t u v w x"
    extra = [rep, *plain(tok, "myproject\n"), sep, *plain(tok, "x.py\n")]
    extra += plain(tok, "y = 2\n" * 5)
    extra += [sep, *plain(tok, "filename\n")]
    for prompt, n_ctx, n_predict in [("", 40, 4), ("z", 30, 2), ("z z", 16, -1)]:
        got = fim_prompt(
            tok,
            prefix,
            suffix,
            [("x.py", "y = 2\n" * 5)],
            prompt,
            n_ctx=n_ctx,
            n_batch=16,
            n_predict=n_predict,
        )
        prompt_ids = tok.encode(prompt, add_bos=False)
        keep = max(0, 16 // 4 - 2 - len(prompt_ids))
        extra_take = max(0, n_ctx - 16 - 2 * n_predict)
        expected = extra[len(extra) - extra_take :] if extra_take else []
        expected += [pre, *plain(tok, prefix)[-12:], *prompt_ids]
        expected += [suf, *plain(tok, suffix)[:keep], mid]
        assert got == expected, (prompt, n_ctx, n_predict)


def test_an_hf_folder_finds_its_fim_tokens_by_text(tmp_path):
    """As llama.cpp finds them in the GGUF of the folder; transformers tokenizes the
    texts."""
    transformers = pytest.importorskip("transformers")
    folder = fim_model_dir(tmp_path / "m")
    tok = load_tokenizer(folder)
    # Its tokenizer.json as transformers reads it (AutoTokenizer would go by the config's
    # model_type, qwen2, and build Qwen2's own pipeline around stories260K's vocabulary).
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids = dict(zip(FIM_TOKENS, range(512, 519), strict=True))
    pre, mid, suf = ids["<|fim_prefix|>"], ids["<|fim_middle|>"], ids["<|fim_suffix|>"]
    rep, sep = ids["<|repo_name|>"], ids["<|file_sep|>"]
    assert tok.fim_ids == dict(pre=pre, suf=suf, mid=mid, pad=515, rep=rep, sep=sep)
    assert tok.eog_ids >= {515, rep, sep, 518}

    def hf(text):
        return ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    expected = [rep, *hf("myproject\n"), sep, *hf("a.py\n"), *hf("x = 1\n")]
    expected += [sep, *hf("filename\n"), pre, *hf("Once upon"), suf, *hf(" end."), mid]
    got = infill_ids(tok, "m", "Once upon", " end.", [("a.py", "x = 1\n")], ctx_size=4096)
    assert got == expected
    # CodeLlama's tokenizer_config.json names its "▁<EOT>", which ends an infill.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eot_token": "<s>"}))
    assert 1 not in tok.eog_ids and 1 in load_tokenizer(folder).eog_ids


def test_a_model_without_fim_tokens_is_refused():
    tok = load_tokenizer(STORIES_GGUF)
    with pytest.raises(
        UnsupportedError, match="stories has no fill-in-the-middle prefix, suffix, middle tokens"
    ):
        check_fim(tok, "stories")


def test_the_prompt_leaves_room_to_generate(tmp_path):
    tok = load_tokenizer(fim_model_dir(tmp_path / "m"))
    long = "Once upon a time " * 200
    for ctx_size, max_tokens in [(256, 16), (256, None), (4096, 100)]:
        ids = infill_ids(
            tok, "m", long, long, [("a", long)], ctx_size=ctx_size, max_tokens=max_tokens
        )
        assert len(ids) + (max_tokens or ctx_size // 4) <= ctx_size
    with pytest.raises(ContextOverflowError, match="no room"):
        infill_ids(tok, "m", "a", "b", ctx_size=32, max_tokens=20)


def test_run_suffix_prints_the_middle(tmp_path):
    from llmrun import api
    from llmrun.sampling import SamplingParams

    folder = fim_model_dir(tmp_path / "m")
    engine = api.load(str(folder), device="cpu")
    prefix, suffix = "Once upon a time\n", "\nThe end."
    ids = infill_ids(engine.tokenizer, "m", prefix, suffix, ctx_size=engine.ctx_size, max_tokens=12)
    expected = "".join(r.text for r in engine.generate(ids, SamplingParams(temperature=0), 12))
    flags = ["--fim-suffix", suffix, "-n", "12", "--temperature", "0", "--show-prompt"]
    result = llmrun("run", str(folder), *flags, "--json", input=prefix)  # stdin: "\n" kept
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["text"], record["prompt_tokens"]) == (expected, len(ids))
    assert engine.tokenizer.decode(ids, skip_special=False) in result.stderr
    assert "<|fim_prefix|>" in result.stderr


def test_run_suffix_errors_are_one_line(tmp_path):
    result = llmrun("run", str(STORIES_GGUF), "--suffix", "b", "a")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "fill-in-the-middle" in result.stderr
    assert result.stderr.count("\n") == 1
    raw = llmrun("run", str(STORIES_GGUF), "--suffix", "b", "--raw", "a")
    assert (raw.returncode, raw.stderr) == (2, "error: --raw does not go with --suffix\n")

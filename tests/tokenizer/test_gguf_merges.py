"""A GGUF's BPE merges ranked as llama.cpp ranks them: a merge the file repeats keeps its
first rank (llm_tokenizer_bpe fills bpe_ranks with emplace, which keeps the first), where the
`tokenizers` library alone would keep the last."""

import gguf

from llmrun.tokenizer import load_tokenizer

TOKENS = ["a", "b", "c", "ab", "bc", "<|endoftext|>"]


def write_vocab(path, merges: list[str]):
    """A vocabulary-only GGUF as llama.cpp's converter writes a GPT-2 one (with the few shape
    keys llama.cpp's vocab_only load reads)."""
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_layer_norm_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1, 1, 1, 1, 1, 3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(5)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_repeated_merge_keeps_its_first_rank(tmp_path):
    # "a b" ranks 0 and, repeated, 2; "b c" ranks 1. With the first rank "a b" merges before
    # "b c"; with the last, "b c" would go first ("abc" -> a bc, "babc" -> b a bc).
    tok = load_tokenizer(write_vocab(tmp_path / "repeat.gguf", ["a b", "b c", "a b"]))
    # By llama.cpp's rule, worked by hand (llama-cpp-python 0.3.36 gives the same ids):
    # abc -> ab c; babc -> b ab c; cabcab -> c ab c ab.
    assert tok.encode("abc") == [3, 2]
    assert tok.encode("babc") == [1, 3, 2]
    assert tok.encode("cabcab") == [2, 3, 2, 3]


def test_the_first_of_the_repeated_merges_decides(tmp_path):
    # "b c" ranks 0 and 2, "a b" 1: "b c" goes first, and a repeat-free file ranks alike.
    repeated = load_tokenizer(write_vocab(tmp_path / "repeat.gguf", ["b c", "a b", "b c"]))
    once = load_tokenizer(write_vocab(tmp_path / "once.gguf", ["b c", "a b"]))
    assert [repeated.encode(t) for t in ["abc", "babc"]] == [[0, 4], [1, 0, 4]]
    for text in ["abc", "babc", "cabcab", "bcabca"]:
        assert repeated.encode(text) == once.encode(text)

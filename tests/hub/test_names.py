"""Hub names, quant tags and which files of a repo make up a model (no network)."""

from __future__ import annotations

import pytest

from llmrun import hub
from llmrun.errors import HubError, ModelNotFoundError, UsageError
from llmrun.hub import names
from llmrun.loading.inspect import safetensors_weights
from llmrun.paths import BUNDLED_MODEL


def test_parse_name_forms():
    assert hub.parse_name("org/repo") == hub.HubName("org/repo")
    assert hub.parse_name("org/repo:q4_k_m@v2") == hub.HubName("org/repo", None, "q4_k_m", "v2")
    assert hub.parse_name("org/repo@v2:Q8_0") == hub.HubName("org/repo", None, "Q8_0", "v2")
    assert hub.parse_name("org/repo/a/b-Q4_0.gguf@refs/pr/1") == hub.HubName(
        "org/repo", "a/b-Q4_0.gguf", None, "refs/pr/1"
    )
    for bad in (
        "org/repo:",
        "org/repo@",
        "org/repo/model.bin",
        "org/repo/x.gguf:Q4_0",
        "o/r/../x.gguf",
        "o/r@../../x",
        "o/r@.",  # refs/. is refs itself: the ref would be written over the folder
        "o/r@./",
        "o/r@a//b",
        "o/r@" + "v" * 256,  # longer than a file name may be
        "o/r@v1\n",
    ):
        with pytest.raises(UsageError):
            hub.parse_name(bad)


def test_local_paths_and_unknown_names(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert hub.resolve_model(str(f)) == f
    assert hub.resolve_model(str(tmp_path)) == tmp_path
    assert hub.resolve_model("stories260K") == BUNDLED_MODEL
    for missing in ("./nope", "/nope/x", "~/nope.gguf", "nope.gguf", "dir/nope.gguf", "nope"):
        with pytest.raises(ModelNotFoundError):
            hub.resolve_model(missing, pull=False)


def test_quant_labels():
    cases = {
        "Llama-3.2-1B-Instruct-Q4_K_M.gguf": "Q4_K_M",
        "qwen2.5-0.5b-instruct-q4_k_m-00001-of-00002.gguf": "Q4_K_M",
        "Q8_0/model-00001-of-00003.gguf": "Q8_0",
        "model.IQ4_XS.gguf": "IQ4_XS",
        "x-UD-Q4_K_XL.gguf": "Q4_K_XL",
        "ggml-model-f16.gguf": "F16",
        "Qwen2-7B.BF16.gguf": "BF16",
        "stories260K.gguf": None,
    }
    assert {name: hub.quant_label(name) for name in cases} == cases


def test_an_older_sentencepiece_file_is_fetched_only_without_tokenizer_json():
    weights = {"config.json": 1, "model.safetensors": 1}
    old = {**weights, "sentencepiece.bpe.model": 1, "spiece.model": 1}
    assert names.select(hub.parse_name("o/r"), old).files == (
        "config.json",
        "model.safetensors",
        "sentencepiece.bpe.model",
        "spiece.model",
    )
    both = {**old, "tokenizer.json": 1}
    assert names.select(hub.parse_name("o/r"), both).files == (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    )


def test_mistrals_tekken_json_is_fetched_only_without_tokenizer_json():
    tekken = {"config.json": 1, "model.safetensors": 1, "tekken.json": 1}
    selected = names.select(hub.parse_name("o/r"), tekken).files
    assert selected == ("config.json", "model.safetensors", "tekken.json")
    both = {**tekken, "tokenizer.json": 1}
    assert "tekken.json" not in names.select(hub.parse_name("o/r"), both).files


def test_a_mistral_native_repo_selects_its_own_files():
    native = dict.fromkeys(
        [
            "params.json",
            "consolidated.safetensors",
            "tekken.json",
            "chat_template.jinja",
            "SYSTEM_PROMPT.txt",
            "README.md",
            "tokenizer.model.v3",
            "consolidated.00.pth",
            ".gitattributes",
        ],
        1,
    )
    sel = names.select(hub.parse_name("o/r"), native)
    assert sel.format == "safetensors"
    assert sel.files == (
        "README.md",
        "SYSTEM_PROMPT.txt",
        "chat_template.jinja",
        "consolidated.safetensors",
        "params.json",
        "tekken.json",
    )
    shards = {"params.json": 1, "tekken.json": 1}
    shards |= {f"consolidated-0000{i}-of-00002.safetensors": 1 for i in (1, 2)}
    assert names.select(hub.parse_name("o/r"), shards).files == (
        "consolidated-00001-of-00002.safetensors",
        "consolidated-00002-of-00002.safetensors",
        "params.json",
        "tekken.json",
    )
    del shards["consolidated-00002-of-00002.safetensors"]
    with pytest.raises(ModelNotFoundError, match="o/r: only 1 of the 2 consolidated-"):
        names.select(hub.parse_name("o/r"), shards)
    # A repo with both formats is read as its Hugging Face files, never both.
    both = {**native, "config.json": 1, "model.safetensors": 1, "tokenizer.json": 1}
    assert names.select(hub.parse_name("o/r"), both).files == (
        "README.md",
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    )


def test_safetensors_choice_skips_other_formats_and_duplicates():
    files = dict.fromkeys(
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "consolidated.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "pytorch_model.bin",
            "model.pt",
            "weights.pth",
            "onnx/model.onnx",
            "flax_model.msgpack",
            "original/consolidated.00.pth",
        ],
        1,
    )
    sel = names.select(hub.parse_name("o/r"), files)
    assert sel.format == "safetensors"
    assert sel.files == (
        "chat_template.jinja",
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )


def test_a_lora_adapter_beside_the_weights_is_not_taken_for_them():
    """adapter_model.safetensors (Granite Speech's adapter, fetched beside the weights) is
    never part of the model's weights: with unsharded weights of another name it was."""
    files = dict.fromkeys(["config.json", "weights.safetensors", "adapter_model.safetensors"], 1)
    sel = names.select(hub.parse_name("o/r"), files)
    assert "weights.safetensors" in sel.files and "adapter_model.safetensors" in sel.files
    assert safetensors_weights(sel.files) == ["weights.safetensors"]


def test_gguf_choice_rules():
    files = {"a-Q8_0.gguf": 80, "a-Q2_K.gguf": 20, "a-Q4_K_M.gguf": 40, "mmproj-a-f16.gguf": 1}
    sel = names.select(hub.parse_name("o/r"), files)
    assert sel.files == ("a-Q4_K_M.gguf",)
    assert sel.note == "using o/r:Q4_K_M (the default Q4_K_M); others: o/r:Q2_K, o/r:Q8_0"
    del files["a-Q4_K_M.gguf"]
    sel = names.select(hub.parse_name("o/r"), files)
    assert sel.files == ("a-Q2_K.gguf",) and "smallest" in sel.note
    only = names.select(hub.parse_name("o/r"), {"x.gguf": 5, "README.md": 1})
    assert only.files == ("x.gguf",) and only.note is None
    assert names.select(hub.parse_name("o/r/mmproj-a-f16.gguf"), files).files == (
        "mmproj-a-f16.gguf",
    )
    split = {"Q6_K/m-Q6_K-00002-of-00002.gguf": 9, "Q6_K/m-Q6_K-00001-of-00002.gguf": 9}
    assert names.select(hub.parse_name("o/r:q6_k"), split).files == (
        "Q6_K/m-Q6_K-00001-of-00002.gguf",
        "Q6_K/m-Q6_K-00002-of-00002.gguf",
    )
    with pytest.raises(ModelNotFoundError, match="only 1 of the 2 parts"):
        names.select(hub.parse_name("o/r:Q6_K"), {"m-Q6_K-00001-of-00002.gguf": 9})
    # two files, but not parts 1 and 2: each part's number counts, not how many there are
    wrong = {"m-Q6_K-00002-of-00002.gguf": 9, "m-Q6_K-00003-of-00002.gguf": 9}
    with pytest.raises(ModelNotFoundError, match=r"only 1 of the 2 parts .* \(and 1 more\)"):
        names.select(hub.parse_name("o/r:Q6_K"), wrong)
    with pytest.raises(ModelNotFoundError, match="only 0 of the 0 parts"):
        names.select(hub.parse_name("o/r:Q6_K"), {"m-Q6_K-00001-of-00000.gguf": 9})
    safetensors = {"config.json": 1, "model.safetensors": 2}
    with pytest.raises(ModelNotFoundError, match="holds safetensors weights only: pull o/r with"):
        names.select(hub.parse_name("o/r:Q4_K_M"), safetensors)
    with pytest.raises(HubError, match=r"neither .* \(it has: config.json, pytorch_model.bin\)"):
        names.select(hub.parse_name("o/r"), {"config.json": 1, "pytorch_model.bin": 2})

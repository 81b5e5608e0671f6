"""Hugging Face model folders as users have them: sharded or single-file, in every
float dtype, tied or not, configs of several vintages, multimodal checkpoints, and
the broken ones, which are refused in one line naming what is wrong.

Tolerance: 1e-4 max abs against transformers loading the same folder in f32
(logits span about ±7 here).
"""

import json
import shutil

import pytest
import torch
from helpers import save_hf_dir, tiny_hf_model
from safetensors.torch import load_file, save_file

from llmrun import api
from llmrun.errors import ModelFormatError, ModelNotFoundError, TokenizerError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 2, 44, 501]])


def logits(path):
    with torch.no_grad():
        return load_model(path, CPU, "f32").model(IDS, torch.arange(IDS.shape[1])[None])


def transformers_logits(path):
    """transformers' logits of the folder, loaded by from_pretrained in f32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def edit(path, config=None, weights=None, file="model.safetensors"):
    """Change a saved folder: `config(dict)` edits config.json, `weights(dict)` the
    tensors of `file`."""
    if config is not None:
        data = json.loads((path / "config.json").read_text())
        config(data)
        (path / "config.json").write_text(json.dumps(data))
    if weights is not None:
        tensors = load_file(path / file)
        weights(tensors)
        save_file(tensors, path / file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    hf, _ = tiny_hf_model("llama")
    return save_hf_dir(hf, tmp_path_factory.mktemp("llama") / "m")


def copy(src, tmp_path, name="m"):
    return shutil.copytree(src, tmp_path / name)


# ---- folders that load -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sharded_folder_in_each_dtype_matches_transformers(dtype, tmp_path):
    """save_pretrained's shards and index.json, in f32, f16 and bf16 (torch_dtype
    names it), against transformers loading the same folder."""
    hf, _ = tiny_hf_model("mistral")  # head_dim 32, not hidden / heads = 16
    hf.to(dtype).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3
    assert (tmp_path / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(logits(tmp_path), transformers_logits(tmp_path), atol=1e-4, rtol=0)


def test_a_second_copy_of_the_weights_is_ignored(llama_dir, tmp_path):
    """Mistral's repos hold the weights again as consolidated.safetensors (its own
    names); like the Hub's file choice, loading takes model.safetensors (it read every
    .safetensors file and refused the other copy's names)."""
    path = copy(llama_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    save_file(
        {k.removeprefix("model."): v for k, v in tensors.items()}, path / "consolidated.safetensors"
    )
    torch.testing.assert_close(logits(path), transformers_logits(llama_dir), atol=1e-4, rtol=0)


def test_tied_embeddings_with_and_without_lm_head(tmp_path):
    hf, _ = tiny_hf_model("qwen2")  # tie_word_embeddings: save_pretrained leaves lm_head out
    tied = save_hf_dir(hf, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")
    torch.testing.assert_close(logits(tied), transformers_logits(tied), atol=1e-4, rtol=0)
    # Some exports keep an lm_head.weight besides tie_word_embeddings: true.
    head = torch.randn(512, 64, generator=torch.Generator().manual_seed(3)) * 0.2
    with_head = edit(
        copy(tied, tmp_path, "head"), weights=lambda w: w.update({"lm_head.weight": head})
    )
    torch.testing.assert_close(logits(with_head), transformers_logits(with_head), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda c: c.update(rope_scaling=None), id="rope_scaling null"),
        pytest.param(
            lambda c: (c.pop("rope_parameters"), c.pop("rope_theta", None)), id="no rope_theta"
        ),
        pytest.param(lambda c: c.pop("head_dim"), id="head_dim derived"),
        pytest.param(
            lambda c: c.update(torch_dtype="bfloat16", dtype="bfloat16"), id="torch_dtype"
        ),
        pytest.param(
            lambda c: (c.pop("rope_parameters"), c.update(rope_theta=10000.0, rope_scaling=None)),
            id="transformers 4 style",
        ),
    ],
)
def test_config_vintages_match_transformers(change, llama_dir, tmp_path):
    """Fields left out or null take transformers' defaults; torch_dtype that says
    bf16 over f32 weights changes nothing (the weights' own dtype counts)."""
    path = edit(copy(llama_dir, tmp_path), config=change)
    torch.testing.assert_close(logits(path), transformers_logits(path), atol=1e-4, rtol=0)


def multimodal_mistral3(path, tie: bool):
    """A tiny Mistral3ForConditionalGeneration (Mistral Small 3.1's layout: the text
    model under language_model.model., a Pixtral vision tower) saved to `path`."""
    config = transformers.Mistral3Config(
        text_config=dict(
            model_type="mistral",
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=512,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tie,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=16,
            image_size=28,
            patch_size=14,
        ),
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(1.0, 0.1) if key.endswith("norm.weight") else p.normal_(0, 0.2)
        expected = model(input_ids=IDS).logits
    model.save_pretrained(path)
    return expected


@pytest.mark.parametrize("tie", [False, True])
def test_multimodal_mistral3_runs_its_language_model(tie, tmp_path, capsys):
    """Mistral Small 3.1's folder (model_type mistral3): its language model, as
    llama.cpp's converter and ollama take it (llmrun refused 'mistral3')."""
    expected = multimodal_mistral3(tmp_path, tie)
    keys = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in keys)
    assert ("language_model.lm_head.weight" in keys) != tie
    capsys.readouterr()
    torch.testing.assert_close(logits(tmp_path), expected, atol=1e-4, rtol=0)
    assert "a multimodal Mistral 3; running its language model" in capsys.readouterr().err


# ---- folders that are refused, in one line naming the problem ---------------------


def test_a_tensor_in_two_shards_is_refused(llama_dir, tmp_path):
    """Which copy the model got depended on the order of the files (the later won)."""
    path = copy(llama_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    first, second = names[:12], names[10:]
    save_file({k: tensors[k] for k in first}, path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] * 0 for k in second}, path / "model-00002-of-00002.safetensors")
    (path / "model.safetensors").unlink()
    weight_map = {k: f"model-0000{1 + (k in second)}-of-00002.safetensors" for k in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        ModelFormatError,
        match=f"tensor {names[10]} is in both model-00001-of-00002.safetensors and "
        "model-00002-of-00002.safetensors",
    ):
        load_model(path, CPU)


def sharded(llama_dir, tmp_path, weight_map=None):
    """The llama folder in two shards with their index (or `weight_map`)."""
    path = copy(llama_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:10],
        "model-00002-of-00002.safetensors": names[10:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file)
    index = weight_map or {k: file for file, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return path, names


def test_index_problems_are_named(llama_dir, tmp_path):
    path, names = sharded(llama_dir, tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelFormatError,
        match="index.json: lists model-00002-of-00002.safetensors, which is missing",
    ):
        load_model(path, CPU)

    outside, _ = sharded(
        llama_dir, tmp_path / "b", {n: "../m/model-00001-of-00002.safetensors" for n in names}
    )
    with pytest.raises(
        ModelFormatError,
        match=r"lists \.\./m/model-00001-of-00002\.safetensors, which is not a file of",
    ):
        load_model(outside, CPU)

    # A shard without a tensor its index maps to it: the tensor is named.
    lacking, _ = sharded(llama_dir, tmp_path / "c")
    edit(
        lacking,
        weights=lambda w: w.pop("model.norm.weight"),
        file="model-00002-of-00002.safetensors",
    )
    with pytest.raises(ModelFormatError, match=r"missing tensors: model\.norm\.weight$"):
        load_model(lacking, CPU)


def test_extra_and_missing_tensors_are_named(llama_dir, tmp_path):
    extra = edit(
        copy(llama_dir, tmp_path, "extra"),
        weights=lambda w: w.update({"vision_tower.patch.weight": torch.zeros(4)}),
    )
    with pytest.raises(
        ModelFormatError, match="tensors the llama model does not have: vision_tower.patch.weight"
    ):
        load_model(extra, CPU)
    missing = edit(
        copy(llama_dir, tmp_path, "missing"),
        weights=lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"),
    )
    with pytest.raises(
        ModelFormatError, match="missing tensors: model.layers.1.self_attn.k_proj.weight"
    ):
        load_model(missing, CPU)


def test_a_config_without_a_size_the_model_needs_names_it(llama_dir, tmp_path):
    """It raised TypeError out of the model's dataclass (a traceback, not an error line)."""
    path = edit(
        copy(llama_dir, tmp_path),
        config=lambda c: (c.pop("intermediate_size"), c.pop("vocab_size")),
    )
    with pytest.raises(
        ModelFormatError,
        match=r"config\.json: no intermediate_size, vocab_size, which a llama model needs",
    ):
        load_model(path, CPU)


def test_paths_that_are_not_a_model_folder_say_what_to_give(llama_dir, tmp_path):
    with pytest.raises(
        ModelNotFoundError, match="one file of a Hugging Face model; give its folder"
    ):
        load_model(llama_dir / "model.safetensors", CPU)
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    for name in ("m-Q4_K_M.gguf", "m-Q8_0.gguf"):
        (ggufs / name).write_bytes(b"GGUF")
    with pytest.raises(
        ModelNotFoundError,
        match="a folder of GGUF files.*give one of its files: m-Q4_K_M.gguf, m-Q8_0.gguf",
    ):
        load_model(ggufs, CPU)


def test_a_broken_sentencepiece_tokenizer_is_one_clear_error(llama_dir, tmp_path):
    """tokenizer.model without tokenizer.json is read (tests/test_sentencepiece_model.py);
    one that is no SentencePiece model is refused, saying so."""
    path = copy(llama_dir, tmp_path)
    (path / "tokenizer.model").write_bytes(b"\n\x00")
    with pytest.raises(TokenizerError, match="tokenizer.model: not a SentencePiece model"):
        api.load(str(path), device="cpu")

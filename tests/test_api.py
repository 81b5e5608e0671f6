"""Engine defaults come from the model files: sampling settings and every EOS id."""

import json
import shutil

import gguf
import numpy as np
import pytest
from helpers import STORIES_GGUF, STORIES_HF

from llmrun import api
from llmrun.errors import TokenizerError, UnsupportedError
from llmrun.loading.gguf_io import read_gguf


def hf_copy(tmp_path, generation_config):
    path = tmp_path / "m"
    shutil.copytree(STORIES_HF, path)
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_llama_cpp_defaults_when_the_model_has_none():
    d = api.load(None, device="cpu").defaults
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repeat_penalty) == (
        0.8,
        40,
        0.95,
        0.05,
        1.0,
    )


def test_generation_config_sets_defaults_and_eos_list(tmp_path):
    path = hf_copy(
        tmp_path,
        {
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 20,
            "repetition_penalty": 1.1,
            "eos_token_id": [2, 5],
        },
    )
    engine = api.load(str(path), device="cpu")
    d = engine.defaults
    assert (d.temperature, d.top_k, d.top_p, d.repeat_penalty, d.min_p) == (0.6, 20, 0.9, 1.1, 0.05)
    assert {2, 5} <= set(engine.eos_ids)


def test_do_sample_false_means_greedy(tmp_path):
    engine = api.load(str(hf_copy(tmp_path, {"do_sample": False})), device="cpu")
    assert engine.defaults.temperature == 0.0


def test_gguf_sampling_metadata_sets_defaults(tmp_path):
    source = read_gguf(STORIES_GGUF)
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in source.metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            sub = {
                str: gguf.GGUFValueType.STRING,
                float: gguf.GGUFValueType.FLOAT32,
                int: gguf.GGUFValueType.INT32,
            }
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub[type(value[0])])
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_sampling_temp(0.3)
    writer.add_sampling_top_k(7)
    writer.add_sampling_penalty_repeat(1.2)
    for info in source.tensors.values():
        data = np.frombuffer(
            source.buffer, dtype=np.float32, count=info.nbytes // 4, offset=info.offset
        )
        writer.add_tensor(info.name, data.reshape(info.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    engine = api.load(str(path), device="cpu")
    d = engine.defaults
    assert (d.temperature, d.top_k, d.repeat_penalty) == (0.3, 7, 1.2)
    assert engine.eos_ids == [2]


def test_gguf_vocabulary_lists_are_released_once_the_tokenizer_has_them():
    # The metadata's copy of a 150k-token vocabulary is ~30 MB of Python objects.
    engine = api.load(None, device="cpu")
    metadata = engine.checkpoint.gguf.metadata
    assert "tokenizer.ggml.tokens" not in metadata and "tokenizer.ggml.merges" not in metadata
    assert "tokenizer.ggml.model" in metadata
    ids = engine.tokenizer.encode("Once upon a time")
    assert engine.tokenizer.decode(ids) == "Once upon a time"
    assert engine.eos_ids == [2]


def fake_cuda(monkeypatch, free: int) -> None:
    """A CUDA device with `free` bytes free, as far as the checks before loading see."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))


def test_weights_that_do_not_fit_the_gpu_are_one_line_with_the_sizes(monkeypatch):
    import pytest

    from llmrun.errors import UsageError

    fake_cuda(monkeypatch, 100 << 10)
    with pytest.raises(UsageError) as refused:
        api.load(str(STORIES_GGUF), device="cuda")
    # stories260K's 292,800 parameters: F32 in the file, bf16 on an accelerator.
    assert str(refused.value) == "the weights take 0.6 MiB on cuda, but 0.1 MiB is free"


def test_a_context_whose_kv_cache_does_not_fit_the_gpu_is_refused(monkeypatch):
    import pytest
    import torch

    from llmrun.errors import UsageError
    from llmrun.loading import loader

    fake_cuda(monkeypatch, 1 << 20)
    real = loader.load_model
    monkeypatch.setattr(
        api,
        "load_model",
        lambda path, device, dtype, *adapters: real(path, torch.device("cpu"), "bf16", *adapters),
    )
    with pytest.raises(UsageError) as refused:
        api.load(str(STORIES_GGUF), device="cuda", ctx_size=4096)
    # 5 layers x 4 KV heads x 8 values x keys and values x 2 bytes: 640 bytes a token.
    assert str(refused.value) == (
        "a KV cache of 4096 tokens takes 2.5 MiB on cuda, but 1.0 MiB is free: lower "
        "--ctx-size or use --cache-type q8_0"
    )
    assert api.load(str(STORIES_GGUF), device="cuda", ctx_size=1024).ctx_size == 1024


def refuse_weights(*args, **kwargs):
    raise AssertionError("the weights were loaded")


def test_an_unknown_pre_tokenizer_is_refused_before_the_weights_load(monkeypatch):
    opened = api.open_checkpoint

    def with_unknown_pre(path):
        checkpoint = opened(path)
        checkpoint.gguf.metadata.update(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nonesuch"}
        )
        return checkpoint

    monkeypatch.setattr(api, "open_checkpoint", with_unknown_pre)
    monkeypatch.setattr(api, "load_model", refuse_weights)
    with pytest.raises(UnsupportedError, match="'nonesuch' is not supported"):
        api.load(str(STORIES_GGUF), device="cpu")


def test_a_folder_without_tokenizer_json_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    path = hf_copy(tmp_path, {})
    (path / "tokenizer.json").unlink()
    monkeypatch.setattr(api, "load_model", refuse_weights)
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        api.load(str(path), device="cpu")


@pytest.mark.parametrize("config_has_one", [False, True])
def test_a_folder_template_in_chat_template_json_is_used_where_tokenizer_config_has_none(
    tmp_path, config_has_one
):
    """As llama.cpp's converter (gguf-py's SpecialVocab) reads them: tokenizer_config.json's
    chat_template, else chat_template.json's (a processor's, as many vision folders ship)."""
    folder = shutil.copytree(STORIES_HF, tmp_path / "model")
    processor = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": processor}))
    if config_has_one:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = api.load(str(folder))
    text = engine.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == ("<hi>" if config_has_one else "[user] hi")

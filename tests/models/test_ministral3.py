"""Ministral 3 against transformers' Ministral3ForCausalLM: YaRN RoPE, and Llama 4's
attention temperature past the original context, from a config.json and from a
"mistral3" GGUF written as llama.cpp's converter writes it (conversion/mistral3.py:
LlamaModel's permuted q/k, the YaRN keys, attention.temperature_scale). A mistral3
GGUF without the temperature (Mistral Small 3.1+) is a plain Mistral."""

import numpy as np
import pytest
import torch
from helpers import STORIES_GGUF, _permute, gguf_name, our_model, randomize

from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

ROPE = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    llama_4_scaling_beta=0.1,
)
CONFIG = dict(
    model_type="ministral3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=ROPE,
)
# 70 positions: steps 0 to 4 of the original 16, so query scales of 1 to 1 + 0.1 log 5.
IDS = torch.randint(3, 512, (1, 70), generator=torch.Generator().manual_seed(1))


def hf_model(**rope):
    config = transformers.AutoConfig.for_model(**{**CONFIG, "rope_parameters": {**ROPE, **rope}})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def decoded(model) -> torch.Tensor:
    """llmrun's logits through a KV cache: a prefill of 10, then one token at a time."""
    cache = model.new_cache(1, 128, torch.float32, "cpu")
    out = []
    with torch.no_grad():
        for start, end in [(0, 10)] + [(i, i + 1) for i in range(10, IDS.shape[1])]:
            positions = torch.arange(start, end)[None]
            out.append(model(IDS[:, start:end], positions, cache))
    return torch.cat(out, dim=1)


def write_mistral3(path, model, temperature: bool):
    """The model as llama.cpp writes a Ministral 3 (temperature) or a Mistral Small
    (no YaRN, no temperature) as arch mistral3."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "mistral3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(ROPE["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    if temperature:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(ROPE["factor"])
        writer.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(ROPE["mscale_all_dim"])
        writer.add_rope_scaling_yarn_beta_fast(ROPE["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(ROPE["beta_slow"])
        writer.add_attn_temperature_scale(ROPE["llama_4_scaling_beta"])
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        projection = name.rsplit(".", 2)[-2]
        if projection in heads:
            data = _permute(data, heads[projection])
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_ministral3_matches_transformers_past_its_original_context():
    hf = hf_model()
    expected = reference(hf)
    # Without the temperature the scores past position 16 differ (it matters here).
    plain = reference(hf_model(llama_4_scaling_beta=0.0))
    assert (plain[0, 16:] - expected[0, 16:]).abs().max() > 0.1
    ours = our_model(hf.config.to_dict(), hf.state_dict())
    with torch.no_grad():
        whole = ours(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (decoded(ours) - expected).abs().max() < 1e-4


def test_a_mistral3_gguf_with_a_temperature_is_ministral3(tmp_path):
    hf = hf_model()
    loaded = load_model(
        write_mistral3(tmp_path / "m.gguf", hf, temperature=True), torch.device("cpu")
    )
    assert loaded.checkpoint.config["model_type"] == "ministral3"
    expected = reference(hf)
    assert (decoded(loaded.model) - expected).abs().max() < 1e-4


def test_a_mistral3_gguf_without_one_is_a_mistral(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(
            **{**CONFIG, "model_type": "mistral", "rope_parameters": None, "rope_theta": 1e4}
        ),
        dtype=torch.float32,
    ).eval()
    randomize(hf)
    hf.config.head_dim = CONFIG["head_dim"]
    loaded = load_model(
        write_mistral3(tmp_path / "m.gguf", hf, temperature=False), torch.device("cpu")
    )
    assert loaded.checkpoint.config["model_type"] == "mistral"
    assert (decoded(loaded.model) - reference(hf)).abs().max() < 1e-4

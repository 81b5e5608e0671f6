"""GLM-4 (glm-4-9b-hf, glm-4-9b-chat-hf) against transformers' GlmForCausalLM, from a
config.json and from a "chatglm" GGUF written as llama.cpp's converter writes it
(conversion/chatglm.py ChatGLMModel): TextModel's shape keys as that converter reads them
(the context length is the hidden size where the config has no seq_length, the norm's
epsilon 1e-5 where it has no layernorm_epsilon, the RoPE base 10000 * rope_ratio), the
rotated width as half of hidden / heads, q/k rows as they are, gate_up_proj as ffn_up;
the original ChatGLMModel checkpoints' fused query_key_value as attn_qkv; no BOS token
added to prompts (tokenizer.ggml.add_bos_token false).

Its features each move the logits by far more than the tolerance: RoPE on adjacent pairs
(not halves), on half of each head (not all of it), the q/k/v biases; and the norms
before each sublayer only (GLM-4 0414's extra norms after them make another model).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded to
the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights gguf
dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    load_matching_weights,
    max_diff,
    write_keyed_gguf,
)
from family_checks import hf_model_of as hf_model_from
from gguf import Keys
from helpers import BASE, cached_logits, gguf_name, our_model, save_hf_dir

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model
from llmrun.models import glm4

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
# head_dim = hidden / heads, as the converter assumes; rope_theta 10000, as it writes.
GLM = dict(BASE, model_type="glm", head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0)
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 9.8e-3, bf16 1.2e-1.
DRIFT = {"f16": 2e-2, "bf16": 2.5e-1}


def hf_model(**overrides):
    """The tiny random GlmForCausalLM (f32, eval; vocabulary of 512)."""
    return hf_model_from({**GLM, **overrides})


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def write_glm_gguf(path, hf, qtype=None, fused: bool = False, rope_dims=None):
    """The model as llama.cpp's converter writes GlmForCausalLM as "chatglm" (with
    `fused`, as it writes the original ChatGLMModel checkpoints: q, k and v rows and
    biases in one attn_qkv), 2-D weights in `qtype` (default F32). rope_dims: another
    rope.dimension_count, for the refusal."""
    config = hf.config
    hidden, heads = config.hidden_size, config.num_attention_heads
    keys = {
        Keys.LLM.CONTEXT_LENGTH: hidden,  # hparams.get("seq_length", n_embed)
        Keys.LLM.EMBEDDING_LENGTH: hidden,
        Keys.LLM.FEED_FORWARD_LENGTH: config.intermediate_size,
        Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        Keys.Attention.HEAD_COUNT: heads,
        Keys.Attention.HEAD_COUNT_KV: config.num_key_value_heads,
        Keys.Attention.LAYERNORM_RMS_EPS: 1e-5,  # hparams.get("layernorm_epsilon", 1e-5)
        Keys.Rope.DIMENSION_COUNT: rope_dims or int(hidden // heads * 0.5),
        Keys.Rope.FREQ_BASE: 10000.0,  # 10000 * rope_ratio, where the config has one
        Keys.Tokenizer.ADD_BOS: False,
    }
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    tensors = {}
    for name, data in state.items():
        if fused and ".self_attn.k_proj." in name or fused and ".self_attn.v_proj." in name:
            continue
        if fused and ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            tensors[gguf_name(name.replace("q_proj", "qkv_proj"))] = torch.cat(
                [torch.from_numpy(p) for p in parts]
            ).numpy()
            continue
        tensors[gguf_name(name)] = data
    return write_keyed_gguf(path, "chatglm", keys, tensors, qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits(family, monkeypatch):
    """Whole heads rotated, no q/k/v biases, GLM-4 0414's post-norms (its weights, near
    1, added), or halves rotated instead of adjacent pairs: each changes the logits by
    far more than the tolerance, and llmrun follows the config's variants."""
    hf, expected = family
    for variant in (dict(partial_rotary_factor=1.0), dict(attention_bias=False)):
        other = hf_model(**variant)
        assert max_diff(reference(other), expected) > 0.1
        assert max_diff(cached_logits(ours(other), IDS), reference(other)) < 1e-4
    post_norms = hf_model_from({**GLM, "model_type": "glm4"})
    load_matching_weights(hf, post_norms)
    assert max_diff(reference(post_norms), expected) > 0.1
    model = ours(hf)
    monkeypatch.setattr(glm4.Attention, "rotate", lambda self, x, frame: frame.rotate(x))
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_a_config_without_head_dim_takes_glm_configs_128():
    from llmrun.models.glm import ModelArgs

    config = {k: v for k, v in GLM.items() if k != "head_dim"}
    assert ModelArgs.from_config(config).head_dim == 128


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), CPU, "f32")
    assert loaded.model.decode_step is None  # the native step has no pair rotation
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["glm-hf", "chatglm-fused-qkv"])
def test_a_chatglm_gguf_matches_transformers(family, tmp_path, fused):
    hf, expected = family
    loaded = load_model(write_glm_gguf(tmp_path / "m.gguf", hf, fused=fused), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "glm" and config["attention_bias"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["glm-hf", "chatglm-fused-qkv"])
def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path, fused):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_glm_gguf(tmp_path / "q.gguf", hf, q8, fused), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_rotated_width_that_is_not_pairs_of_a_head_is_refused(family, tmp_path):
    path = write_glm_gguf(tmp_path / "m.gguf", family[0], rope_dims=7)
    with pytest.raises(ModelFormatError, match="rope.dimension_count is 7"):
        load_model(path, CPU, "f32")


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf, _ = family
    check_run_and_show(hf, write_glm_gguf(tmp_path / "glm.gguf", hf), "glm")

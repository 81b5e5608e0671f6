"""StarCoder2 against transformers' Starcoder2ForCausalLM, from a config.json and from a
"starcoder2" GGUF written as llama.cpp's converter writes it (conversion/starcoder.py
StarCoder2Model: TextModel's keys, the LayerNorms' epsilon as
attention.layer_norm_epsilon, tensors unpermuted, no sliding-window key).

Its features each move the logits by far more than the tolerance (asserted below): the
biases (use_bias), the sliding window, the RoPE base, a separate output matrix; the
LayerNorms' biases and the ungated GELU feed-forward are weights the model must take.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import model_module
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
STARCODER2 = dict(
    model_type="starcoder2",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    max_position_embeddings=256,
    norm_epsilon=1e-5,
    rope_theta=100000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
WINDOW = 8  # well inside SEQ, so the window hides keys
# A typed cache's drift from f32 logits, measured: f16 1e-3, bf16 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random Starcoder2ForCausalLM (f32, eval), STARCODER2 with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**STARCODER2, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping for starcoder2).
_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def write_starcoder2_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes StarCoder2: TextModel's keys (no window:
    the converter writes none), the tensors unpermuted, no output matrix where the
    embeddings are tied, 2-D weights in `qtype` (default F32). `keys`: metadata to
    change ("{arch}.…" -> value, None leaves a key out)."""
    config = hf.config
    metadata = {
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": config.num_attention_heads,
        "{arch}.attention.head_count_kv": config.num_key_value_heads,
        "{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "{arch}.attention.layer_norm_epsilon": float(config.norm_epsilon),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        **keys,
    }
    tied = config.tie_word_embeddings
    tensors = {
        gguf_tensor_name(name): t.detach().float().numpy()
        for name, t in hf.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    return write_keyed_gguf(path, "starcoder2", metadata, tensors, qtype)


@pytest.fixture(scope="module", params=["tied", "untied"])
def family(request):
    hf = hf_model(tie_word_embeddings=request.param == "tied")
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """No biases, a sliding window, another RoPE base, untied output: each changes the
    logits by far more than the tolerance, and llmrun follows each variant."""
    expected = reference(hf_model())
    for variant in (
        dict(use_bias=False),
        dict(sliding_window=WINDOW),
        dict(rope_theta=10000.0),
        dict(tie_word_embeddings=False),
    ):
        hf = hf_model(**variant)
        assert max_diff(reference(hf), expected) > 0.1, variant
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4, variant


def test_the_sliding_window_through_the_cache_and_the_pool():
    """A window of WINDOW positions: whole, through the KV cache, through serve's
    paged blocks, all as transformers."""
    hf = hf_model(sliding_window=WINDOW)
    expected = reference(hf)
    model = ours(hf)
    check_whole_and_cached(model, IDS, expected)
    check_paged(model, IDS, expected)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_starcoder2_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "starcoder2" and config["use_bias"]
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert "sliding_window" not in config  # llama.cpp's starcoder2 has none
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_biases(tmp_path):
    """use_bias false: the converter writes no bias tensors, llmrun reads none (llama.cpp
    itself requires them)."""
    hf = hf_model(use_bias=False)
    loaded = load_model(write_starcoder2_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["use_bias"] is False
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(tie_word_embeddings=False)
    f32 = reference(hf)
    loaded = load_model(write_starcoder2_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(tmp_path):
    """config.json and safetensors as save_pretrained writes them (the tied lm_head left
    out), with a window."""
    hf = hf_model(sliding_window=WINDOW)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "starcoder2"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


@pytest.mark.parametrize("window", [None, WINDOW])
def test_the_static_decode_step_gives_the_ordinary_logits(window, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(hf_model(sliding_window=window)), monkeypatch)


def test_the_native_decode_step_is_not_attached(tmp_path):
    """The native step knows no LayerNorm or ungated feed-forward: the loader leaves
    StarCoder2 to the torch layers."""
    loaded = load_model(write_starcoder2_gguf(tmp_path / "m.gguf", hf_model()), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(ours(hf_model()))


def test_partial_rope_is_refused(tmp_path):
    path = write_starcoder2_gguf(
        tmp_path / "m.gguf", hf_model(), **{"{arch}.rope.dimension_count": 8}
    )
    with pytest.raises(UnsupportedError, match="rotates 8 of 16 features"):
        load_model(path, CPU, "f32")
    with pytest.raises(UnsupportedError, match="partial RoPE"):
        model_module("starcoder2").ModelArgs.from_config(
            {**hf_model().config.to_dict(), "partial_rotary_factor": 0.5}
        )


def test_a_gguf_without_the_layernorm_epsilon_is_refused(tmp_path):
    """llama.cpp's load_arch_hparams requires it; no default would be the model's."""
    path = write_starcoder2_gguf(
        tmp_path / "m.gguf", hf_model(), **{"{arch}.attention.layer_norm_epsilon": None}
    )
    with pytest.raises(ModelFormatError, match="layer_norm_epsilon"):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    check_run_prints_greedy_tokens(hf, write_starcoder2_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_starcoder2_gguf(tmp_path):
    path = write_starcoder2_gguf(tmp_path / "m.gguf", hf_model())
    # Two layers of 8192 positions: 2 KV heads of 16 floats, keys and values.
    check_show(path, "starcoder2", 2 * 2 * 2 * 16 * 4 * 8192)

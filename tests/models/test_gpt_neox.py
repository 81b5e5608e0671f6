"""GPT-NeoX (Pythia, GPT-NeoX-20B) against transformers' GPTNeoXForCausalLM, from a
config.json (transformers 5's, and the Hub's older one: rotary_pct, rotary_emb_base,
embed_out, the attention's mask buffers) and from a "gptneox" GGUF written as llama.cpp's
converter writes it (conversion/gptneox.py GPTNeoXModel: context, embedding and
feed-forward lengths, block and head counts, rope.dimension_count = int(rotary_pct *
head width), use_parallel_residual, attention.layer_norm_epsilon, no RoPE base; the
fused query_key_value's rows reordered from per head [q|k|v] to all q, all k, all v).

Its features each move the logits by far more than the tolerance (asserted below): the
parallel residual (against the sequential one), the partial rotation, the RoPE base,
the fused projection's per-head order (a GGUF loaded without undoing the converter's
reorder), the LayerNorms' biases; the GELU's form (exact in config.json's "gelu", the
tanh approximation llama.cpp computes, "gelu_new", in a GGUF).

The tiny model: 2 layers, hidden 64, 4 heads of 16 (8 features rotated), a feed-forward
of 256, stories260K's 512-token vocabulary.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
"""

import json

import numpy as np
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
from llmrun.loading import gpt_neox as loading
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import Weight, load_model
from llmrun.models import gpt_neox
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
NEOX = dict(
    model_type="gpt_neox",
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    max_position_embeddings=256,
    layer_norm_eps=1e-5,
    rotary_pct=0.5,  # 8 of each head's 16 features rotate
    rotary_emb_base=10000.0,  # the base llama.cpp takes: the converter writes none
    hidden_act="gelu_new",  # llama.cpp's GELU; config.json's "gelu" is tried below
    use_parallel_residual=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 2e-3, bf16 2e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random GPTNeoXForCausalLM (f32, eval), NEOX with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**NEOX, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    weights = loading.hf_weights({k: Weight(v) for k, v in hf.state_dict().items()})
    return our_model(hf.config.to_dict(), {k: w.tensor for k, w in weights.items()})


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping for gptneox).
_NAMES = {
    "input_layernorm": "attn_norm",
    "attention.query_key_value": "attn_qkv",
    "attention.dense": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.dense_h_to_4h": "ffn_up",
    "mlp.dense_4h_to_h": "ffn_down",
}
_GLOBAL = {
    "gpt_neox.embed_in": "token_embd",
    "gpt_neox.final_layer_norm": "output_norm",
    "lm_head": "output",
}


def converted(hf, reorder: bool = True) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, the fused projection's rows (and bias)
    reordered as GPTNeoXModel.modify_tensors reorders them (unless not `reorder`)."""
    heads = hf.config.num_attention_heads
    out = {}
    for name, t in hf.state_dict().items():
        module, _, suffix = name.rpartition(".")
        data = t.detach().float()
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = data.numpy()
            continue
        _, _, layer, rest = module.split(".", 3)
        if rest == "attention.query_key_value" and reorder:
            # [heads * 3 * D, ...] -> [heads, 3, D, ...] -> [3, heads, D, ...]
            data = data.unflatten(0, (heads, 3, -1)).transpose(0, 1).flatten(0, 2)
        out[f"blk.{layer}.{_NAMES[rest]}.{suffix}"] = np.ascontiguousarray(data.numpy())
    return out


def write_gpt_neox_gguf(path, hf, qtype=None, reorder=True, **keys):
    """The model as llama.cpp's converter writes GPT-NeoX: GPTNeoXModel's keys, the fused
    projection reordered, 2-D weights in `qtype` (default F32), stories260K's vocabulary.
    `keys`: metadata to change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    n_embd, n_head = config.hidden_size, config.num_attention_heads
    rotary_pct = config.rope_parameters["partial_rotary_factor"]
    metadata = {
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": n_embd,
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.rope.dimension_count": int(rotary_pct * (n_embd // n_head)),
        "{arch}.attention.head_count": n_head,
        "{arch}.use_parallel_residual": bool(config.use_parallel_residual),
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_eps),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    return write_keyed_gguf(path, "gptneox", metadata, converted(hf, reorder), qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


VARIANTS = {
    "parallel": {},
    "sequential": dict(use_parallel_residual=False),
    "whole-heads": dict(rotary_pct=1.0),
    "exact-gelu": dict(hidden_act="gelu"),
    "base-1000": dict(rotary_emb_base=1000.0),
    "no-attention-bias": dict(attention_bias=False),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(3, 11, 9)), expected) < 1e-4


def test_each_feature_moves_the_logits(family):
    """The sequential residual, whole-head rotation and another RoPE base each change
    transformers' logits by far more than the tolerance, the exact GELU by more than it
    (and llmrun follows each, above); so do the LayerNorms' biases and the attention's,
    which llmrun must take."""
    hf, expected = family
    for variant in ("sequential", "whole-heads", "base-1000"):
        assert max_diff(reference(hf_model(**VARIANTS[variant])), expected) > 0.1, variant
    # The two GELUs differ by at most 1e-3 an activation: 10 times the tolerance here.
    assert max_diff(reference(hf_model(**VARIANTS["exact-gelu"])), expected) > 1e-3
    for suffix in ("layernorm.bias", "final_layer_norm.bias", "query_key_value.bias"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        assert max_diff(reference(changed), expected) > 0.1, suffix


def test_the_parallel_residual_is_followed(family, monkeypatch):
    """llmrun with the sequential block on the parallel model's weights leaves
    transformers' logits: the flag is read, not assumed."""
    hf, expected = family
    model = ours(hf)
    for layer in model.model.layers:
        layer.parallel = False
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_hub_config_of_the_older_style_reads_the_same(family):
    """rotary_pct and rotary_emb_base at the top level, as Pythia's config.json has them;
    without them, transformers' defaults (a quarter of each head, base 10000)."""
    config = {k: v for k, v in family[0].config.to_dict().items() if k != "rope_parameters"}
    args = gpt_neox.ModelArgs.from_config({**config, "rotary_pct": 0.5, "rotary_emb_base": 500.0})
    assert args.rope_parameters["partial_rotary_factor"] == 0.5
    assert args.rope_parameters["rope_theta"] == 500.0
    args = gpt_neox.ModelArgs.from_config(config)
    assert args.rope_parameters["partial_rotary_factor"] == 0.25
    assert args.rope_parameters["rope_theta"] == 10000.0


def test_an_hf_folder_with_the_hubs_names_loads_as_transformers_runs_it(tmp_path):
    """save_pretrained writes the Hub's names (gpt_neox., embed_out.); Pythia's files also
    hold the attention's mask buffers, which are not weights."""
    from safetensors.torch import load_file, save_file

    hf = hf_model(use_parallel_residual=False, hidden_act="gelu")
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    assert "embed_out.weight" in tensors
    tensors["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    tensors["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(tensors, file)
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gpt_neox"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("variant", ["parallel", "sequential"])
def test_a_gguf_matches_transformers(variant, tmp_path):
    hf = hf_model(**VARIANTS[variant])
    path = write_gpt_neox_gguf(tmp_path / "m.gguf", hf)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "gpt_neox" and config["hidden_act"] == "gelu_new"
    assert config["use_parallel_residual"] == (variant == "parallel")
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_converters_qkv_reorder_is_undone(family, tmp_path, monkeypatch):
    """Loaded as the file's rows stand (all q, all k, all v read per head), the logits
    leave transformers'; a file written without the reorder reads wrong, too."""
    hf, expected = family
    path = write_gpt_neox_gguf(tmp_path / "m.gguf", hf)
    monkeypatch.setattr(loading, "gguf_weights", lambda weights, config, weight_type: weights)
    assert max_diff(cached_logits(load_model(path, CPU, "f32").model, IDS), expected) > 0.1
    monkeypatch.undo()
    unordered = write_gpt_neox_gguf(tmp_path / "u.gguf", hf, reorder=False)
    assert max_diff(cached_logits(load_model(unordered, CPU, "f32").model, IDS), expected) > 0.1


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    path = write_gpt_neox_gguf(tmp_path / "q.gguf", hf, q8)
    loaded = load_model(path, CPU, "f32")
    assert read_gguf(path, with_tensors=False).tensors["blk.0.attn_qkv.weight"].ggml_type == q8
    dequantize_2d_weights(hf, q8)  # whole rows quantize alike in either order
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_a_rope_dimension_count_rotates_whole_heads(tmp_path):
    """llama.cpp's n_rot is the head width where the file gives none (not transformers'
    default quarter)."""
    hf = hf_model(rotary_pct=1.0)
    path = write_gpt_neox_gguf(tmp_path / "m.gguf", hf, **{"{arch}.rope.dimension_count": None})
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == 1.0
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


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """The native step knows no fused per-head projection, LayerNorm or parallel block:
    the loader leaves GPT-NeoX to the torch layers."""
    loaded = load_model(write_gpt_neox_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(ours(family[0]))


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.use_parallel_residual": None}, ModelFormatError, "use_parallel_residual"),
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.attention.head_count_kv": 2}, UnsupportedError, "as many KV heads"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_gpt_neox_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_heads_of_another_width_are_refused(family, tmp_path):
    """GPT-NeoX's heads are hidden size / heads wide; a file saying otherwise is refused."""
    keys = {"{arch}.attention.key_length": 8, "{arch}.attention.value_length": 8}
    path = write_gpt_neox_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(UnsupportedError, match="hidden size / heads"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_gpt_neox_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_gptneox_gguf(family, tmp_path):
    path = write_gpt_neox_gguf(tmp_path / "m.gguf", family[0])
    # Two layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    check_show(path, "gptneox", 2 * 2 * 4 * 16 * 4 * 8192)


def test_config_json_round_trip_keeps_the_hub_fields(tmp_path):
    """A config.json as the Hub's Pythia files have it (no rope_parameters) loads."""
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    del config["rope_parameters"]
    config.update(rotary_pct=0.5, rotary_emb_base=10000.0)
    config_path.write_text(json.dumps(config))
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4

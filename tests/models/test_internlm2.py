"""InternLM2/2.5 against transformers' LlamaForCausalLM of the same weights (transformers
has no InternLM2; its remote code, modeling_internlm2.py, computes Llama's math), from a
folder as the Hub's checkpoints hold it and from an "internlm2" GGUF written as
llama.cpp's converter writes it.

The folder follows modeling_internlm2.py and config.json of internlm2-chat-7b: the
modules model.tok_embeddings, attention.wqkv, attention.wo, feed_forward.w1/w3/w2,
attention_norm, ffn_norm, output; `bias` for the attention's biases; rope_scaling
{"type": "dynamic"} (InternLM2.5's) or linear. The test fuses Llama's q/k/v into wqkv as
the remote code reads it and the converter splits it (conversion/internlm.py
InternLM2Model): rows grouped by KV head, each group its query heads, then its key head,
then its value head; llmrun's loader splits them. The GGUF holds what the converter writes:
TextModel's keys (no key length), split attn_q/attn_k/attn_v with q and k rows permuted as
a llama's, nothing for dynamic scaling, linear scaling's type and factor.

Its features each move the logits by far more than the tolerance: the biases, linear
scaling, the grouped wqkv rows (split as if queries, keys and values followed each other
they give other logits). Dynamic NTK scaling is plain RoPE within max_position_embeddings
(test_internlm3.py holds transformers to that), and llmrun refuses positions past it.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time, the native decode
step included where the loader attaches it), contiguous or paged. An f16 or bf16 cache:
1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT from
f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from helpers import BASE, _permute, cached_logits, gguf_name, our_model, randomize

from llmrun.errors import ContextOverflowError, ModelFormatError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
# 4 query heads on 2 KV heads: groups of 2 queries, a key and a value.
LLAMA = dict(BASE, model_type="llama", rope_theta=1000000.0)
LINEAR = dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)
VARIANTS = {
    "default": {},
    "biased": dict(attention_bias=True),
    "linear": dict(rope_parameters=LINEAR),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 9e-3 to 2e-2, bf16 7e-2 to 0.12.
DRIFT = {"f16": 5e-2, "bf16": 4e-1}
# Llama's module names -> InternLM2's (modeling_internlm2.py); q/k/v become wqkv.
HUB_NAMES = (
    ("model.embed_tokens.", "model.tok_embeddings."),
    ("lm_head.", "output."),
    (".self_attn.o_proj.", ".attention.wo."),
    (".input_layernorm.", ".attention_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".mlp.gate_proj.", ".feed_forward.w1."),
    (".mlp.up_proj.", ".feed_forward.w3."),
    (".mlp.down_proj.", ".feed_forward.w2."),
)


def hf_model(**overrides):
    """The reference: a tiny transformers LlamaForCausalLM with randomize()'s weights."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**LLAMA, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def hub_config(hf, dynamic: bool = True) -> dict:
    """config.json as internlm2-chat-7b's spells it: `bias`, rope_theta at the top, the
    Llama's linear scaling, or else (with `dynamic`) InternLM2.5's dynamic NTK scaling."""
    config = hf.config
    rope = config.rope_parameters
    scaling = {"type": "dynamic", "factor": 2.0} if dynamic else None
    if rope["rope_type"] == "linear":
        scaling = {"type": "linear", "factor": rope["factor"]}
    return dict(
        model_type="internlm2",
        architectures=["InternLM2ForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        bias=config.attention_bias,
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def ours(hf) -> torch.nn.Module:
    """llmrun's internlm2 model of the Llama's weights under Llama's names (the loader's)."""
    return our_model(hub_config(hf), hf.state_dict())


def fuse_wqkv(q, k, v, kv_heads: int) -> torch.Tensor:
    """q [H * D, ...], k and v [Hkv * D, ...] as modeling_internlm2.py's wqkv: per KV head,
    its H / Hkv query heads, its key head, its value head."""
    rest, head_dim = q.shape[1:], k.shape[0] // kv_heads
    # [heads * D, ...] -> [Hkv, heads per KV head, D, ...]
    q, k, v = (t.reshape(kv_heads, -1, head_dim, *rest) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def hub_state(hf, grouped: bool = True) -> dict[str, torch.Tensor]:
    """The Llama's weights as InternLM2's checkpoints hold them; without `grouped`, wqkv as
    all queries, all keys, all values (a layout InternLM2 does not have)."""
    state = hf.state_dict()
    kv_heads = hf.config.num_key_value_heads
    out = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            q, k, v = (state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
            fused = fuse_wqkv(q, k, v, kv_heads) if grouped else torch.cat([q, k, v])
            out[name.replace("self_attn.q_proj", "attention.wqkv")] = fused
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        for llama, hub in HUB_NAMES:
            name = name.replace(llama, hub)
        out[name] = tensor.contiguous()
    return out


def write_hub_folder(path, hf, grouped: bool = True, dynamic: bool = True):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hub_config(hf, dynamic)))
    safetensors_torch.save_file(hub_state(hf, grouped), path / "model.safetensors")
    return path


def write_internlm2_gguf(path, hf, qtype=None, rope_dims=None):
    """The model as llama.cpp's converter writes InternLM2: TextModel's keys (no key
    length), linear scaling's type and factor (dynamic's: none), wqkv split with q and k
    rows permuted as a llama's, 2-D weights in `qtype` (default F32). `rope_dims`: a rope
    dimension count the converter does not write."""
    config = hf.config
    writer = gguf_writer(path, "internlm2", config, key_length=False)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    ftype = gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType.MOSTLY_Q8_0
    writer.add_file_type(ftype)
    state = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = torch.from_numpy(_permute(tensor.numpy(), heads))
        state[name] = tensor
    return finish_stories_gguf(writer, path, state, gguf_name, qtype)


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    assert expected.abs().max() > 3
    check_whole_and_cached(ours(hf), IDS, expected)


def test_each_feature_moves_the_logits():
    plain = reference(hf_model())
    for variant in VARIANTS.values():
        if variant:
            assert max_diff(reference(hf_model(**variant)), plain) > 0.1


def test_a_hub_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "internlm2"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_wqkv_s_rows_grouped_by_kv_head_matter(tmp_path):
    """Queries, keys and values one after the other (not InternLM2's layout) load, and
    give other logits: the loader's grouping is what makes the folder's model."""
    hf = hf_model()
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf, grouped=False), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) > 0.1


def test_a_config_without_bias_has_biases(tmp_path):
    """InternLM2Config's `bias` defaults to true: a folder without it and without bias
    tensors lacks tensors the model has."""
    folder = write_hub_folder(tmp_path / "hub", hf_model())
    config = json.loads((folder / "config.json").read_text())
    del config["bias"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="missing tensors: .*bias"):
        load_model(folder, CPU, "f32")


def test_a_wqkv_of_other_head_counts_is_refused(tmp_path):
    folder = write_hub_folder(tmp_path / "hub", hf_model())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(ModelFormatError, match="attention.wqkv.weight has 128 rows"):
        load_model(folder, CPU, "f32")


def test_positions_past_the_dynamic_scaling_s_context_are_refused(tmp_path):
    hf = hf_model(max_position_embeddings=32)
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf), CPU, "f32")
    with pytest.raises(ContextOverflowError, match="past max_position_embeddings \\(32\\)"):
        cached_logits(loaded.model, IDS)
    # Without dynamic scaling, the same model runs every position.
    plain = load_model(write_hub_folder(tmp_path / "plain", hf, dynamic=False), CPU, "f32")
    assert max_diff(cached_logits(plain.model, IDS), reference(hf)) < 1e-4


# The converter cannot write a biased InternLM2: it reshapes wqkv's bias as a matrix.
@pytest.mark.parametrize("variant", ["default", "linear"])
def test_a_gguf_matches_transformers(variant, tmp_path):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    loaded = load_model(write_internlm2_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "internlm2"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    loaded = load_model(write_internlm2_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)  # q/k rows permuted or not, each row quantizes alike
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_partial_rope_is_refused(tmp_path):
    path = write_internlm2_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=8)
    with pytest.raises(ModelFormatError, match="InternLM2 rotates whole heads"):
        load_model(path, CPU, "f32")


def test_the_native_decode_step_gives_the_torch_logits(tmp_path, monkeypatch):
    """InternLM2's layers are Llama's: the loader attaches Llama's native step, and its
    decoded logits are those of the torch layers."""
    hf = hf_model()
    path = write_internlm2_gguf(tmp_path / "m.gguf", hf)
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5
    assert max_diff(cached_logits(native, IDS), reference(hf)) < 1e-4
    assert native.decode_step is not None  # it took the steps


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    check_run_and_show(hf, write_internlm2_gguf(tmp_path / "internlm2.gguf", hf), "internlm2")

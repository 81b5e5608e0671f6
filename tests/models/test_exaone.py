"""EXAONE 3.x against transformers (which runs model_type "exaone" as LlamaForCausalLM),
from a config.json and from an "exaone" GGUF written as llama.cpp's converter writes it
(conversion/exaone.py ExaoneModel: TextModel's keys with key_length, the rope dimension
count, q/k rows as they are, Llama 3 scaling as a rope_freqs tensor of per-frequency
divisors), and from a folder as the Hub's checkpoints are: config.json with num_layers,
layer_norm_epsilon and activation_function, tensors under GPT-2's names
(transformer.h.N.attn.attention.q_proj, ...).

Its features each move the logits by far more than the tolerance: the RoPE base of
500000 a config without rope_theta takes (against 10000), Llama 3 scaling (EXAONE 3.5's),
tied embeddings (the 2.4B's). The GGUF's q/k rows unpermuted would differ too
(test_a_gguf_read_as_llama_s_permuted_rows_would_differ).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time, the native decode
step included), contiguous or paged. An f16 or bf16 cache: 1e-5 against an f32 cache
that stores the values rounded to the type, and DRIFT from f32. A Q8_0 GGUF against
transformers run on the weights gguf dequantizes: 1e-4.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    gguf_writer,
    max_diff,
)
from helpers import BASE, _permute, cached_logits, gguf_name, our_model, randomize
from test_apertus import rope_freqs

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
EXAONE = dict(BASE, model_type="exaone", rope_theta=10000.0)
# EXAONE 3.5's Llama 3 scaling, with an original context (64) that leaves some
# wavelengths of 16-wide heads as they are, smooths some and scales the rest.
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
VARIANTS = {
    "default": {},
    "llama3": dict(rope_parameters=LLAMA3),
    "tied": dict(tie_word_embeddings=True),
}
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 9e-3 to 1.3e-2, bf16 7.6e-2 to 0.12.
DRIFT = {"f16": 3e-2, "bf16": 3e-1}
# transformers' "exaone" renamings, backwards: Llama's module names -> the Hub's.
HUB_NAMES = (
    ("model.embed_tokens.", "transformer.wte."),
    ("model.norm.", "transformer.ln_f."),
    ("model.layers.", "transformer.h."),
    (".self_attn.o_proj.", ".attn.attention.out_proj."),
    (".self_attn.", ".attn.attention."),
    (".input_layernorm.", ".ln_1."),
    (".post_attention_layernorm.", ".ln_2."),
    (".mlp.gate_proj.", ".mlp.c_fc_0."),
    (".mlp.up_proj.", ".mlp.c_fc_1."),
    (".mlp.down_proj.", ".mlp.c_proj."),
)


def hf_model(**overrides):
    """A tiny transformers EXAONE (a LlamaForCausalLM) with randomize()'s weights."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**EXAONE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hf.state_dict())


def exaone_gguf_name(name: str) -> str:
    return name if name == "rope_freqs.weight" else gguf_name(name)


def write_exaone_gguf(path, hf, qtype=None, rope_dims=None, permute=False):
    """The model as llama.cpp's converter writes EXAONE 3.x: TextModel's keys (key and
    value length from the config's head_dim), the rope dimension count (`rope_dims`
    changes it), its base, Llama 3 scaling as rope_freqs, 2-D weights in `qtype`
    (default F32). `permute`: q/k rows as the converter permutes a llama's, which it
    does not do for EXAONE."""
    config = hf.config
    writer = gguf_writer(path, "exaone", config)
    writer.add_rope_dimension_count(rope_dims or config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    state = dict(hf.state_dict())
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    if permute:
        for name, tensor in state.items():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (
                    config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                )
                state[name] = torch.from_numpy(_permute(tensor.numpy(), heads))
    if config.rope_parameters["rope_type"] == "llama3":
        state["rope_freqs.weight"] = torch.from_numpy(rope_freqs(config))
    return finish_stories_gguf(writer, path, state, exaone_gguf_name, qtype)


def hub_name(name: str) -> str:
    for llama, hub in HUB_NAMES:
        name = name.replace(llama, hub)
    return name


def rope_scaling(params: dict) -> dict | None:
    """rope_scaling as EXAONE 3.5's config.json spells it (null: none)."""
    if params["rope_type"] == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def write_hub_folder(path, hf):
    """The model as the Hub's EXAONE 3.x folders hold it: ExaoneConfig's field names as
    the checkpoints spell them (num_layers, layer_norm_epsilon, activation_function),
    tensors under GPT-2's names."""
    path.mkdir()
    config = hf.config
    fields = dict(
        model_type="exaone",
        architectures=["ExaoneForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        layer_norm_epsilon=config.rms_norm_eps,
        activation_function="silu",
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_parameters["rope_theta"],
        rope_scaling=rope_scaling(config.rope_parameters),
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    (path / "config.json").write_text(json.dumps(fields))
    state = {hub_name(k): v.contiguous() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    safetensors_torch.save_file(state, path / "model.safetensors")
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request):
    hf = hf_model(**VARIANTS[request.param])
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """A config without rope_theta takes ExaoneConfig's 500000 (a model at 10000
    differs); Llama 3 scaling and tied embeddings each change the logits too, and llmrun
    follows each variant."""
    plain = reference(hf_model())
    for variant in VARIANTS.values():
        if variant:
            hf = hf_model(**variant)
            assert max_diff(reference(hf), plain) > 0.1
            assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4
    without = {k: v for k, v in EXAONE.items() if k != "rope_theta"}
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**without), dtype=torch.float32
    ).eval()
    randomize(hf)
    assert hf.config.rope_parameters["rope_theta"] == 500000.0
    assert max_diff(reference(hf), plain) > 0.1
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    assert max_diff(cached_logits(our_model(config, hf.state_dict()), IDS), reference(hf)) < 1e-4


def test_a_hub_folder_with_exaone_names_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    folder = write_hub_folder(tmp_path / "hub", hf)
    assert "transformer.h.0.attn.attention.q_proj.weight" in safetensors_io.load_tensors(
        folder / "model.safetensors"
    )
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["num_hidden_layers"] == hf.config.num_hidden_layers
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_show_reads_a_hub_folder_s_layer_count(tmp_path):
    """num_layers counts the KV cache's layers: 2 layers x 2 KV heads x 16 features x
    keys and values x 4 bytes x 8192 positions."""
    folder = write_hub_folder(tmp_path / "hub", hf_model())
    check_show(folder, "exaone", 2 * 2 * 16 * 2 * 4 * 8192)


def test_an_hf_folder_saved_by_transformers_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_exaone_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "exaone"
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_read_as_llama_s_permuted_rows_would_differ(tmp_path):
    """The converter leaves EXAONE's q/k rows as they are (llama.cpp turns it with NEOX
    RoPE): rows permuted as a llama's give other logits, so reading them as they are
    matters."""
    hf = hf_model()
    loaded = load_model(write_exaone_gguf(tmp_path / "p.gguf", hf, permute=True), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) > 0.1


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(rope_parameters=LLAMA3)
    loaded = load_model(write_exaone_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_the_native_decode_step_gives_the_torch_logits(family, tmp_path, monkeypatch):
    """EXAONE's model is Llama's, so the loader attaches Llama's native step; its decoded
    logits are those of the torch layers."""
    hf, expected = family
    path = write_exaone_gguf(tmp_path / "m.gguf", hf)
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5
    assert max_diff(cached_logits(native, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_partial_rope_is_refused(tmp_path):
    path = write_exaone_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=8)
    with pytest.raises(ModelFormatError, match="EXAONE rotates whole heads"):
        load_model(path, CPU, "f32")


def test_a_yarn_magnitude_llama_cpp_would_not_apply_is_refused(tmp_path):
    hf = hf_model()
    config = hf.config
    writer = gguf_writer(tmp_path / "y.gguf", "exaone", config)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(64)
    writer.add_rope_scaling_yarn_attn_factor(1.0)
    path = finish_stories_gguf(writer, tmp_path / "y.gguf", hf.state_dict(), gguf_name)
    with pytest.raises(UnsupportedError, match="which llama.cpp does not apply"):
        load_model(path, CPU, "f32")


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    check_static_decode(ours(family[0]), monkeypatch)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model(rope_parameters=LLAMA3)
    check_run_and_show(hf, write_exaone_gguf(tmp_path / "exaone.gguf", hf), "exaone")

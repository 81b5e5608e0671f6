"""Random-weight models written as GGUF with llama.cpp's conventions load to the
same logits as their safetensors copy and as transformers.

Tolerances: F32 GGUF vs transformers 1e-4 max abs; F16 GGUF vs the same weights
in F16 safetensors, both run in f32: 1e-5 (identical weights, same arithmetic),
and vs transformers in f32 on those weights: 1e-4.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import CONFIGS, save_hf_dir, tiny_hf_model, write_gguf

from llmrun.loading.loader import load_model

pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 2, 44, 501]])
POSITIONS = torch.arange(IDS.shape[1])[None]


def logits(path, dtype="f32"):
    with torch.no_grad():
        return load_model(path, CPU, dtype).model(IDS, POSITIONS)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "llama3-scaled"])
def test_gguf_f32_matches_transformers_and_safetensors(name, tmp_path):
    hf, config = tiny_hf_model(name)
    with torch.no_grad():
        expected = hf(IDS).logits
    gguf_path = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    hf_dir = save_hf_dir(hf, tmp_path / "hf")
    if name != "phi3-longrope":  # llama.cpp writes longrope factors as tensors; see below
        torch.testing.assert_close(logits(gguf_path), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits(hf_dir), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"])
def test_gguf_f16_matches_f16_safetensors(name, tmp_path):
    hf, config = tiny_hf_model(name)
    with torch.no_grad():
        # Weights exactly representable in f16, so both files hold the same values
        # (the parameters only: rounding the RoPE buffers would change the reference).
        for p in hf.parameters():
            p.copy_(p.half().float())
        expected = hf(IDS).logits
    gguf_path = write_gguf(tmp_path / "m.gguf", config, hf.state_dict(), GGMLQuantizationType.F16)
    hf_dir = save_hf_dir(hf, tmp_path / "hf", dtype=torch.float16)
    torch.testing.assert_close(logits(gguf_path), logits(hf_dir), atol=1e-5, rtol=0)
    # Half weights stay half on the CPU (native kernels, f32 arithmetic): the
    # logits are transformers' f32 logits of the same (f16-exact) weights.
    torch.testing.assert_close(logits(gguf_path), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_quantized_gguf_matches_its_dequantized_weights(name, qtype, tmp_path):
    """A Q8_0/Q4_0 GGUF gives the logits of the same model with weights dequantized
    by gguf's own numpy code (1e-4 max abs), and stays near the f32 model. (Gemma 3:
    a tied quantized embedding, scaled by sqrt(hidden), and soft-capped logits.)"""
    import gguf

    hf, config = tiny_hf_model(name)
    state = hf.state_dict()
    dequantized = {
        k: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), qtype), qtype))
        if v.dim() == 2
        else v
        for k, v in state.items()
    }
    quant = logits(write_gguf(tmp_path / "q.gguf", config, state, qtype))
    reference = logits(write_gguf(tmp_path / "deq.gguf", config, dequantized))
    torch.testing.assert_close(quant, reference, atol=1e-4, rtol=0)
    f32 = logits(write_gguf(tmp_path / "f32.gguf", config, state))
    # Logits span about ±7 here. On average 8-bit blocks move them by 0.04 (Llama) and
    # 0.02 (Gemma 3), 4-bit ones by 0.6 and 0.3 (tiny random models with attention far
    # from uniform are chaotic: Q4_0 changes Llama's top token at 2/3 of the positions);
    # another model's logits are 1.7-1.8 away.
    bound = {GGMLQuantizationType.Q8_0: 0.1, GGMLQuantizationType.Q4_0: 1.0}[qtype]
    assert (quant - f32).abs().mean() < bound


def test_llama3_rope_factors_from_rope_freqs_tensor(tmp_path):
    """llama.cpp stores Llama 3.1 RoPE scaling as per-frequency divisors (rope_freqs)."""
    import gguf
    import numpy as np

    from llmrun.models.base import RotaryEmbedding, rope_parameters

    hf, config = tiny_hf_model("llama3-scaled")
    rope = RotaryEmbedding(rope_parameters(config), 16, 256)
    plain = RotaryEmbedding({"rope_type": "default", "rope_theta": 500000.0}, 16, 256)
    factors = (plain.inv_freq / rope.inv_freq).numpy().astype(np.float32)
    path = tmp_path / "m.gguf"
    plain_config = {**config, "rope_parameters": {"rope_theta": 500000.0}}
    state = dict(hf.state_dict())
    write_gguf(path, plain_config, state)
    # Re-write with the rope_freqs tensor appended, as llama.cpp does.
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "scaled.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(
            t.name,
            np.array(t.data),
            raw_shape=list(reversed(t.shape.tolist())),
            raw_dtype=t.tensor_type,
        )
    writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        expected = hf(IDS).logits
    torch.testing.assert_close(logits(tmp_path / "scaled.gguf"), expected, atol=1e-4, rtol=0)
    # `llmrun show` reads the header alone, and the factors from the file (it printed no
    # KV cache size for such files).
    from llmrun.loading import inspect

    shown = inspect.describe(tmp_path / "scaled.gguf")["kv_cache_bytes_8k"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    assert shown == 8192 * 2 * layers * kv_heads * 16 * 4  # keys and values, head_dim 16, f32


# ---- Gemma: llama.cpp's conventions, the multimodal checkpoint, bad files -------------


def rewrite_gguf(src, dst, drop=(), add=()):
    """A copy of a GGUF without the metadata keys `drop`, plus `add` (key, value, type)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *drop):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, value, vtype in add:
        sub = gguf.GGUFValueType.BOOL if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(
            t.name,
            np.array(t.data),
            raw_shape=list(reversed(t.shape.tolist())),
            raw_dtype=t.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_gemma_norms_come_back_as_hf_weights(name, tmp_path):
    """llama.cpp stores Gemma's norm weights as 1 + w; the loader gives the model w,
    exactly the safetensors file's values."""
    import gguf

    hf, config = tiny_hf_model(name)
    path = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    model = load_model(path, CPU).model
    state = hf.state_dict()
    norms = [k for k in state if k.endswith("norm.weight")]
    assert len(norms) == {"gemma": 5, "gemma2": 13, "gemma3": 37}[name]
    for key in norms:
        torch.testing.assert_close(model.state_dict()[key], state[key], atol=1e-7, rtol=0)
    np.testing.assert_allclose(stored["output_norm.weight"], state["model.norm.weight"] + 1)


def test_gemma3_gguf_decodes_past_the_window(tmp_path):
    """The cached decode of a GGUF-loaded Gemma 3 (local layers in a ring of 5)."""
    hf, config = tiny_hf_model("gemma3")
    model = load_model(write_gguf(tmp_path / "m.gguf", config, hf.state_dict()), CPU).model
    with torch.no_grad():
        expected = hf(IDS).logits
        cache = model.new_cache(1, 64, torch.float32, "cpu")
        assert cache.window == 5
        steps = [model(IDS[:, :6], POSITIONS[:, :6], cache)]
        steps += [model(IDS[:, t : t + 1], POSITIONS[:, t : t + 1], cache) for t in range(6, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-4, rtol=0)


def test_multimodal_gemma3_runs_its_language_model(tmp_path, capsys):
    import transformers

    _, text = tiny_hf_model("gemma3")
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        expected = hf(input_ids=IDS).logits
    hf.save_pretrained(tmp_path / "mm")
    capsys.readouterr()
    torch.testing.assert_close(logits(tmp_path / "mm"), expected, atol=1e-4, rtol=0)
    err = capsys.readouterr().err
    assert "a multimodal Gemma 3; running its language model, without the vision tower" in err


def gemma_header(model_type, **metadata):
    """A GGUFFile of metadata only, as config_from_gguf sees it."""
    from pathlib import Path

    from gguf import Keys

    from llmrun.loading.gguf_io import GGUFFile

    arch = {"gemma3_text": "gemma3"}.get(model_type, model_type)
    base = {
        Keys.General.ARCHITECTURE: arch,
        Keys.LLM.BLOCK_COUNT: 26,
        Keys.LLM.CONTEXT_LENGTH: 32768,
        Keys.LLM.EMBEDDING_LENGTH: 1152,
        Keys.LLM.FEED_FORWARD_LENGTH: 6912,
        Keys.Attention.HEAD_COUNT: 4,
        Keys.Attention.HEAD_COUNT_KV: 1,
        Keys.Attention.KEY_LENGTH: 256,
        Keys.Attention.LAYERNORM_RMS_EPS: 1e-6,
        Keys.LLM.VOCAB_SIZE: 262144,
    }
    values = {k.format(arch=arch): v for k, v in {**base, **metadata}.items()}
    values = {k: v for k, v in values.items() if v is not None}
    return GGUFFile(Path(f"{arch}.gguf"), 3, values, {}, None)


def test_gemma3_gguf_metadata_read_as_llama_cpp_reads_it():
    from gguf import Keys

    from llmrun.loading.gguf_config import config_from_gguf

    # Gemma 3 1B's keys as llama.cpp's converter writes them: no layer pattern, no
    # query scale; llama.cpp takes every sixth layer as global and head_dim^-0.5.
    config = config_from_gguf(
        gemma_header(
            "gemma3_text",
            **{
                Keys.Attention.SLIDING_WINDOW: 512,
                Keys.Rope.FREQ_BASE: 1e6,
                Keys.Rope.FREQ_BASE_SWA: 1e4,
            },
        )
    )
    assert (
        config["layer_types"]
        == (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2
    )
    assert config["query_pre_attn_scalar"] == 256 and config["sliding_window"] == 512
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert config["final_logit_softcapping"] is None
    # Without freq_base_swa llama.cpp's default local base, 10000; linear scaling is
    # the global layers' only.
    config = config_from_gguf(
        gemma_header(
            "gemma3_text",
            **{
                Keys.Attention.SLIDING_WINDOW: 1024,
                Keys.Rope.FREQ_BASE: 1e6,
                Keys.Rope.SCALING_TYPE: "linear",
                Keys.Rope.SCALING_FACTOR: 8.0,
            },
        )
    )
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    # No window: every layer global (llama.cpp's LLAMA_SWA_TYPE_NONE).
    config = config_from_gguf(gemma_header("gemma3_text"))
    assert config["layer_types"] == ["full_attention"] * 26 and config["sliding_window"] is None
    # A pattern given as a number or as per-layer flags.
    config = config_from_gguf(
        gemma_header(
            "gemma3_text",
            **{Keys.Attention.SLIDING_WINDOW: 512, Keys.Attention.SLIDING_WINDOW_PATTERN: 2},
        )
    )
    assert config["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2
    flags = [i % 3 != 2 for i in range(26)]
    config = config_from_gguf(
        gemma_header(
            "gemma3_text",
            **{Keys.Attention.SLIDING_WINDOW: 512, Keys.Attention.SLIDING_WINDOW_PATTERN: flags},
        )
    )
    assert config["layer_types"][:3] == ["sliding_attention"] * 2 + ["full_attention"]
    # The 27B (62 layers): queries scaled by (hidden / heads)^-0.5, as llama.cpp does.
    config = config_from_gguf(
        gemma_header(
            "gemma3_text",
            **{
                Keys.LLM.BLOCK_COUNT: 62,
                Keys.LLM.EMBEDDING_LENGTH: 5376,
                Keys.Attention.HEAD_COUNT: 32,
                Keys.Attention.HEAD_COUNT_KV: 16,
                Keys.Attention.SLIDING_WINDOW: 1024,
            },
        )
    )
    assert config["query_pre_attn_scalar"] == 168


def test_gemma2_gguf_defaults_are_llama_cpps():
    from gguf import Keys

    from llmrun.loading.gguf_config import config_from_gguf

    config = config_from_gguf(gemma_header("gemma2"))
    assert config["sliding_window"] == 4096
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    config = config_from_gguf(
        gemma_header(
            "gemma2",
            **{
                Keys.LLM.BLOCK_COUNT: 46,
                Keys.LLM.EMBEDDING_LENGTH: 4608,
                Keys.Attention.HEAD_COUNT: 32,
                Keys.Attention.KEY_LENGTH: 128,
                Keys.LLM.ATTN_LOGIT_SOFTCAPPING: 40.0,
            },
        )
    )
    assert config["query_pre_attn_scalar"] == 144  # 27B: 4608 / 32
    assert config["attn_logit_softcapping"] == 40.0


@pytest.mark.parametrize(
    "model_type,missing",
    [
        ("gemma", "gemma.attention.layer_norm_rms_epsilon"),
        ("gemma2", "gemma2.context_length"),
        ("gemma3_text", "gemma3.attention.layer_norm_rms_epsilon"),
        ("gemma3_text", "gemma3.attention.head_count"),
    ],
)
def test_gemma_gguf_missing_a_key_names_it(model_type, missing):
    from gguf import Keys

    from llmrun.errors import ModelFormatError
    from llmrun.loading.gguf_config import config_from_gguf

    header = gemma_header(model_type, **{Keys.Attention.SLIDING_WINDOW: 512})
    del header.metadata[missing]
    with pytest.raises(ModelFormatError, match=f"metadata '{missing}' is missing"):
        config_from_gguf(header)


@pytest.mark.parametrize(
    "metadata,message",
    [
        ({"gemma3.rope.scaling.type": "dynamic"}, "RoPE scaling 'dynamic' is not supported"),
        ({"gemma3.attention.sliding_window_pattern": [True, False]}, "lists 2 layers"),
        ({"gemma3.attention.sliding_window_pattern": "six"}, "not a layer count"),
    ],
)
def test_bad_gemma3_gguf_metadata_is_refused(metadata, message):
    from gguf import Keys

    from llmrun.errors import LlmrunError
    from llmrun.loading.gguf_config import config_from_gguf

    header = gemma_header("gemma3_text", **{Keys.Attention.SLIDING_WINDOW: 512})
    header.metadata.update(metadata)
    with pytest.raises(LlmrunError, match=message):
        config_from_gguf(header)


def test_a_written_gemma_gguf_without_its_norm_eps_is_refused(tmp_path):
    from llmrun.errors import ModelFormatError

    hf, config = tiny_hf_model("gemma2")
    path = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    bad = rewrite_gguf(
        path, tmp_path / "bad.gguf", drop=("gemma2.attention.layer_norm_rms_epsilon",)
    )
    with pytest.raises(
        ModelFormatError, match="'gemma2.attention.layer_norm_rms_epsilon' is missing"
    ):
        load_model(bad, CPU)

"""ModernBERT against transformers' ModernBertModel (last_hidden_state), from a config.json
folder (transformers 5's ModernBertModel, and the Hub's ModernBertForMaskedLM with its
"model." prefix and MLM head) and from a "modern-bert" GGUF written as llama.cpp's converter
writes it (conversion/bert.py ModernBertModel: TextModel's keys, norm_eps as
attention.layer_norm_rms_epsilon, rope.freq_base and rope.freq_base_swa, attention.causal
false, sliding_window = local_attention, sliding_window_pattern, vocab_size,
hidden_activation; the tensors as they are).

Its features each move the hidden states by far more than the tolerance (asserted below):
the local layers' window, each layer type's RoPE base, the first layer's identity norm,
the gated feed-forward's halves (act on the first), the masking of padded keys.

The tiny model: 4 layers (global, local, local, global), hidden 64, 4 heads of 16, a
feed-forward of 96, a local window of 8 (4 either way) under 24-token texts, 128
positions, a 512-token vocabulary (stories260K's).

Tolerances: f32 hidden states (after the final LayerNorm, within about ±4) 1e-4 max abs
against transformers, whole or in a padded batch against each text alone. A Q8_0 GGUF
against transformers run on the weights gguf dequantizes: 1e-4, and against the f32
weights within 0.5 (Q8_0's rounding grows through four pre-norm layers' residual stream).
"""

import pytest
import torch
from family_checks import dequantize_2d_weights, max_diff, write_keyed_gguf
from helpers import randomize
from in_process import llmrun
from test_bert import hidden

from llmrun.embeddings import pool
from llmrun.errors import UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import modernbert
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
MODERNBERT = dict(
    model_type="modernbert",
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=512,  # stories260K's tokenizer, so the GGUFs can be run end to end
    max_position_embeddings=128,
    local_attention=8,
    global_attn_every_n_layers=3,
    norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
)
SEQ = 24
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny random ModernBertModel (f32, eval) of MODERNBERT with `overrides`: weights
    N(0, 0.2), LayerNorm scales 1 + N(0, 0.1)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**MODERNBERT, **overrides})
    model = transformers.AutoModel.from_config(config).float().eval()
    randomize(model)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).last_hidden_state


def ours(hf) -> torch.nn.Module:
    model = modernbert.Model(modernbert.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())
    return model.eval()


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping for modern-bert).
_NAMES = {
    "attn_norm": "attn_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.Wo": "attn_output",
    "mlp_norm": "ffn_norm",
    "mlp.Wi": "ffn_up",
    "mlp.Wo": "ffn_down",
}
_GLOBAL = {
    "embeddings.tok_embeddings": "token_embd",
    "embeddings.norm": "token_embd_norm",
    "final_norm": "output_norm",
}


def converted(hf) -> dict:
    out = {}
    for name, t in hf.state_dict().items():
        module, _, suffix = name.rpartition(".")
        data = t.detach().float().numpy()
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = data
            continue
        _, layer, rest = module.split(".", 2)
        out[f"blk.{layer}.{_NAMES[rest]}.{suffix}"] = data
    return out


def write_modernbert_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes ModernBERT ("modern-bert"): its keys,
    2-D weights in `qtype` (default F32), stories260K's vocabulary. `keys`: metadata to
    change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    metadata = {
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": config.num_attention_heads,
        "{arch}.attention.layer_norm_rms_epsilon": float(config.norm_eps),
        "{arch}.rope.freq_base": float(config.rope_parameters["full_attention"]["rope_theta"]),
        "{arch}.rope.freq_base_swa": float(
            config.rope_parameters["sliding_attention"]["rope_theta"]
        ),
        "{arch}.attention.causal": False,
        "{arch}.attention.sliding_window": config.local_attention,
        "{arch}.attention.sliding_window_pattern": 3,
        "{arch}.vocab_size": config.vocab_size,
        "{arch}.hidden_activation": config.hidden_activation,
        "{arch}.pooling_type": int(gguf.PoolingType.CLS),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        **keys,
    }
    return write_keyed_gguf(path, "modern-bert", metadata, converted(hf), qtype)


def test_config_json_matches_transformers():
    hf = hf_model()
    expected = reference(hf)
    assert expected.abs().max() > 2
    assert max_diff(hidden(ours(hf)), expected) < 1e-4


def test_a_saved_folder_and_the_hubs_masked_lm_files_load(tmp_path):
    from safetensors.torch import save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert type(loaded.model).generates is False
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4
    tensors = {f"model.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    tensors["head.dense.weight"] = torch.zeros(64, 64)
    tensors["decoder.bias"] = torch.zeros(512)
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    assert max_diff(hidden(load_model(tmp_path / "hf", CPU, "f32").model), reference(hf)) < 1e-4


def test_a_padded_batch_gives_each_text_its_states_alone():
    hf = hf_model()
    model = ours(hf)
    lengths = torch.tensor([SEQ, 9, 1])
    ids = IDS.repeat(3, 1)
    ids[1:, 9:] = 7
    with torch.no_grad():
        batch = model.hidden_states(ids, torch.arange(SEQ).expand(3, SEQ), lengths)
    for row, n in enumerate(lengths.tolist()):
        alone = reference(hf, IDS[:, :n])[0]
        assert max_diff(batch[row, :n], alone) < 1e-4
        for pooling, expected in (("mean", alone.mean(dim=0)), ("cls", alone[0])):
            assert max_diff(pool(batch, lengths, pooling)[row], expected) < 1e-4, pooling


def test_each_feature_moves_the_hidden_states():
    """The window, each RoPE base, the gated halves' roles each move transformers' output by
    far more than the tolerance; so does llmrun's model without the window or the first
    layer's identity norm."""
    hf = hf_model()
    expected = reference(hf)
    assert max_diff(reference(hf_model(local_attention=64)), expected) > 0.1
    for kind in ("full_attention", "sliding_attention"):
        rope = {k: dict(v) for k, v in hf.config.rope_parameters.items()}
        rope[kind]["rope_theta"] = 100.0
        assert max_diff(reference(hf_model(rope_parameters=rope)), expected) > 0.1, kind
    swapped = hf_model()
    with torch.no_grad():
        for layer in swapped.layers:
            value, gate = layer.mlp.Wi.weight.chunk(2)
            layer.mlp.Wi.weight.copy_(torch.cat([gate.clone(), value.clone()]))
    assert max_diff(reference(swapped), expected) > 0.1
    all_global = ours(hf)
    for layer in all_global.layers:
        layer.kind = "full_attention"
    assert max_diff(hidden(all_global), expected) > 0.1
    normed = ours(hf)
    normed.layers[0].attn_norm = torch.nn.LayerNorm(64, bias=False)
    assert max_diff(hidden(normed), expected) > 0.1


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    path = write_modernbert_gguf(tmp_path / "m.gguf", hf)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "modernbert" and config["layer_types"] == hf.config.layer_types
    assert loaded.checkpoint.pooling == "cls"
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


def test_a_gguf_without_a_window_is_global_and_takes_llama_cpps_bases(tmp_path):
    """No sliding_window: llama.cpp runs every layer global; no RoPE bases: 10000 both."""
    hf = hf_model(
        local_attention=256,  # wider than any text: every layer sees every key
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    keys = {
        "{arch}.attention.sliding_window": None,
        "{arch}.rope.freq_base": None,
        "{arch}.rope.freq_base_swa": None,
    }
    path = write_modernbert_gguf(tmp_path / "m.gguf", hf, **keys)
    loaded = load_model(path, CPU, "f32")
    assert set(loaded.checkpoint.config["layer_types"]) == {"full_attention"}
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


def test_a_swiglu_gguf_matches_transformers(tmp_path):
    """granite-embedding-r2's SiLU: hidden_activation names it, llama.cpp runs SwiGLU."""
    hf = hf_model(hidden_activation="silu")
    path = write_modernbert_gguf(tmp_path / "m.gguf", hf)
    assert max_diff(hidden(load_model(path, CPU, "f32").model), reference(hf)) < 1e-4
    relu = write_modernbert_gguf(tmp_path / "r.gguf", hf, **{"{arch}.hidden_activation": "relu"})
    with pytest.raises(UnsupportedError, match="'relu' is not supported"):
        load_model(relu, CPU, "f32")


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    path = write_modernbert_gguf(tmp_path / "q.gguf", hf, q8)
    assert read_gguf(path, with_tensors=False).tensors["blk.0.attn_qkv.weight"].ggml_type == q8
    got = hidden(load_model(path, CPU, "f32").model)
    dequantized = hf_model()
    dequantize_2d_weights(dequantized, q8)
    assert max_diff(got, reference(dequantized)) < 1e-4
    assert 1e-4 < max_diff(got, f32) < 0.5


def test_no_decode_step_is_attached_and_show_describes_it(tmp_path):
    path = write_modernbert_gguf(tmp_path / "m.gguf", hf_model())
    loaded = load_model(path, CPU, "f32")
    assert decode_step.attach(loaded.model) is False
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "modern-bert" in result.stdout and "none (an encoder)" in result.stdout
    assert inspect.describe(path)["architecture"] == "modern-bert"

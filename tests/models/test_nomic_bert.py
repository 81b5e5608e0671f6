"""Nomic BERT (nomic-embed-text v1/v1.5) against transformers' NomicBertModel
(last_hidden_state), from a config.json folder (transformers 5's names, and the Hub's own:
n_embd, rotary_emb_base, ..., emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc11/fc12/fc2,
norm1/norm2) and from a "nomic-bert" GGUF written as llama.cpp's converter writes it
(conversion/bert.py NomicBertModel: TextModel's keys with the trained context length,
rope.freq_base from rotary_emb_base, attention.layer_norm_epsilon, attention.causal false,
a token type count; Wqkv kept fused as attn_qkv, fc11 as ffn_up, fc12 as ffn_gate).

Its features each move the hidden states by far more than the tolerance (asserted below):
RoPE and its base, the gate (silu) taken from fc12 and not fc11, the token-type row, the
masking of padded keys, the post-norms' biases.

The tiny model: 2 layers, hidden 64, 4 heads of 16, a feed-forward of 96, RoPE base 1000
(nomic's), 128 positions, a 512-token vocabulary (stories260K's).

Tolerances: f32 hidden states (LayerNorm'd, within about ±4) 1e-4 max abs against
transformers, whole or in a padded batch against each text alone. A Q8_0 GGUF against
transformers run on the weights gguf dequantizes: 1e-4, and against the f32 weights within
0.1.
"""

import copy

import numpy as np
import pytest
import torch
from family_checks import dequantize_2d_weights, max_diff, write_keyed_gguf
from helpers import randomize
from in_process import llmrun
from test_bert import hidden

from llmrun.embeddings import pool
from llmrun.errors import UnsupportedError
from llmrun.loading import inspect
from llmrun.loading import nomic_bert as loading
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import nomic_bert
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
NOMIC = dict(
    model_type="nomic_bert",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=512,  # stories260K's tokenizer, so the GGUFs can be run end to end
    max_position_embeddings=128,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)
SEQ = 24
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny random NomicBertModel (f32, eval) of NOMIC with `overrides`: weights
    N(0, 0.2), LayerNorm scales 1 + N(0, 0.1)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**NOMIC, **overrides})
    model = transformers.AutoModel.from_config(config).float().eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("LayerNorm.weight", "layernorm.weight")):
                p.normal_(1.0, 0.1)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).last_hidden_state


def ours(hf) -> torch.nn.Module:
    model = nomic_bert.Model(nomic_bert.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())
    return model.eval()


# transformers 5's module -> the Hub's (nomic-ai's NomicBertModel).
_HUB = {
    "embeddings.LayerNorm": "emb_ln",
    "self_attn.o_proj": "attn.out_proj",
    "mlp.up_proj": "mlp.fc11",
    "mlp.gate_proj": "mlp.fc12",
    "mlp.down_proj": "mlp.fc2",
    "post_attention_layernorm": "norm1",
    "post_mlp_layernorm": "norm2",
}


def hub_state(hf) -> dict[str, torch.Tensor]:
    """hf's tensors under the Hub's names, as nomic-embed-text-v1.5's files hold them:
    queries, keys and values in one Wqkv."""
    out = {}
    for name, t in hf.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module in _HUB:
            out[f"{_HUB[module]}.{suffix}"] = t
            continue
        if not module.startswith("layers."):
            out[name] = t
            continue
        _, layer, rest = module.split(".", 2)
        if rest in ("self_attn.k_proj", "self_attn.v_proj"):
            continue
        prefix = f"encoder.layers.{layer}"
        if rest == "self_attn.q_proj":
            parts = [hf.state_dict()[f"layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
            out[f"{prefix}.attn.Wqkv.weight"] = torch.cat(parts)
            continue
        out[f"{prefix}.{_HUB[rest]}.{suffix}"] = t
    return {k: v.contiguous() for k, v in out.items()}


def hub_config(hf, **changes) -> dict:
    """hf's config as the Hub's config.json spells it (nomic-embed-text-v1.5's fields)."""
    config = hf.config
    return {
        "model_type": "nomic_bert",
        "architectures": ["NomicBertModel"],
        "activation_function": "swiglu",
        "causal": False,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None,
        "rotary_emb_base": config.rope_parameters["rope_theta"],
        "n_embd": config.hidden_size,
        "n_layer": config.num_hidden_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.intermediate_size,
        "n_positions": 8 * config.max_position_embeddings,
        "max_trained_positions": config.max_position_embeddings,
        "layer_norm_epsilon": config.layer_norm_eps,
        "type_vocab_size": config.type_vocab_size,
        "vocab_size": config.vocab_size,
        **changes,
    }


def write_hub_folder(path, hf, **changes):
    import json

    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(hub_config(hf, **changes)))
    save_file(hub_state(hf), path / "model.safetensors")
    return path


# The Hub's module -> llama.cpp's tensor (gguf-py's tensor_mapping for nomic-bert).
_GGUF = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "emb_ln": "token_embd_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}


def converted(hf) -> dict[str, np.ndarray]:
    """The Hub's tensors (hub_state) under llama.cpp's names."""
    out = {}
    for name, t in hub_state(hf).items():
        module, _, suffix = name.rpartition(".")
        if module.startswith("encoder.layers."):
            _, _, layer, rest = module.split(".", 3)
            out[f"blk.{layer}.{_GGUF[rest]}.{suffix}"] = t.float().numpy()
        else:
            out[f"{_GGUF[module]}.{suffix}"] = t.float().numpy()
    return out


def write_nomic_bert_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes nomic-bert: NomicBertModel's keys, Wqkv
    fused, 2-D weights in `qtype` (default F32) but token_types (kept F32 by the
    converter), stories260K's vocabulary. `keys`: metadata to change ("{arch}.…" -> value,
    None leaves one out)."""
    config = hf.config
    metadata = {
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": config.num_attention_heads,
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_eps),
        "{arch}.attention.causal": False,
        "{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "{arch}.pooling_type": int(gguf.PoolingType.MEAN),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.token_type_count": config.type_vocab_size,
        **keys,
    }
    return write_keyed_gguf(
        path, "nomic-bert", metadata, converted(hf), qtype, keep_f32=("token_types",)
    )


def test_config_json_matches_transformers():
    hf = hf_model()
    expected = reference(hf)
    assert expected.abs().max() > 2
    assert max_diff(hidden(ours(hf)), expected) < 1e-4


def test_a_config_without_a_rope_base_takes_nomics():
    """NomicBertConfig's default_theta, 1000, where a config.json names no base."""
    hf = hf_model()
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    assert transformers.NomicBertConfig(**config).rope_parameters["rope_theta"] == 1000.0
    model = nomic_bert.Model(nomic_bert.ModelArgs.from_config(config))
    model.load_state_dict(hf.state_dict())
    assert max_diff(hidden(model.eval()), reference(hf)) < 1e-4


def test_a_saved_folder_loads_and_matches_transformers(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert type(loaded.model).generates is False
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


def test_a_half_precision_folder_matches_its_rounded_weights(tmp_path):
    """Saved in f16: computed in f32 as transformers computes the weights rounded to f16
    (its RoPE frequencies unrounded, as llmrun's)."""
    hf = hf_model()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.half().float())
    copy.deepcopy(hf).half().save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert next(iter(loaded.checkpoint.weights.values())).tensor.dtype == torch.float16
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


def test_the_hubs_own_folder_loads_and_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_hub_folder(tmp_path / "hub", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["hidden_size"] == 64 and config["max_position_embeddings"] == 128
    assert inspect.describe(tmp_path / "hub")["context_length"] == 128  # trained, not 1024
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("prenorm", True, "pre-norm"),
        ("rotary_emb_fraction", 0.5, "part of each head"),
        ("rotary_emb_interleaved", True, "interleaved"),
        ("rotary_scaling_factor", 2.0, "dynamic NTK"),
        ("activation_function", "geglu", "activation"),
    ],
)
def test_the_hubs_settings_llmrun_does_not_compute_are_refused(field, value, match, tmp_path):
    path = write_hub_folder(tmp_path / "hub", hf_model(), **{field: value})
    with pytest.raises(UnsupportedError, match=match):
        load_model(path, CPU, "f32")


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
    """RoPE's base, the gate and up projections' roles, the token-type row, the post-norms'
    biases and masking the padding each move transformers' output by far more than the
    tolerance."""
    hf = hf_model()
    expected = reference(hf)
    other_base = hf_model(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert max_diff(reference(other_base), expected) > 0.1
    swapped = hf_model()
    with torch.no_grad():
        for layer in swapped.layers:
            gate = layer.mlp.gate_proj.weight.clone()
            layer.mlp.gate_proj.weight.copy_(layer.mlp.up_proj.weight)
            layer.mlp.up_proj.weight.copy_(gate)
    assert max_diff(reference(swapped), expected) > 0.1
    for suffix in ("token_type_embeddings.weight", "post_mlp_layernorm.bias"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        assert max_diff(reference(changed), expected) > 0.1, suffix
    ids = torch.cat([IDS[:, :9], torch.full((1, 15), 7)], dim=1)
    with torch.no_grad():
        unmasked = ours(hf).hidden_states(ids, torch.arange(SEQ)[None], torch.tensor([SEQ]))
    assert max_diff(unmasked[0, :9], reference(hf, IDS[:, :9])[0]) > 0.1


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    path = write_nomic_bert_gguf(tmp_path / "m.gguf", hf)
    assert "blk.0.attn_qkv.weight" in read_gguf(path, with_tensors=False).tensors
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "nomic_bert"
    assert loaded.checkpoint.pooling == "mean"
    assert max_diff(hidden(loaded.model), reference(hf)) < 1e-4


def test_a_gguf_without_a_rope_base_takes_llama_cpps(tmp_path):
    """llama.cpp turns by base 10000 where the file names none."""
    hf = hf_model(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    path = write_nomic_bert_gguf(tmp_path / "m.gguf", hf, **{"{arch}.rope.freq_base": None})
    assert max_diff(hidden(load_model(path, CPU, "f32").model), reference(hf)) < 1e-4


def test_a_gguf_with_rope_scaling_is_refused(tmp_path):
    path = write_nomic_bert_gguf(
        tmp_path / "m.gguf", hf_model(), **{"{arch}.rope.scaling.type": "yarn"}
    )
    with pytest.raises(UnsupportedError, match="unscaled RoPE"):
        load_model(path, CPU, "f32")


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    path = write_nomic_bert_gguf(tmp_path / "q.gguf", hf, q8)
    tensors = read_gguf(path, with_tensors=False).tensors
    assert tensors["blk.0.attn_qkv.weight"].ggml_type == q8
    assert tensors["token_embd.weight"].ggml_type == q8
    got = hidden(load_model(path, CPU, "f32").model)
    dequantized = hf_model()
    kept = dequantized.embeddings.token_type_embeddings.weight.clone()
    dequantize_2d_weights(dequantized, q8)
    with torch.no_grad():
        dequantized.embeddings.token_type_embeddings.weight.copy_(kept)
    assert max_diff(got, reference(dequantized)) < 1e-4
    assert 1e-4 < max_diff(got, f32) < 0.1


def test_no_decode_step_is_attached_and_show_describes_it(tmp_path):
    path = write_nomic_bert_gguf(tmp_path / "m.gguf", hf_model())
    loaded = load_model(path, CPU, "f32")
    assert decode_step.attach(loaded.model) is False
    assert getattr(loaded.model, "decode_step", None) is None
    result = llmrun("show", str(path))
    assert result.returncode == 0, result.stderr
    assert "nomic-bert" in result.stdout
    assert inspect.describe(path)["architecture"] == "nomic-bert"


def test_hub_config_names_the_file():
    with pytest.raises(UnsupportedError, match=r"^cfg\.json: prenorm"):
        loading.hub_config({"n_embd": 64, "prenorm": True}, "cfg.json")

"""Qwen 1 (the Hub's QWenLMHeadModel, model_type qwen; GGUF arch qwen) against
transformers' Qwen2ForCausalLM of the same weights: transformers has no Qwen 1, and its
published code (modeling_qwen.py) computes Qwen2's model under other names (q/k/v biases
and none on the output projection, RMSNorms, RoPE on whole heads with halves turned,
SwiGLU) while a sequence stays within seq_length (its dynamic NTK RoPE and log-n query
scaling act only past it: llmrun holds the context to seq_length).

Folders as the Hub's checkpoints hold them: config.json in Qwen 1's names (kv_channels,
intermediate_size twice the feed-forward width, layer_norm_epsilon, rotary_emb_base,
seq_length), transformer.wte, transformer.h.N.{ln_1, attn.c_attn with all queries' rows
then keys' then values' and their biases, attn.c_proj, ln_2, mlp.w1 (up), mlp.w2
(gate), mlp.c_proj}, transformer.ln_f, lm_head. GGUFs as llama.cpp's converter writes
them (conversion/qwen.py QwenModel): attn_qkv fused with its bias and unpermuted,
feed_forward_length the config's intermediate_size, w1 as ffn_up, w2 as ffn_gate, and
the RMS epsilon under the key llama.cpp reads.

Tolerances: f32 logits 1e-4 max abs, whole and through the KV cache (chunked prefill,
then one token at a time); a Q8_0 GGUF against the reference run on the weights gguf
dequantizes: 1e-4.
"""

import json

import pytest
import torch
from family_checks import (
    check_run_prints_greedy_tokens,
    check_show,
    dequantize_2d_weights,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, randomize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
# Qwen 1 has every head its own keys; a seq_length shorter than the positions.
QWEN2 = dict(BASE, model_type="qwen2", num_key_value_heads=4, rope_theta=10000.0)
SEQ_LENGTH = 128
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def hf_model():
    config = transformers.AutoConfig.for_model(**QWEN2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def qwen_config(hf) -> dict:
    """The config.json of the Hub's Qwen 1 checkpoints for the model's shape."""
    c = hf.config
    return dict(
        architectures=["QWenLMHeadModel"],
        model_type="qwen",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        kv_channels=c.hidden_size // c.num_attention_heads,
        intermediate_size=2 * c.intermediate_size,
        layer_norm_epsilon=c.rms_norm_eps,
        rotary_emb_base=c.rope_parameters["rope_theta"],
        rotary_pct=1.0,
        max_position_embeddings=c.max_position_embeddings,
        seq_length=SEQ_LENGTH,
        use_dynamic_ntk=True,
        use_logn_attn=True,
        no_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def qwen_state_dict(hf) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's Qwen 1 keys (see the module docstring)."""
    names = {
        "input_layernorm": "ln_1",
        "post_attention_layernorm": "ln_2",
        "self_attn.o_proj": "attn.c_proj",
        "mlp.up_proj": "mlp.w1",
        "mlp.gate_proj": "mlp.w2",
        "mlp.down_proj": "mlp.c_proj",
    }
    state = hf.state_dict()
    out = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for module, theirs in names.items():
            out[f"transformer.h.{layer}.{theirs}.weight"] = state[f"{prefix}{module}.weight"]
        for suffix in ("weight", "bias"):
            parts = [state[f"{prefix}self_attn.{p}_proj.{suffix}"] for p in "qkv"]
            out[f"transformer.h.{layer}.attn.c_attn.{suffix}"] = torch.cat(parts)
    return {k: v.contiguous() for k, v in out.items()}


def save_folder(path, hf, **config_changes):
    path.mkdir()
    safetensors_torch.save_file(qwen_state_dict(hf), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**qwen_config(hf), **config_changes}))
    return path


def test_a_hub_folder_matches_the_reference_whole_and_through_the_cache(tmp_path):
    hf = hf_model()
    expected = reference(hf)
    loaded = load_model(save_folder(tmp_path / "qwen", hf), CPU, "f32")
    # The context the published model computes as plain RoPE.
    assert loaded.checkpoint.config["max_position_embeddings"] == SEQ_LENGTH
    with torch.no_grad():
        whole = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (cached_logits(loaded.model, IDS) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("changes", [dict(no_bias=False), dict(rotary_pct=0.5)])
def test_a_folder_llmrun_cannot_run_as_published_is_refused(tmp_path, changes):
    folder = save_folder(tmp_path / "qwen", hf_model(), **changes)
    with pytest.raises(UnsupportedError):
        load_model(folder, CPU, "f32")


def qwen_tensors(hf) -> dict:
    """GGUF name -> array in llama.cpp's layout (see the module docstring)."""
    names = {
        "ln_1": "attn_norm",
        "ln_2": "ffn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "mlp.w1": "ffn_up",
        "mlp.w2": "ffn_gate",
        "mlp.c_proj": "ffn_down",
    }
    out = {}
    for key, value in qwen_state_dict(hf).items():
        data = value.float().numpy()
        if key.startswith("transformer.h."):
            _, _, layer, rest = key.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            out[f"blk.{layer}.{names[module]}.{suffix}"] = data
        else:
            global_names = {
                "transformer.wte.weight": "token_embd.weight",
                "transformer.ln_f.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }
            out[global_names[key]] = data
    return out


def write_qwen_gguf(path, hf, qtype=None, metadata=None):
    """A qwen GGUF of the model: the keys llama.cpp reads (with `metadata` changed; None
    leaves a key out), its tensors, 2-D ones in `qtype` (default F32), stories260K's
    tokenizer."""
    c, L, A, R = hf.config, Keys.LLM, Keys.Attention, Keys.Rope
    keys = {
        L.BLOCK_COUNT: c.num_hidden_layers,
        L.CONTEXT_LENGTH: c.max_position_embeddings,
        L.EMBEDDING_LENGTH: c.hidden_size,
        L.FEED_FORWARD_LENGTH: 2 * c.intermediate_size,
        A.HEAD_COUNT: c.num_attention_heads,
        R.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        A.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        **(metadata or {}),
    }
    return write_keyed_gguf(path, "qwen", keys, qwen_tensors(hf), qtype)


def test_a_qwen_gguf_matches_the_reference(tmp_path):
    hf = hf_model()
    loaded = load_model(write_qwen_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "qwen"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def test_a_q8_0_gguf_matches_the_reference_on_the_dequantized_weights(tmp_path):
    """attn_qkv split along whole rows of Q8_0 blocks; the reference holds the rounded
    values."""
    hf = hf_model()
    path = write_qwen_gguf(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
    dequantize_2d_weights(hf, GGMLQuantizationType.Q8_0)
    loaded = load_model(path, CPU, "f32")
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


GGUFS_REFUSED = {
    # Today's converter writes Qwen's epsilon under the LayerNorm key: llama.cpp refuses it.
    "no RMS epsilon": (
        {Keys.Attention.LAYERNORM_RMS_EPS: None, Keys.Attention.LAYERNORM_EPS: 1e-5},
        ModelFormatError,
    ),
    "partial RoPE": ({Keys.Rope.DIMENSION_COUNT: 8}, UnsupportedError),
}


@pytest.mark.parametrize("case", list(GGUFS_REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = GGUFS_REFUSED[case]
    path = write_qwen_gguf(tmp_path / "m.gguf", hf_model(), metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_show_and_run(tmp_path):
    """`llmrun show` names the arch and counts 2 layers of keys and values (4 heads of
    16, f32, 8192 positions); `llmrun run` prints the reference's greedy text."""
    hf = hf_model()
    path = write_qwen_gguf(tmp_path / "m.gguf", hf)
    check_show(path, "qwen", 2 * 2 * 4 * 16 * 4 * 8192)
    check_run_prints_greedy_tokens(hf, path)

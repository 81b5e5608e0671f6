"""Jina BERT v2 (jina-embeddings-v2) against a hand-written reference, since transformers
ships no JinaBert: `reference` below follows the math of the published modeling file
(jinaai/jina-bert-implementation, modeling_bert.py: JinaBertEmbeddings without positions,
BertSelfAttention's scores plus the ALiBi tensor -slope_h * |i - j| built from
_get_alibi_head_slopes, BertSelfOutput, JinaBertGLUMLP with its gate the first
intermediate_size features of gated_layers), written out with plain torch ops per text.
llmrun loads from a Hub folder (config.json model_type "bert", JinaBertForMaskedLM with its
"bert." prefix and MLM head, as the Hub's files are) and from a "jina-bert-v2" GGUF written
as llama.cpp's converter writes it (conversion/bert.py JinaBertV2Model and gguf-py's
tensor map: gated_layers whole as ffn_up, wo as ffn_down, mlp.layernorm as
layer_output_norm, layer_norm_q/k as attn_q_norm/attn_k_norm; files from before 2025:
ffn_gate and ffn_up split).

Its features each move the hidden states by far more than the tolerance (asserted below):
ALiBi, the gate's half of gated_layers, the q/k norms, the masking of padded keys.

The tiny model: 2 layers, hidden 64, 4 heads of 16, a feed-forward of 64 (gated_layers 128
rows), 128 positions, a 512-token vocabulary (stories260K's, so the GGUFs run end to end).
ALiBi's slopes for head counts that are not powers of two (jina-embeddings-v2-base's 12) are
checked against the reference's own recursion.

Tolerances: f32 hidden states (LayerNorm'd, within about ±4) 1e-4 max abs against the
reference, whole or in a padded batch against each text alone. A Q8_0 GGUF against the
reference on the weights gguf dequantizes: 1e-4, and against the f32 weights within 0.2.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from family_checks import max_diff, write_keyed_gguf
from in_process import llmrun
from safetensors.torch import save_file
from test_bert import hidden

from llmrun.embeddings import pool
from llmrun.errors import UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models.base import alibi_slopes
from llmrun.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
HIDDEN, LAYERS, HEADS, WIDTH, VOCAB, CONTEXT = 64, 2, 4, 64, 512, 128
EPS = 1e-12
SEQ = 24
IDS = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
# jina-embeddings-v2-base-en's config.json, shrunk.
CONFIG = {
    "model_type": "bert",
    "architectures": ["JinaBertForMaskedLM"],
    "auto_map": {"AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"},
    "feed_forward_type": "geglu",
    "position_embedding_type": "alibi",
    "emb_pooler": "mean",
    "hidden_act": "gelu",
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": WIDTH,
    "max_position_embeddings": CONTEXT,
    "type_vocab_size": 2,
    "vocab_size": VOCAB,
    "layer_norm_eps": EPS,
    "pad_token_id": 0,
}


def weights(qk_norm: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random JinaBertModel tensors under its names: N(0, 0.2), LayerNorm scales 1 + N(0,
    0.1) and biases N(0, 0.2)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    def norm(name: str) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": 1 + rand(HIDDEN) / 2, f"{name}.bias": rand(HIDDEN)}

    out = {
        "embeddings.word_embeddings.weight": rand(VOCAB, HIDDEN),
        "embeddings.token_type_embeddings.weight": rand(2, HIDDEN),
        **norm("embeddings.LayerNorm"),
    }
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            out[f"{p}.attention.self.{proj}.weight"] = rand(HIDDEN, HIDDEN)
            out[f"{p}.attention.self.{proj}.bias"] = rand(HIDDEN)
        if qk_norm:
            out |= norm(f"{p}.attention.self.layer_norm_q")
            out |= norm(f"{p}.attention.self.layer_norm_k")
        out[f"{p}.attention.output.dense.weight"] = rand(HIDDEN, HIDDEN)
        out[f"{p}.attention.output.dense.bias"] = rand(HIDDEN)
        out |= norm(f"{p}.attention.output.LayerNorm")
        out[f"{p}.mlp.gated_layers.weight"] = rand(2 * WIDTH, HIDDEN)
        out[f"{p}.mlp.wo.weight"] = rand(HIDDEN, WIDTH)
        out[f"{p}.mlp.wo.bias"] = rand(HIDDEN)
        out |= norm(f"{p}.mlp.layernorm")
    return out


def jina_slopes(n: int) -> list[float]:
    """The modeling file's _get_alibi_head_slopes: Press et al.'s geometric slopes, for a
    head count not a power of two those of the power below, then every other of twice it."""
    if math.log2(n).is_integer():
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]
    below = 2 ** math.floor(math.log2(n))
    return jina_slopes(below) + jina_slopes(2 * below)[0::2][: n - below]


@torch.no_grad()
def reference(state: dict[str, torch.Tensor], ids: torch.Tensor = IDS) -> torch.Tensor:
    """JinaBertModel's last_hidden_state [1, T, H] of one unpadded text (module docstring)."""
    w = {k.removeprefix("bert."): v.float() for k, v in state.items()}

    def ln(x, name):
        return F.layer_norm(x, (HIDDEN,), w[f"{name}.weight"], w[f"{name}.bias"], EPS)

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0)

    tokens = ids.shape[1]
    x = w["embeddings.word_embeddings.weight"][ids[0]]
    x = ln(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    pos = torch.arange(tokens)
    distance = (pos[None, :] - pos[:, None]).abs().float()
    alibi = -torch.tensor(jina_slopes(HEADS))[:, None, None] * distance  # [H, T, T]
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        q, k = linear(x, f"{p}.attention.self.query"), linear(x, f"{p}.attention.self.key")
        if f"{p}.attention.self.layer_norm_q.weight" in w:
            q = ln(q, f"{p}.attention.self.layer_norm_q")
            k = ln(k, f"{p}.attention.self.layer_norm_k")
        v = linear(x, f"{p}.attention.self.value")
        q, k, v = (t.view(tokens, HEADS, head).transpose(0, 1) for t in (q, k, v))
        scores = q @ k.transpose(1, 2) / math.sqrt(head) + alibi
        context = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(tokens, HIDDEN)
        x = ln(
            linear(context, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm"
        )
        both = linear(x, f"{p}.mlp.gated_layers")
        gated, non_gated = both[:, :WIDTH], both[:, WIDTH:]
        mlp = linear(F.gelu(gated) * non_gated, f"{p}.mlp.wo")
        x = ln(mlp + x, f"{p}.mlp.layernorm")
    return x[None]


def write_hub_folder(path, state, **changes):
    """A Hub folder as jina-embeddings-v2's: config.json, JinaBertForMaskedLM's tensors
    ("bert." prefix, an MLM head)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    tensors = {f"bert.{k}": v.contiguous() for k, v in state.items()}
    tensors["cls.predictions.bias"] = torch.zeros(VOCAB)
    save_file(tensors, path / "model.safetensors")
    return path


# JinaBertModel's module -> llama.cpp's tensor (gguf-py's tensor_mapping for jina-bert-v2).
_GGUF = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.self.layer_norm_q": "attn_q_norm",
    "attention.self.layer_norm_k": "attn_k_norm",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "mlp.gated_layers": "ffn_up",
    "mlp.wo": "ffn_down",
    "mlp.layernorm": "layer_output_norm",
}
_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}


def converted(state, split: bool = False) -> dict[str, np.ndarray]:
    """The tensors under llama.cpp's names; with `split`, gated_layers as ffn_gate (its first
    half) and ffn_up, as the converter wrote them before 2025."""
    out = {}
    for name, t in state.items():
        module, _, suffix = name.rpartition(".")
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = t.numpy()
            continue
        _, _, layer, rest = module.split(".", 3)
        if split and rest == "mlp.gated_layers":
            out[f"blk.{layer}.ffn_gate.{suffix}"] = t[:WIDTH].numpy()
            out[f"blk.{layer}.ffn_up.{suffix}"] = t[WIDTH:].numpy()
            continue
        out[f"blk.{layer}.{_GGUF[rest]}.{suffix}"] = t.numpy()
    return out


def write_jina_gguf(path, state, qtype=None, split=False, fuse_qkv=False, extra=None, **keys):
    """The model as llama.cpp's converter writes jina-bert-v2 (module docstring), 2-D
    weights in `qtype` (default F32) but token_types; with `fuse_qkv` (its --fuse-qkv) the
    queries, keys and values in one attn_qkv; `extra` tensors added, `keys` metadata
    changed ("{arch}.…" -> value, None leaves one out)."""
    metadata = {
        "{arch}.block_count": LAYERS,
        "{arch}.context_length": CONTEXT,
        "{arch}.embedding_length": HIDDEN,
        "{arch}.feed_forward_length": WIDTH,
        "{arch}.attention.head_count": HEADS,
        "{arch}.attention.layer_norm_epsilon": EPS,
        "{arch}.attention.causal": False,
        "{arch}.pooling_type": int(gguf.PoolingType.MEAN),
        "tokenizer.ggml.token_type_count": 2,
        **keys,
    }
    tensors = converted(state, split) | (extra or {})
    for i in range(LAYERS if fuse_qkv else 0):
        for suffix in ("weight", "bias"):
            parts = [tensors.pop(f"blk.{i}.attn_{p}.{suffix}") for p in "qkv"]
            tensors[f"blk.{i}.attn_qkv.{suffix}"] = np.concatenate(parts)
    return write_keyed_gguf(
        path, "jina-bert-v2", metadata, tensors, qtype, keep_f32=("token_types",)
    )


def dequantized(state, qtype) -> dict[str, torch.Tensor]:
    """`state` with its 2-D weights but token_types rounded through gguf's `qtype`."""
    out = {}
    for name, t in state.items():
        if t.dim() == 2 and "token_type" not in name:
            t = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qtype), qtype)
            )
        out[name] = t
    return out


def test_alibi_slopes_are_the_modeling_files():
    for heads in (4, 6, 8, 12, 16):
        expected = torch.tensor(jina_slopes(heads))
        assert torch.allclose(alibi_slopes(heads), expected, rtol=1e-6), heads


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_hub_folder_matches_the_reference(qk_norm, tmp_path):
    state = weights(qk_norm)
    expected = reference(state)
    assert expected.abs().max() > 2
    loaded = load_model(write_hub_folder(tmp_path / "hub", state), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "jina_bert"
    assert type(loaded.model).generates is False
    assert max_diff(hidden(loaded.model), expected) < 1e-4


def test_a_padded_batch_gives_each_text_its_states_alone(tmp_path):
    state = weights()
    model = load_model(write_hub_folder(tmp_path / "hub", state), CPU, "f32").model
    lengths = torch.tensor([SEQ, 9, 1])
    ids = IDS.repeat(3, 1)
    ids[1:, 9:] = 7
    with torch.no_grad():
        batch = model.hidden_states(ids, torch.arange(SEQ).expand(3, SEQ), lengths)
    for row, n in enumerate(lengths.tolist()):
        alone = reference(state, IDS[:, :n])[0]
        assert max_diff(batch[row, :n], alone) < 1e-4
        assert max_diff(pool(batch, lengths, "mean")[row], alone.mean(dim=0)) < 1e-4


def test_each_feature_moves_the_hidden_states():
    """ALiBi, the gate's half of gated_layers, the q/k norms and masking the padding each
    move the output by far more than the tolerance."""
    from llmrun.models import jina_bert

    state = weights()
    expected = reference(state)
    model = jina_bert.Model(jina_bert.ModelArgs.from_config(CONFIG))
    model.load_state_dict(state)
    model.eval()
    assert max_diff(hidden(model), expected) < 1e-4
    swapped = dict(state)
    for i in range(LAYERS):
        name = f"encoder.layer.{i}.mlp.gated_layers.weight"
        swapped[name] = torch.cat([state[name][WIDTH:], state[name][:WIDTH]])
    assert max_diff(reference(swapped), expected) > 0.1
    normed = weights(qk_norm=True)
    plain = {k: v for k, v in normed.items() if "layer_norm_" not in k}
    assert max_diff(reference(normed), reference(plain)) > 0.1
    with torch.no_grad():
        flat = model.hidden_states(IDS, torch.zeros_like(IDS), torch.tensor([SEQ]))
    assert max_diff(flat, expected) > 0.1  # every distance 0: no ALiBi
    ids = torch.cat([IDS[:, :9], torch.full((1, 15), 7)], dim=1)
    with torch.no_grad():
        unmasked = model.hidden_states(ids, torch.arange(SEQ)[None], torch.tensor([SEQ]))
    assert max_diff(unmasked[0, :9], reference(state, IDS[:, :9])[0]) > 0.1


@pytest.mark.parametrize(("split", "fuse_qkv"), [(False, False), (True, False), (False, True)])
def test_a_gguf_matches_the_reference(split, fuse_qkv, tmp_path):
    state = weights(qk_norm=True)
    path = write_jina_gguf(tmp_path / "m.gguf", state, split=split, fuse_qkv=fuse_qkv)
    tensors = read_gguf(path, with_tensors=False).tensors
    assert ("blk.0.ffn_gate.weight" in tensors) == split
    assert ("blk.0.attn_qkv.weight" in tensors) == fuse_qkv
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "jina_bert"
    assert loaded.checkpoint.pooling == "mean"
    assert max_diff(hidden(loaded.model), reference(state)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    state = weights()
    path = write_jina_gguf(tmp_path / "q.gguf", state, q8)
    assert read_gguf(path, with_tensors=False).tensors["blk.0.ffn_up.weight"].ggml_type == q8
    got = hidden(load_model(path, CPU, "f32").model)
    assert max_diff(got, reference(dequantized(state, q8))) < 1e-4
    assert 1e-4 < max_diff(got, reference(state)) < 0.2


def test_a_split_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    state = weights()
    path = write_jina_gguf(tmp_path / "q.gguf", state, q8, split=True)
    got = hidden(load_model(path, CPU, "f32").model)
    assert max_diff(got, reference(dequantized(state, q8))) < 1e-4


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"feed_forward_type": "reglu"}, "feed_forward_type 'reglu'"),
        ({"position_embedding_type": "absolute"}, "position_embedding_type 'absolute'"),
    ],
)
def test_hub_settings_llmrun_does_not_compute_are_refused(changes, match, tmp_path):
    path = write_hub_folder(tmp_path / "hub", weights(), **changes)
    with pytest.raises(UnsupportedError, match=match):
        load_model(path, CPU, "f32")


def code_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of jina-embeddings-v2-base-code's layout (weights()'s with q/k norms,
    under its names, and its second attention norm layer_norm_1)."""
    renames = {"mlp.gated_layers": "mlp.up_gated_layer", "mlp.wo": "mlp.down_layer"}
    renames["mlp.layernorm"] = "layer_norm_2"
    out = {}
    for name, t in weights(qk_norm=True, seed=seed).items():
        for old, new in renames.items():
            name = name.replace(f".{old}.", f".{new}.")
        out[name] = t
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(LAYERS):
        out[f"encoder.layer.{i}.layer_norm_1.weight"] = 1 + torch.randn(HIDDEN, generator=g) / 10
        out[f"encoder.layer.{i}.layer_norm_1.bias"] = torch.randn(HIDDEN, generator=g) / 5
    return out


@torch.no_grad()
def code_reference(state: dict[str, torch.Tensor], ids: torch.Tensor = IDS) -> torch.Tensor:
    """jina-embeddings-v2-base-code's last_hidden_state [1, T, H], written from its modeling
    file (jinaai/jina-bert-v2-qk-post-norm, modeling_bert.py): JinaBertLayer.forward's
    residual = layer_norm_1(input + attention output), then layer_norm_2(residual +
    mlp(residual)), JinaBertGLUMLP taking the first intermediate_size features of
    up_gated_layer as `up` and the rest as `gated`, up * GELU(gated)."""
    w = {k: v.float() for k, v in state.items()}

    def ln(x, name):
        return F.layer_norm(x, (HIDDEN,), w[f"{name}.weight"], w[f"{name}.bias"], EPS)

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0)

    tokens = ids.shape[1]
    x = w["embeddings.word_embeddings.weight"][ids[0]]
    x = ln(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    pos = torch.arange(tokens)
    alibi = -torch.tensor(jina_slopes(HEADS))[:, None, None] * (pos[None] - pos[:, None]).abs()
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        q = ln(linear(x, f"{p}.attention.self.query"), f"{p}.attention.self.layer_norm_q")
        k = ln(linear(x, f"{p}.attention.self.key"), f"{p}.attention.self.layer_norm_k")
        v = linear(x, f"{p}.attention.self.value")
        q, k, v = (t.view(tokens, HEADS, head).transpose(0, 1) for t in (q, k, v))
        scores = q @ k.transpose(1, 2) / math.sqrt(head) + alibi
        context = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(tokens, HIDDEN)
        attention = ln(
            linear(context, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm"
        )
        residual = ln(x + attention, f"{p}.layer_norm_1")
        both = linear(residual, f"{p}.mlp.up_gated_layer")
        up, gated = both[:, :WIDTH], both[:, WIDTH:]
        mlp = linear(up * F.gelu(gated), f"{p}.mlp.down_layer")
        x = ln(residual + mlp, f"{p}.layer_norm_2")
    return x[None]


# jina-embeddings-v2-base-code's modules -> llama.cpp's tensors (gguf-py's tensor_mapping).
_CODE_GGUF = {
    **{k: v for k, v in _GGUF.items() if not k.startswith("mlp.")},
    "layer_norm_1": "attn_norm_2",
    "mlp.up_gated_layer": "ffn_up",
    "mlp.down_layer": "ffn_down",
    "layer_norm_2": "layer_output_norm",
}


def write_code_gguf(path, state, qtype=None, split=False):
    """The code model as llama.cpp's converter writes it: up_gated_layer whole as ffn_up;
    with `split`, as before 2025: its gate half (the second) as ffn_gate, the up half as
    ffn_up."""
    tensors = {}
    for name, t in state.items():
        module, _, suffix = name.rpartition(".")
        if module in _GLOBAL:
            tensors[f"{_GLOBAL[module]}.{suffix}"] = t.numpy()
            continue
        _, _, layer, rest = module.split(".", 3)
        if split and rest == "mlp.up_gated_layer":
            tensors[f"blk.{layer}.ffn_up.{suffix}"] = t[:WIDTH].numpy()
            tensors[f"blk.{layer}.ffn_gate.{suffix}"] = t[WIDTH:].numpy()
            continue
        tensors[f"blk.{layer}.{_CODE_GGUF[rest]}.{suffix}"] = t.numpy()
    metadata = {
        "{arch}.block_count": LAYERS,
        "{arch}.context_length": CONTEXT,
        "{arch}.embedding_length": HIDDEN,
        "{arch}.feed_forward_length": WIDTH,
        "{arch}.attention.head_count": HEADS,
        "{arch}.attention.layer_norm_epsilon": EPS,
        "{arch}.attention.causal": False,
        "{arch}.pooling_type": int(gguf.PoolingType.MEAN),
        "tokenizer.ggml.token_type_count": 2,
    }
    return write_keyed_gguf(
        path, "jina-bert-v2", metadata, tensors, qtype, keep_f32=("token_types",)
    )


def test_the_code_models_folder_matches_its_modeling_file(tmp_path):
    """The halves of up_gated_layer (up first, then the gate) and the second attention norm
    each move the states by far more than the tolerance."""
    state = code_weights()
    expected = code_reference(state)
    assert expected.abs().max() > 2
    loaded = load_model(write_hub_folder(tmp_path / "hub", state), CPU, "f32")
    assert loaded.model.args.attention_norm_2 and loaded.model.args.qk_norm
    assert max_diff(hidden(loaded.model), expected) < 1e-4
    swapped, plain = dict(state), dict(state)
    for i in range(LAYERS):
        name = f"encoder.layer.{i}.mlp.up_gated_layer.weight"
        swapped[name] = torch.cat([state[name][WIDTH:], state[name][:WIDTH]])
        plain[f"encoder.layer.{i}.layer_norm_1.weight"] = torch.ones(HIDDEN)
        plain[f"encoder.layer.{i}.layer_norm_1.bias"] = torch.zeros(HIDDEN)
    assert max_diff(code_reference(swapped), expected) > 0.1
    assert max_diff(code_reference(plain), expected) > 0.1


@pytest.mark.parametrize("split", [False, True])
def test_a_code_gguf_matches_its_modeling_file(split, tmp_path):
    """Whole (today's converter) and split (before 2025); a Q8_0 file against the weights
    gguf dequantizes."""
    state = code_weights()
    path = write_code_gguf(tmp_path / "code.gguf", state, split=split)
    assert max_diff(hidden(load_model(path, CPU, "f32").model), code_reference(state)) < 1e-4
    if not split:
        q8 = gguf.GGMLQuantizationType.Q8_0
        path = write_code_gguf(tmp_path / "q8.gguf", state, q8)
        got = hidden(load_model(path, CPU, "f32").model)
        assert max_diff(got, code_reference(dequantized(state, q8))) < 1e-4


def test_a_gguf_without_a_gate_or_with_a_classifier_is_refused(tmp_path):
    state = weights()
    for i in range(LAYERS):
        name = f"encoder.layer.{i}.mlp.gated_layers.weight"
        state[name] = state[name][:WIDTH]
    with pytest.raises(UnsupportedError, match="ffn_up has 64 rows"):
        load_model(write_jina_gguf(tmp_path / "plain.gguf", state), CPU, "f32")
    extra = {"cls.weight": np.ones((1, HIDDEN), dtype=np.float32)}
    path = write_jina_gguf(tmp_path / "rank.gguf", weights(), extra=extra)
    with pytest.raises(UnsupportedError, match="classifier"):
        load_model(path, CPU, "f32")


def test_embed_and_show_run_a_gguf(tmp_path):
    """`llmrun embed` prints the reference's mean-pooled, normalized vector of the text's
    tokens (the file's pooling)."""
    state = weights()
    path = write_jina_gguf(tmp_path / "m.gguf", state)
    result = llmrun("embed", str(path), "Once upon a time")
    assert result.returncode == 0, result.stderr
    ids = load_tokenizer(path).encode_sequence("Once upon a time")
    expected = F.normalize(reference(state, torch.tensor([ids]))[0].mean(dim=0), dim=0)
    assert max_diff(torch.tensor(json.loads(result.stdout)), expected) < 1e-5
    assert inspect.describe(path)["architecture"] == "jina-bert-v2"
    assert inspect.describe(path)["kv_cache_bytes_8k"] == 0

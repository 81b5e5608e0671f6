"""Nomic BERT v2-moe (nomic-embed-text-v2-moe) against a reference forward written here
from the maths of the Hub's remote code (nomic-ai/nomic-bert-2048's modeling_hf_nomic_bert.py:
NomicBertModel with NomicRouter, NomicExperts, NomicMoELayer), which transformers does not
ship: plain torch loops over tokens, heads and experts on the Hub's own tensors, sharing no
code with llmrun. Loaded from the Hub's folder (config.json with n_embd, ...,
moe_every_n_layers, num_experts, moe_top_k; emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc1/fc2,
mlp.router.layer, mlp.experts.mlp.w1/w2, mlp.experts.bias) and from a "nomic-bert-moe" GGUF
written as llama.cpp's converter writes it (conversion/bert.py NomicBertModel, tensor names
by gguf-py's own map: w1 as ffn_up_exps [experts, width, hidden], w2 turned to ffn_down_exps
[experts, hidden, width], mlp.experts.bias dropped).

What the reference computes (the facts that matter): post-norm blocks; RoPE on whole heads,
half-split, base rotary_emb_base; biases on Wqkv, out_proj, fc1, fc2; exact GELU; the
experts in layers i % moe_every_n_layers == 1 (layer 1 of 2 here); the router's softmax over
all experts in f32, its top moe_top_k taken as they are (not renormalized), each weighing
its expert's gelu(x w1_e^T) w2_e; one bias after the weighted sum.

The tiny model: hidden 32, 2 layers, 4 heads of 8, a feed-forward (and each expert) of 64,
4 experts of which 2 are used, RoPE base 10000, 128 positions, one token type, a 512-token
vocabulary (stories260K's, so the GGUF runs end to end).

Tolerances: f32 hidden states (LayerNorm'd, within about ±4) 1e-4 max abs against the
reference, whole or in a padded batch against each text alone; a Q8_0 GGUF against the
reference on the weights gguf dequantizes: 1e-4; the engine's mean-pooled unit vectors
1e-5. Renormalizing the top-k weights, leaving out the experts' bias and another RoPE base
each move the reference's output by more than 0.05 (asserted), so a model that got one
wrong fails by far; GELU's tanh form (which llama.cpp computes) by more than 2e-4.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from family_checks import max_diff, write_keyed_gguf
from test_bert import hidden

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
# The Hub's config.json of nomic-embed-text-v2-moe, shrunk.
HUB_CONFIG = {
    "model_type": "nomic_bert",
    "architectures": ["NomicBertModel"],
    "activation_function": "gelu",
    "causal": False,
    "prenorm": False,
    "parallel_block": False,
    "qkv_proj_bias": True,
    "mlp_fc1_bias": True,
    "mlp_fc2_bias": True,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "rotary_emb_base": 10000,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 64,
    "n_positions": 128,
    "max_trained_positions": 128,
    "layer_norm_epsilon": 1e-5,
    "type_vocab_size": 1,
    "vocab_size": 512,
    "pad_token_id": 1,
    "moe_every_n_layers": 2,
    "num_experts": 4,
    "moe_top_k": 2,
    "moe_normalize_expert_weights": False,
    "num_shared_experts": 0,
    "expert_choice_router": False,
    "ffn_div": 1,
}
SEQ = 20
IDS = torch.randint(3, 512, (SEQ,), generator=torch.Generator().manual_seed(1))


def hub_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the Hub's names: N(0, 0.2), LayerNorm scales 1 + N(0, 0.1),
    the router N(0, 0.1) (its top 2 of 4 weigh about 0.6, as trained ones about 0.67), the experts' bias N(0, 0.5)."""
    c = HUB_CONFIG
    hidden_, width, experts = c["n_embd"], c["n_inner"], c["num_experts"]
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, mean=0.0, std=0.2):
        return torch.randn(*shape, generator=g) * std + mean

    state = {
        "embeddings.word_embeddings.weight": normal(c["vocab_size"], hidden_),
        "embeddings.token_type_embeddings.weight": normal(1, hidden_),
        "emb_ln.weight": normal(hidden_, mean=1.0, std=0.1),
        "emb_ln.bias": normal(hidden_, std=0.1),
    }
    for i in range(c["n_layer"]):
        p = f"encoder.layers.{i}."
        state |= {
            p + "attn.Wqkv.weight": normal(3 * hidden_, hidden_),
            p + "attn.Wqkv.bias": normal(3 * hidden_),
            p + "attn.out_proj.weight": normal(hidden_, hidden_),
            p + "attn.out_proj.bias": normal(hidden_),
        }
        for norm in ("norm1", "norm2"):
            state[p + f"{norm}.weight"] = normal(hidden_, mean=1.0, std=0.1)
            state[p + f"{norm}.bias"] = normal(hidden_, std=0.1)
        if i % c["moe_every_n_layers"] == 1:
            state |= {
                p + "mlp.router.layer.weight": normal(experts, hidden_, std=0.1),
                p + "mlp.experts.mlp.w1": normal(experts * width, hidden_),
                p + "mlp.experts.mlp.w2": normal(experts * width, hidden_),
                p + "mlp.experts.bias": normal(hidden_, std=0.5),
            }
        else:
            state |= {
                p + "mlp.fc1.weight": normal(width, hidden_),
                p + "mlp.fc1.bias": normal(width),
                p + "mlp.fc2.weight": normal(hidden_, width),
                p + "mlp.fc2.bias": normal(hidden_),
            }
    return state


def reference(
    state: dict[str, torch.Tensor],
    ids: torch.Tensor = IDS,
    renormalize: bool = False,
    expert_bias: bool = True,
    gelu: str = "none",
    rope_base: float | None = None,
) -> torch.Tensor:
    """NomicBertModel's last hidden states [T, hidden] of one unpadded text, from the Hub's
    tensors, token by token. The keywords compute a variant instead, for the test that
    each fact matters: top-k weights renormalized, no experts' bias, GELU's `gelu`
    approximation, another RoPE base."""
    c = HUB_CONFIG
    hidden_, heads, eps = c["n_embd"], c["n_head"], c["layer_norm_epsilon"]
    head_dim, width, experts = hidden_ // heads, c["n_inner"], c["num_experts"]
    base = rope_base or c["rotary_emb_base"]
    tokens = len(ids)

    def linear(x, name):
        return x @ state[name + ".weight"].T + state[name + ".bias"]

    def norm(x, name):
        return F.layer_norm(x, (hidden_,), state[name + ".weight"], state[name + ".bias"], eps)

    def act(x):
        return F.gelu(x, approximate=gelu)

    # NomicBertRotaryEmbedding: angles of half the head, repeated for both halves.
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(tokens).float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)

    def rotate(t):  # [T, D]: x * cos + rotate_half(x) * sin
        half = head_dim // 2
        return t * cos + torch.cat([-t[:, half:], t[:, :half]], dim=-1) * sin

    x = state["embeddings.word_embeddings.weight"][ids]
    x = norm(x + state["embeddings.token_type_embeddings.weight"][0], "emb_ln")
    for i in range(c["n_layer"]):
        p = f"encoder.layers.{i}."
        qkv = linear(x, p + "attn.Wqkv")  # [T, 3 * hidden]: queries, keys, values
        attended = torch.empty(tokens, hidden_)
        for h in range(heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            q = rotate(qkv[:, :hidden_][:, cols])
            k = rotate(qkv[:, hidden_ : 2 * hidden_][:, cols])
            v = qkv[:, 2 * hidden_ :][:, cols]
            scores = torch.softmax(q @ k.T / math.sqrt(head_dim), dim=-1)
            attended[:, cols] = scores @ v
        x = norm(x + linear(attended, p + "attn.out_proj"), p + "norm1")
        if i % c["moe_every_n_layers"] == 1:
            router = state[p + "mlp.router.layer.weight"]
            w1 = state[p + "mlp.experts.mlp.w1"].view(experts, width, hidden_)
            w2 = state[p + "mlp.experts.mlp.w2"].view(experts, width, hidden_)
            out = torch.empty(tokens, hidden_)
            for t in range(tokens):
                probs = torch.softmax(router @ x[t], dim=-1)
                top, chosen = torch.topk(probs, c["moe_top_k"])
                if renormalize:
                    top = top / top.sum()
                total = torch.zeros(hidden_)
                for weight, e in zip(top.tolist(), chosen.tolist(), strict=True):
                    total += weight * (act(w1[e] @ x[t]) @ w2[e])
                out[t] = total + (state[p + "mlp.experts.bias"] if expert_bias else 0)
        else:
            out = linear(act(linear(x, p + "mlp.fc1")), p + "mlp.fc2")
        x = norm(x + out, p + "norm2")
    return x


def write_hub_folder(path, state, **changes):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**HUB_CONFIG, **changes}))
    safetensors_torch.save_file(state, path / "model.safetensors")
    return path


def converted(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The Hub's tensors as llama.cpp's converter writes them, named by gguf-py's map."""
    c = HUB_CONFIG
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT_MOE, c["n_layer"])
    experts, width, hidden_ = c["num_experts"], c["n_inner"], c["n_embd"]
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.bias"):
            continue  # NomicBertModel.filter_tensors drops it
        if name.endswith("mlp.experts.mlp.w1"):
            t, name = t.view(experts, width, hidden_), name + ".weight"
        elif name.endswith("mlp.experts.mlp.w2"):
            t, name = t.view(experts, width, hidden_).transpose(1, 2), name + ".weight"
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t.contiguous().numpy()
    return out


def write_moe_gguf(path, state, qtype=None, **keys):
    """The model as llama.cpp's converter writes nomic-bert-moe: its keys, 2-D and 3-D
    weights in `qtype` (default F32) but the routers and token_types. `keys`: metadata to
    change ("{arch}.…" -> value, None leaves one out)."""
    c = HUB_CONFIG
    metadata = {
        "{arch}.block_count": c["n_layer"],
        "{arch}.context_length": c["n_positions"],
        "{arch}.embedding_length": c["n_embd"],
        "{arch}.feed_forward_length": c["n_inner"],
        "{arch}.attention.head_count": c["n_head"],
        "{arch}.attention.layer_norm_epsilon": float(c["layer_norm_epsilon"]),
        "{arch}.attention.causal": False,
        "{arch}.rope.freq_base": float(c["rotary_emb_base"]),
        "{arch}.pooling_type": int(gguf.PoolingType.MEAN),
        "{arch}.expert_count": c["num_experts"],
        "{arch}.expert_used_count": c["moe_top_k"],
        "{arch}.moe_every_n_layers": c["moe_every_n_layers"],
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.token_type_count": c["type_vocab_size"],
        **keys,
    }
    return write_keyed_gguf(
        path, "nomic-bert-moe", metadata, converted(state), qtype, keep_f32=("token_types",)
    )


def without_expert_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) if k.endswith("experts.bias") else v for k, v in state.items()}


def test_the_hubs_folder_matches_the_reference(tmp_path):
    state = hub_state()
    expected = reference(state)
    assert expected.abs().max() > 2
    loaded = load_model(write_hub_folder(tmp_path / "hub", state), CPU, "f32")
    assert type(loaded.model).generates is False
    assert max_diff(hidden(loaded.model, IDS[None])[0], expected) < 1e-4
    described = inspect.describe(tmp_path / "hub")
    # A token leaves 2 of the 4 experts' 2 * 64 * 32 weights unused (show counts their
    # one shared bias of 32 with them, so half of it too).
    assert described["parameters"] - described["active_parameters"] == 2 * 2 * 64 * 32 + 16


def test_each_fact_moves_the_output():
    """Renormalized top-k weights, a missing experts' bias and another RoPE base each move
    the reference by far more than the tolerance (1e-4); GELU's tanh approximation (what
    llama.cpp computes) by a few times it."""
    state = hub_state()
    expected = reference(state)
    for variant, moves in (
        (dict(renormalize=True), 0.05),
        (dict(expert_bias=False), 0.05),
        (dict(rope_base=1000.0), 0.05),
        (dict(gelu="tanh"), 2e-4),
    ):
        assert max_diff(reference(state, **variant), expected) > moves, variant


def test_a_padded_batch_gives_each_text_its_states_alone(tmp_path):
    state = hub_state()
    model = load_model(write_hub_folder(tmp_path / "hub", state), CPU, "f32").model
    lengths = torch.tensor([SEQ, 9, 1])
    ids = IDS.repeat(3, 1)
    ids[1:, 9:] = 7
    with torch.no_grad():
        batch = model.hidden_states(ids, torch.arange(SEQ).expand(3, SEQ), lengths)
    for row, n in enumerate(lengths.tolist()):
        assert max_diff(batch[row, :n], reference(state, IDS[:n])) < 1e-4


def test_a_gguf_matches_the_reference_without_the_dropped_bias(tmp_path):
    state = hub_state()
    path = write_moe_gguf(tmp_path / "m.gguf", state)
    tensors = read_gguf(path, with_tensors=False).tensors
    assert "blk.1.ffn_up_exps.weight" in tensors and "blk.0.ffn_up.bias" in tensors
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.pooling == "mean"
    got = hidden(loaded.model, IDS[None])[0]
    assert max_diff(got, reference(without_expert_bias(state))) < 1e-4
    assert inspect.describe(path)["architecture"] == "nomic-bert-moe"


def test_the_engine_embeds_as_the_reference_pools(tmp_path):
    state = without_expert_bias(hub_state())
    engine = api.load(str(write_moe_gguf(tmp_path / "m.gguf", state)), generate=False)
    inputs = [IDS.tolist(), IDS[:5].tolist()]
    vectors = engine.embed(inputs).vectors.float()
    for row, ids in enumerate(inputs):
        expected = F.normalize(reference(state, torch.tensor(ids)).mean(dim=0), dim=0)
        assert max_diff(vectors[row], expected) < 1e-5


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    state = without_expert_bias(hub_state())
    path = write_moe_gguf(tmp_path / "q.gguf", state, q8)
    tensors = read_gguf(path, with_tensors=False).tensors
    assert tensors["blk.1.ffn_down_exps.weight"].ggml_type == q8
    assert tensors["blk.1.ffn_gate_inp.weight"].ggml_type == gguf.GGMLQuantizationType.F32

    def rounded(t: torch.Tensor) -> torch.Tensor:  # quantized along the last axis
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8))

    c = HUB_CONFIG
    stack = (c["num_experts"], c["n_inner"], c["n_embd"])
    dequantized = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.mlp.w2"):  # stored [experts, hidden, width]
            t = rounded(t.view(stack).transpose(1, 2)).transpose(1, 2).reshape(t.shape)
        elif t.dim() == 2 and "router" not in name and "token_type" not in name:
            t = rounded(t)
        dequantized[name] = t
    got = hidden(load_model(path, CPU, "f32").model, IDS[None])[0]
    assert max_diff(got, reference(dequantized)) < 1e-4
    assert max_diff(got, reference(state)) > 1e-4


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"moe_normalize_expert_weights": True}, "renormalized expert weights"),
        ({"num_shared_experts": 1}, "shared experts"),
        ({"mlp_fc2_bias": False}, "one projection only"),
        ({"activation_function": "geglu"}, "activation_function 'geglu'"),
    ],
)
def test_the_hubs_settings_llmrun_does_not_compute_are_refused(change, match, tmp_path):
    path = write_hub_folder(tmp_path / "hub", hub_state(), **change)
    with pytest.raises(UnsupportedError, match=match):
        load_model(path, CPU, "f32")


def test_a_gguf_without_its_expert_counts_is_refused(tmp_path):
    path = write_moe_gguf(tmp_path / "m.gguf", hub_state(), **{"{arch}.expert_used_count": None})
    with pytest.raises(ModelFormatError, match="expert_used_count"):
        load_model(path, CPU, "f32")

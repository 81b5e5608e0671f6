"""SmallThinker (the Hub's SmallThinkerForCausalLM, model_type smallthinker; GGUF arch
smallthinker) against a reference that follows the published modeling_smallthinker.py
with transformers' modules: transformers has no SmallThinker, so a MixtralForCausalLM of
ReLU experts (hidden_act relu: each expert down(relu(gate(x)) * up(x)), as published)
holds the weights, and the reference runs its attention, norms, RoPE and experts as the
published decoder layer does: the router reads the layer's input (before the attention's
norm), the top-k of its logits weigh by their softmax or by their sigmoids over their
sum, NoPE layers take no RoPE (cos 1, sin 0), sliding layers a window mask.

Folders as the Hub has them (per-expert keys block_sparse_moe.experts.N.gate/up/down,
the router block_sparse_moe.primary_router, rope_layout and sliding_window_layout);
GGUFs as llama.cpp's converter writes them (conversion/smallthinker.py: TextModel's keys,
the experts stacked, expert_gating_func, sliding_window only where a layer slides), which
llama.cpp reads with its own layout (llmrun/loading/smallthinker.py).

The layouts and the gating each move the logits by far more than the tolerance
(asserted); routing by the normed input instead of the layer's input was checked by
breaking llmrun's code: every parity test fails.

Tolerances: f32 logits 1e-4 max abs, whole and through the KV cache (chunked prefill,
then one token at a time); a Q8_0 GGUF against the reference on the weights gguf
dequantizes: 1e-4; `llmrun run`'s greedy tokens are the reference's.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from family_checks import PROMPT, check_paged, check_show, max_diff, write_keyed_gguf
from gguf import GGMLQuantizationType, Keys
from helpers import BASE, cached_logits, randomize
from in_process import llmrun
from moe_helpers import round_matrices_but_the_routers

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
EXPERTS, USED, WIDTH, HEAD_DIM = 8, 3, 32, 16
# Past cached_logits' prefill chunks (33 tokens), then decode steps.
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
# Each variant's layouts (a flag per layer), window, router and tying.
VARIANTS = {
    # The 21B's: the first of every four layers global and NoPE, the rest sliding.
    "21b": dict(rope=[0, 1], sliding=[0, 1], window=5, softmax=True, tied=False),
    # The 4B's: every layer global and rotating, sigmoid routing, tied embeddings.
    "4b": dict(rope=[1, 1], sliding=[0, 0], window=4096, softmax=False, tied=True),
    # Layouts the published code takes whatever they are.
    "mixed": dict(rope=[1, 0], sliding=[1, 0], window=4, softmax=False, tied=False),
}


def hf_model(variant: dict):
    """A transformers Mixtral of ReLU experts holding the weights (seed 0)."""
    config = transformers.AutoConfig.for_model(
        **{**BASE, "intermediate_size": WIDTH},
        model_type="mixtral",
        num_local_experts=EXPERTS,
        num_experts_per_tok=USED,
        head_dim=HEAD_DIM,
        hidden_act="relu",
        rope_theta=10000.0,
        tie_word_embeddings=variant["tied"],
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(hf, variant: dict, ids: torch.Tensor = IDS) -> torch.Tensor:
    """Logits [1, T, vocab] of ids [1, T], as SmallThinkerForCausalLM computes them."""
    body, width = hf.model, hf.config.hidden_size
    positions = torch.arange(ids.shape[1])
    with torch.no_grad():
        x = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(x, positions[None])
        rotary, nope = (cos, sin), (torch.ones_like(cos), torch.zeros_like(sin))
        q, k = positions[:, None], positions[None]
        causal = torch.where(k <= q, 0.0, float("-inf"))[None, None]
        window = (k <= q) & (q - k < variant["window"])
        sliding = torch.where(window, 0.0, float("-inf"))[None, None]
        for i, layer in enumerate(body.layers):
            router_input = x
            embeddings = rotary if variant["rope"][i] else nope
            mask = sliding if variant["sliding"][i] else causal
            attn, _ = layer.self_attn(layer.input_layernorm(x), embeddings, mask)
            x = x + attn
            h = layer.post_attention_layernorm(x).view(-1, width)
            logits = F.linear(router_input.view(-1, width), layer.mlp.gate.weight)
            top, chosen = torch.topk(logits, USED, dim=-1)
            if variant["softmax"]:
                weights = F.softmax(top, dim=1, dtype=torch.float)
            else:
                weights = torch.sigmoid(top)
                weights /= weights.sum(dim=-1, keepdim=True)
            x = x + layer.mlp.experts(h, chosen, weights).view_as(x)
        return hf.lm_head(body.norm(x))


def hub_state_dict(hf, variant: dict) -> dict[str, torch.Tensor]:
    """The weights under the Hub checkpoint's keys (no lm_head where tied)."""
    out = {}
    for key, value in hf.state_dict().items():
        head, sep, tail = key.partition(".mlp.")
        moe = f"{head}.block_sparse_moe"
        if key == "lm_head.weight" and variant["tied"]:
            continue
        if not sep:
            out[key] = value.clone()
        elif tail == "gate.weight":
            out[f"{moe}.primary_router.weight"] = value.clone()
        elif tail == "experts.gate_up_proj":
            for e in range(EXPERTS):
                out[f"{moe}.experts.{e}.gate.weight"] = value[e, :WIDTH].clone()
                out[f"{moe}.experts.{e}.up.weight"] = value[e, WIDTH:].clone()
        else:  # experts.down_proj
            for e in range(EXPERTS):
                out[f"{moe}.experts.{e}.down.weight"] = value[e].clone()
    return out


def hub_config(hf, variant: dict) -> dict:
    c = hf.config
    return dict(
        architectures=["SmallThinkerForCausalLM"],
        model_type="smallthinker",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=HEAD_DIM,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_layout=variant["rope"],
        sliding_window_layout=variant["sliding"],
        sliding_window_size=variant["window"],
        moe_num_primary_experts=EXPERTS,
        moe_num_active_primary_experts=USED,
        moe_ffn_hidden_size=WIDTH,
        moe_primary_router_apply_softmax=variant["softmax"],
        norm_topk_prob=True,
        tie_word_embeddings=variant["tied"],
        bos_token_id=1,
        eos_token_id=2,
    )


def save_folder(path, hf, variant: dict, **config_changes):
    path.mkdir()
    safetensors_torch.save_file(hub_state_dict(hf, variant), str(path / "model.safetensors"))
    config = {**hub_config(hf, variant), **config_changes}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_hub_folder_matches_the_reference_whole_and_through_the_cache(tmp_path, name):
    variant = VARIANTS[name]
    hf = hf_model(variant)
    expected = reference(hf, variant)
    loaded = load_model(save_folder(tmp_path / "st", hf, variant), CPU, "f32")
    with torch.no_grad():
        whole = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serve_s_paged_cache_gives_the_contiguous_logits(tmp_path, monkeypatch):
    """family_checks.check_paged, the sliding layer's window of 5 in a pool of its own."""
    variant = VARIANTS["21b"]
    hf = hf_model(variant)
    loaded = load_model(save_folder(tmp_path / "st", hf, variant), CPU, "f32")
    check_paged(
        loaded.model, IDS, reference(hf, variant), windowed="smallthinker", monkeypatch=monkeypatch
    )


def test_the_layouts_and_the_gating_each_change_the_logits():
    """What the tests would miss if llmrun ignored it moves the reference's logits by far
    more than the tolerance."""
    variant = VARIANTS["21b"]
    hf = hf_model(variant)
    expected = reference(hf, variant)
    for change in (
        dict(rope=[1, 1]),
        dict(sliding=[0, 0]),
        dict(softmax=False),
    ):
        assert max_diff(reference(hf, {**variant, **change}), expected) > 1e-2


FOLDERS_REFUSED = {
    "a layout of another length": dict(rope_layout=[1]),
    "a layout flag other than 0 or 1": dict(sliding_window_layout=[0, 2]),
    "more experts a token than there are": dict(moe_num_active_primary_experts=EXPERTS + 1),
}


@pytest.mark.parametrize("case", list(FOLDERS_REFUSED))
def test_a_folder_no_model_can_have_is_refused(tmp_path, case):
    variant = VARIANTS["4b"]
    folder = save_folder(tmp_path / "st", hf_model(variant), variant, **FOLDERS_REFUSED[case])
    with pytest.raises(ModelFormatError):
        load_model(folder, CPU, "f32")


def gguf_tensors(hf, variant: dict) -> dict:
    """GGUF name -> array, as the converter names and stacks them."""
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "block_sparse_moe.primary_router": "ffn_gate_inp",
    }
    state = hub_state_dict(hf, variant)
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not variant["tied"]:
        out["output.weight"] = state["lm_head.weight"]
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for module, short in names.items():
            out[f"blk.{layer}.{short}.weight"] = state[f"{prefix}.{module}.weight"]
        for proj in ("gate", "up", "down"):
            stack = [
                state[f"{prefix}.block_sparse_moe.experts.{e}.{proj}.weight"]
                for e in range(EXPERTS)
            ]
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack(stack)
    return {name: tensor.numpy() for name, tensor in out.items()}


def write_smallthinker(path, hf, variant: dict, qtype=None, metadata=None):
    """A smallthinker GGUF of the model as the converter writes it (see the module
    docstring); `metadata` adds or replaces keys (None: leaves one out)."""
    c = hf.config
    keys = {
        Keys.LLM.BLOCK_COUNT: c.num_hidden_layers,
        Keys.LLM.CONTEXT_LENGTH: c.max_position_embeddings,
        Keys.LLM.EMBEDDING_LENGTH: c.hidden_size,
        Keys.LLM.FEED_FORWARD_LENGTH: WIDTH,
        Keys.Attention.HEAD_COUNT: c.num_attention_heads,
        Keys.Attention.HEAD_COUNT_KV: c.num_key_value_heads,
        Keys.Rope.FREQ_BASE: 10000.0,
        Keys.Attention.LAYERNORM_RMS_EPS: c.rms_norm_eps,
        Keys.LLM.EXPERT_COUNT: EXPERTS,
        Keys.LLM.EXPERT_USED_COUNT: USED,
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: WIDTH,
        Keys.LLM.EXPERT_GATING_FUNC: 1 if variant["softmax"] else 2,
        Keys.Attention.SLIDING_WINDOW: variant["window"] if any(variant["sliding"]) else None,
        Keys.Attention.KEY_LENGTH: HEAD_DIM,
        Keys.Attention.VALUE_LENGTH: HEAD_DIM,
        **(metadata or {}),
    }
    return write_keyed_gguf(path, "smallthinker", keys, gguf_tensors(hf, variant), qtype)


# The layouts llama.cpp reads a file as (window 4096: no window within the test's tokens).
GGUF_VARIANTS = {
    "21b": dict(VARIANTS["21b"], window=4096),
    "4b": VARIANTS["4b"],
}


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_a_gguf_matches_the_reference_in_llama_cpp_s_layout(tmp_path, name):
    variant = GGUF_VARIANTS[name]
    hf = hf_model(variant)
    loaded = load_model(write_smallthinker(tmp_path / "m.gguf", hf, variant), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "smallthinker"
    expected = reference(hf, variant)
    with torch.no_grad():
        whole = loaded.model(IDS, torch.arange(IDS.shape[1])[None])
    assert max_diff(whole, expected) < 1e-4
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_the_reference_on_the_dequantized_weights(tmp_path):
    variant = GGUF_VARIANTS["21b"]
    hf = hf_model(variant)
    path = write_smallthinker(tmp_path / "m.gguf", hf, variant, GGMLQuantizationType.Q8_0)
    round_matrices_but_the_routers(hf)
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf, variant)) < 1e-4


GGUFS_REFUSED = {
    "a window llama.cpp does not run": ({Keys.Attention.SLIDING_WINDOW: 512}, UnsupportedError),
    "no gating function": ({Keys.LLM.EXPERT_GATING_FUNC: None}, ModelFormatError),
    "another gating function": ({Keys.LLM.EXPERT_GATING_FUNC: 3}, UnsupportedError),
    "RoPE on part of each head": ({Keys.Rope.DIMENSION_COUNT: 8}, UnsupportedError),
}


@pytest.mark.parametrize("case", list(GGUFS_REFUSED))
def test_a_gguf_llmrun_cannot_read_as_llama_cpp_does_is_refused(tmp_path, case):
    metadata, error = GGUFS_REFUSED[case]
    variant = GGUF_VARIANTS["21b"]
    path = write_smallthinker(tmp_path / "m.gguf", hf_model(variant), variant, metadata=metadata)
    with pytest.raises(error, match=str(tmp_path)):
        load_model(path, CPU, "f32")


def test_the_sliding_layers_cache_keeps_their_window(tmp_path):
    """A folder's sliding layer keeps its 5 positions of 64, a GGUF's its 4096 of 8192: the
    cache llmrun builds, llmrun.models.kv_cache_bytes and inspect's torch-free twin agree."""
    variant = VARIANTS["21b"]
    hf = hf_model(variant)
    loaded = load_model(save_folder(tmp_path / "st", hf, variant), CPU, "f32")
    config = hub_config(hf, variant)
    per_position = 2 * 2 * HEAD_DIM * 4  # keys and values, 2 heads, f32
    cache = loaded.model.new_cache(1, 64, torch.float32, "cpu")
    assert inspect.kv_cache_bytes(config, 64) == kv_cache_bytes(config, 64) == cache.nbytes
    assert cache.nbytes == per_position * (64 + 5)
    form = GGUF_VARIANTS["21b"]
    config = config_from_gguf(read_gguf(write_smallthinker(tmp_path / "m.gguf", hf, form)))
    assert inspect.kv_cache_bytes(config, 8192) == kv_cache_bytes(config, 8192)
    assert kv_cache_bytes(config, 8192) == per_position * (8192 + 4096)


def test_run_picks_the_reference_s_greedy_tokens_and_show_names_it(tmp_path):
    """`llmrun run --temperature 0` picks the reference's greedy tokens; `llmrun show`
    names the arch and counts 2 layers of keys and values (2 heads of 16, f32, 8192
    positions, the sliding layer's 4096)."""
    variant = GGUF_VARIANTS["21b"]
    hf = hf_model(variant)
    path = write_smallthinker(tmp_path / "m.gguf", hf, variant)
    ids = load_tokenizer(path).encode(PROMPT)
    for _ in range(12):
        ids.append(int(reference(hf, variant, torch.tensor([ids]))[0, -1].argmax()))
    result = llmrun(
        "run", str(path), PROMPT, "-n", "12", "--temperature", "0", "--json", "--logprobs", "1"
    )
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == ids[-12:]
    check_show(path, "smallthinker", 2 * 2 * HEAD_DIM * 4 * (8192 + 4096), moe=True)

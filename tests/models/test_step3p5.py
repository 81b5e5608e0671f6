"""Step 3.5 against transformers' Step3p7TextModel (with an output matrix): sliding
layers with more heads, their own RoPE base and whole-head rotation beside global layers
rotating half of each head; per-head q/k norms and output gates; 1 + w norms; dense
layers first, then sigmoid-routed experts with a selection bias, a routing scale and a
shared expert; per-layer SwiGLU clamps; a trailing multi-token-prediction layer to skip.
Built from a config.json dict and from a Hub folder in StepFun's own names and config
fields. Logits span about ±5; llmrun matches to 1e-4."""

import json

import gguf
import pytest
import test_cache_types
import test_paged
import torch
from family_checks import check_rounded_cache, check_run_and_show, write_keyed_gguf
from gguf import GGMLQuantizationType
from helpers import BASE, cached_logits, randomize
from safetensors.torch import save_file

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model
from llmrun.models import step3p5

transformers = pytest.importorskip("transformers")
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig  # noqa: E402
from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel  # noqa: E402

TOLERANCE = 1e-4
# Drift from an f32 cache over test_cache_types' 40 positions (logits of ±8), measured
# bf16 5.2e-2, q8_0 4.6e-1: allowed about twice that. f16's rounding tips one token's
# near-tied expert choice (2.9 there, 5e-3 elsewhere): no bound, only exactness.
CACHE_DRIFT = {"f16": None, "bf16": 1e-1, "q8_0": 1.0}
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
# StepFun's config.json fields, with the trailing multi-token-prediction layer's entries.
HUB_CONFIG = dict(
    model_type="step3p5",
    architectures=["Step3p5ForCausalLM"],
    vocab_size=BASE["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_nextn_predict_layers=1,
    num_attention_heads=4,
    num_attention_groups=2,
    head_dim=32,
    attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 2},
    layer_types=LAYER_TYPES + ["full_attention"],
    sliding_window=5,
    rope_theta=[10000.0, 500.0, 500.0, 10000.0, 10000.0],
    partial_rotary_factors=[0.5, 1.0, 1.0, 0.5, 0.5],
    moe_layers_enum="2,3,4",
    moe_num_experts=6,
    moe_top_k=2,
    moe_intermediate_size=32,
    share_expert_dim=48,
    moe_router_scaling_factor=2.5,
    swiglu_limits=[0, 0, 0, 0.8, 0],
    swiglu_limits_shared=[0, 0.6, 0, 0, 0],
    rms_norm_eps=1e-5,
)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))


class Reference(torch.nn.Module):
    """Step3p7TextModel and an output matrix: Step 3.5's causal LM."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Step3p7TextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.lm_head(self.model(ids).last_hidden_state)

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos_token_id: int, **_):
        """Greedy decoding, as transformers' generate(do_sample=False) picks tokens: the
        full sequence through the model each step, ending after an end of sequence."""
        for _ in range(max_new_tokens):
            token = self(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            if token.item() == eos_token_id:
                break
        return ids


def reference_model(**overrides) -> Reference:
    torch.manual_seed(0)
    model = Reference(Step3p7TextConfig(**{**HUB_CONFIG, **overrides})).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # they store w of x * (1 + w)
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


def our_state(ref: Reference) -> dict[str, torch.Tensor]:
    """The reference's weights under llmrun's keys: one module per expert."""
    out = {}
    for key, value in ref.state_dict().items():
        head, _, tail = key.partition(".experts.")
        if tail == "gate_up_proj":
            for e, w in enumerate(value):
                gate, up = w.chunk(2)
                out[f"{head}.experts.{e}.gate_proj.weight"] = gate
                out[f"{head}.experts.{e}.up_proj.weight"] = up
        elif tail == "down_proj":
            for e, w in enumerate(value):
                out[f"{head}.experts.{e}.down_proj.weight"] = w
        elif "rotary_emb" not in key:
            out[key] = value
    return out


def hub_state(ref: Reference) -> dict[str, torch.Tensor]:
    """The reference's weights under StepFun's checkpoint keys, with a trailing
    multi-token-prediction layer that must be skipped."""
    out = {}
    for key, value in ref.state_dict().items():
        if "rotary_emb" in key:
            continue
        key = key.replace(".mlp.gate.e_score_correction_bias", ".moe.router_bias")
        key = key.replace(".mlp.gate.weight", ".moe.gate.weight")
        key = key.replace(".mlp.shared_experts.", ".share_expert.")
        if key.endswith(".mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            prefix = key.removesuffix(".mlp.experts.gate_up_proj")
            out[f"{prefix}.moe.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}.moe.up_proj.weight"] = up.contiguous()
            continue
        key = key.replace(".mlp.experts.down_proj", ".moe.down_proj.weight")
        out[key] = value.contiguous()
    out["model.layers.4.self_attn.q_proj.weight"] = torch.zeros(128, 64)
    out["model.layers.4.transformer.shared_head.norm.weight"] = torch.zeros(64)
    return out


def ours_of(ref: Reference, config: dict | None = None):
    model = step3p5.Model(step3p5.ModelArgs.from_config(config or HUB_CONFIG))
    model.load_state_dict(our_state(ref), strict=True)
    return model.eval()


def full(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


@pytest.fixture(scope="module")
def ref():
    return reference_model()


@pytest.fixture(scope="module")
def ours(ref):
    return ours_of(ref)


def test_matches_transformers_whole_decoding_and_in_chunks(ref, ours):
    expected = ref(IDS)
    assert expected.abs().max() > 3
    assert (full(ours) - expected).abs().max() < TOLERANCE
    assert (cached_logits(ours, IDS, chunks=(6,)) - expected).abs().max() < TOLERANCE
    assert (cached_logits(ours, IDS) - expected).abs().max() < TOLERANCE


def test_the_transformers_config_reads_the_same(ref):
    """transformers' own config.json (rope_parameters by layer type, its field names)."""
    config = ref.config.to_dict()
    assert (full(ours_of(ref, config)) - ref(IDS)).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    "feature,change",
    [
        ("the sliding layers' head count", dict(attention_other_setting=None)),
        ("the sliding layers' RoPE", dict(rope_theta=10000.0)),
        ("the partial rotation", dict(partial_rotary_factors=[1.0] * 5)),
        ("the routing scale", dict(moe_router_scaling_factor=1.0)),
        ("the routed clamp", dict(swiglu_limits=None)),
        ("the shared clamp", dict(swiglu_limits_shared=None)),
        ("the window", dict(sliding_window=64)),
    ],
)
def test_each_feature_matters(ref, feature, change):
    """llmrun reading the config without one feature gives other logits (the head count
    changes the weights' shapes: the model cannot be built then)."""
    config = {**HUB_CONFIG, **change}
    try:
        changed = ours_of(ref, config)
    except RuntimeError:
        assert feature == "the sliding layers' head count"
        return
    assert (full(changed) - ref(IDS)).abs().max() > 0.05, feature


@pytest.mark.parametrize(
    "feature,suffix,change",
    [
        ("the per-head gates", "g_proj.weight", torch.zeros_like),
        ("the norms' 1 + w", "norm.weight", lambda w: w - 1.0),
        ("the selection bias", "e_score_correction_bias", torch.zeros_like),
    ],
)
def test_each_weight_feature_matters(ref, ours, feature, suffix, change):
    """Our model with those weights changed as a model without the feature would read
    them (no gate: sigmoid 0.5 throughout; x * w norms: 1 + (w - 1))."""
    state = {k: change(v) if k.endswith(suffix) else v for k, v in our_state(ref).items()}
    changed = step3p5.Model(ours.args)
    changed.load_state_dict(state)
    assert (full(changed.eval()) - ref(IDS)).abs().max() > 0.05, feature


def test_hub_folder_in_stepfun_names(ref, tmp_path):
    save_file(hub_state(ref), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIG))
    loaded = load_model(tmp_path, torch.device("cpu"))
    assert (full(loaded.model) - ref(IDS)).abs().max() < TOLERANCE
    assert loaded.model.decode_step is None


# GGUF tensor names by the reference's module, as gguf-py's tensor_mapping.py maps step35.
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.g_proj": "attn_gate",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_tensors(ref: Reference) -> dict:
    """The reference's tensors as llama.cpp's converter writes them: norms as 1 + w,
    experts stacked per projection, the selection bias as exp_probs_b.bias; and a
    multi-token-prediction layer after the trunk, which must be skipped."""
    out = {}
    for key, value in ref.state_dict().items():
        value = value.numpy()
        if "rotary_emb" in key:
            continue
        if key.endswith("norm.weight"):
            value = value + 1.0
        module, _, suffix = key.rpartition(".")
        if module in GLOBAL_NAMES:
            out[f"{GLOBAL_NAMES[module]}.{suffix}"] = value
            continue
        _, _, layer, rest = key.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":
            gate, up = value[:, : value.shape[1] // 2], value[:, value.shape[1] // 2 :]
            out[f"{blk}.ffn_gate_exps.weight"] = gate.copy()
            out[f"{blk}.ffn_up_exps.weight"] = up.copy()
        elif rest == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = value
        elif rest == "mlp.gate.e_score_correction_bias":
            out[f"{blk}.exp_probs_b.bias"] = value
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"{blk}.{GGUF_NAMES[module]}.{suffix}"] = value
    out["blk.4.attn_norm.weight"] = out["blk.0.attn_norm.weight"]
    out["blk.4.nextn.eh_proj.weight"] = out["blk.0.attn_q.weight"][:, :64]
    return out


def gguf_keys(config) -> dict:
    """The metadata conversion/step3.py Step35Model writes (MTP layer included)."""
    types = HUB_CONFIG["layer_types"]
    sliding = [t == "sliding_attention" for t in types]
    return {
        "{arch}.block_count": 5,
        "{arch}.context_length": 4096,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": [8 if s else 4 for s in sliding],
        "{arch}.attention.head_count_kv": [2] * 5,
        "{arch}.rope.freq_base": 10000.0,
        "{arch}.rope.freq_base_swa": 500.0,
        "{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "{arch}.expert_count": 6,
        "{arch}.expert_used_count": 2,
        "{arch}.attention.key_length": 32,
        "{arch}.attention.value_length": 32,
        "{arch}.attention.sliding_window": 5,
        "{arch}.attention.sliding_window_pattern": sliding,
        "{arch}.expert_feed_forward_length": 32,
        "{arch}.expert_shared_feed_forward_length": 48,
        "{arch}.expert_weights_scale": 2.5,
        "{arch}.expert_weights_norm": True,
        "{arch}.leading_dense_block_count": 2,
        "{arch}.moe_every_n_layers": 1,
        "{arch}.swiglu_clamp_exp": [float(v) for v in HUB_CONFIG["swiglu_limits"]],
        "{arch}.swiglu_clamp_shexp": [float(v) for v in HUB_CONFIG["swiglu_limits_shared"]],
        "{arch}.nextn_predict_layers": 1,
    }


def write_gguf(path, ref: Reference, qtype=None, **keys):
    metadata = {**gguf_keys(ref.config), **keys}
    tensors = gguf_tensors(ref)
    return write_keyed_gguf(path, "step35", metadata, tensors, qtype, whole_blocks=True)


def test_gguf_as_llama_cpp_writes_it(ref, tmp_path):
    loaded = load_model(write_gguf(tmp_path / "m.gguf", ref), torch.device("cpu"))
    config = loaded.checkpoint.config
    assert (config["model_type"], config["num_hidden_layers"]) == ("step3p5", 4)
    expected = ref(IDS)
    assert (full(loaded.model) - expected).abs().max() < TOLERANCE
    assert (cached_logits(loaded.model, IDS) - expected).abs().max() < TOLERANCE
    assert loaded.model.decode_step is None


def test_llmrun_run_prints_the_greedy_text_and_show_describes_it(ref, tmp_path):
    check_run_and_show(ref, write_gguf(tmp_path / "m.gguf", ref), "step35")


def test_q8_0_gguf_matches_its_dequantized_weights(ref, tmp_path):
    """Against the reference with the file's weights: each matrix of whole 32-value
    rows rounded through Q8_0 (the routers and the rest stay F32, as written)."""
    qtype = GGMLQuantizationType.Q8_0
    loaded = load_model(write_gguf(tmp_path / "q.gguf", ref, qtype), torch.device("cpu"))
    rounded = reference_model()
    with torch.no_grad():
        for name, w in rounded.named_parameters():
            if w.dim() >= 2 and w.shape[-1] % 32 == 0 and not name.endswith("mlp.gate.weight"):
                blocks = gguf.quants.quantize(w.numpy(), qtype)
                w.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    assert (full(loaded.model) - rounded(IDS)).abs().max() < TOLERANCE
    # 8-bit blocks move logits of about ±5 by a few hundredths on average.
    assert (full(loaded.model) - ref(IDS)).abs().mean() < 0.1


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"{arch}.attention.head_count_kv": [2, 1, 1, 2, 2]}, "key/value heads"),
        ({"{arch}.expert_gating_func": 1}, "not sigmoid"),
        ({"{arch}.rope.scaling.type": "yarn"}, "RoPE scaling"),
    ],
)
def test_what_a_gguf_may_not_ask(ref, tmp_path, keys, message):
    with pytest.raises(UnsupportedError, match=message):
        load_model(write_gguf(tmp_path / "m.gguf", ref, **keys), torch.device("cpu"))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(use_bidirectional_attention=True), "bidirectional"),
        (dict(attention_other_setting={"num_attention_groups": 1}), "key/value heads"),
    ],
)
def test_what_is_refused(change, message):
    with pytest.raises(UnsupportedError, match=message):
        step3p5.ModelArgs.from_config({**HUB_CONFIG, **change})


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_paged_cache_gives_the_contiguous_logits(ours, cache_type):
    test_paged.test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(ours, cache_type)


def test_paged_batched_rows_give_their_own_logits(ours):
    test_paged.test_batched_rows_sharing_prefix_blocks_give_their_own_logits(ours)


@pytest.mark.parametrize("cache_type", test_cache_types.TYPES)
def test_cache_types_give_an_f32_cache_of_their_rounded_values(ours, cache_type):
    check_rounded_cache(ours, cache_type, CACHE_DRIFT[cache_type])


def test_the_loaders_names_are_the_models():
    """loading/step3p5 spells the layer and feed-forward kinds itself (it stays
    torch-free for `llmrun list` and `show`): the same as the model's."""
    from llmrun.loading import step3p5 as loading
    from llmrun.models import base
    from llmrun.models import step3p5 as model

    assert loading.LAYER_TYPES == base.LAYER_TYPES
    assert loading.MLP_TYPES == model.MLP_TYPES

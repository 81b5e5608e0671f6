"""DBRX against transformers' DbrxForCausalLM, from a config.json with the Hub's keys
(nested attn_config/ffn_config, fused experts) and from a "dbrx" GGUF written as
llama.cpp's converter writes it (conversion/dbrx.py: the fused attn_qkv as it is, the
experts stacked [E, width, hidden], w2 transposed to [E, hidden, width], clamp_kqv and
the LayerNorm epsilon in the metadata).

The tiny models: 16 experts, the top 4 of each token's router; GQA 4:2; queries, keys
and values clamped to ±2 (about 8% of them are). Each feature moves the logits by far
more than the tolerance (asserted below): the clamp, the weights' renormalization (p = 1
in the released models; p = 2 and none are transformers' too), and LayerNorms (RMSNorms
give another model).

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. A Q8_0 GGUF against transformers on the weights gguf dequantizes: 1e-4. An f16
or bf16 cache: 1e-5 against an f32 cache holding the rounded values, drifting from f32
by less than DRIFT.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
    write_keyed_gguf,
)
from helpers import BASE, cached_logits, our_model, randomize

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import dbrx as dbrx_loading
from llmrun.loading.loader import load_model
from llmrun.models import dbrx

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
CLIP = 2.0
# transformers' DbrxAttention fails on clip_qkv None (torch.clamp of no bounds); a bound
# no output reaches is the same model.
NO_CLAMP = 1e6
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits (measured: f16 ~2e-3, bf16 ~2e-2; a router that
# picks another expert for a token moves its logits by more than rounding).
DRIFT = {"f16": 1e-2, "bf16": 0.3}
Q8 = gguf.GGMLQuantizationType.Q8_0
_NORMS = ("norm_1.weight", "norm_2.weight", "norm_f.weight")


def hf_config(**overrides) -> dict:
    """A tiny DbrxConfig's arguments: `overrides` of clip_qkv, rope_theta, kv_n_heads go
    into attn_config, of moe_* and ffn_hidden_size into ffn_config, the rest top level."""
    attn = dict(kv_n_heads=2, clip_qkv=CLIP, rope_theta=500000.0)
    ffn = dict(ffn_hidden_size=32, moe_num_experts=16, moe_top_k=4)
    top = dict(
        d_model=BASE["hidden_size"],
        n_heads=BASE["num_attention_heads"],
        n_layers=BASE["num_hidden_layers"],
        max_seq_len=BASE["max_position_embeddings"],
        vocab_size=BASE["vocab_size"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    for name, value in overrides.items():
        if name in attn or name == "attn_pdrop":
            attn[name] = value
        elif name in ffn or name.startswith("moe_"):
            ffn[name] = value
        else:
            top[name] = value
    # transformers 5 reads the RoPE base from rope_parameters alone; the Hub's files
    # have it in attn_config, which llama.cpp's converter reads: both say the same here.
    rope = dict(rope_type="default", rope_theta=attn["rope_theta"])
    return dict(top, attn_config=attn, ffn_config=ffn, rope_parameters=rope)


def hf_model(**overrides):
    """transformers' tiny DBRX (f32, eval): randomize()'s weights, attention outputs
    0.3x (at full size tokens look alike to the routers, which then leave experts
    unused), LayerNorm scales 1 + N(0, 0.1) (randomize knows norms by a name DBRX's do
    not have)."""
    torch.manual_seed(0)
    config = transformers.DbrxConfig(**hf_config(**overrides))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"out_proj.weight": 0.3})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_NORMS):
                p.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    config = hf.config.to_dict()
    return our_model(config, dbrx_loading.hub_tensors(hf.state_dict(), config))


@pytest.fixture(scope="module", params=[1.0, 2.0, None], ids=["p1", "p2", "unnormalized"])
def family(request):
    hf = hf_model(moe_normalize_expert_weights=request.param)
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_GLOBAL = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.norm_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "norm_attn_norm.norm_1.weight": "attn_norm.weight",
    "norm_attn_norm.attn.Wqkv.weight": "attn_qkv.weight",
    "norm_attn_norm.attn.out_proj.weight": "attn_output.weight",
    "norm_attn_norm.norm_2.weight": "attn_output_norm.weight",
    "ffn.router.layer.weight": "ffn_gate_inp.weight",
}
# The fused experts [E * width, hidden] -> llama.cpp's stacks, and the converter's
# permutation of the [E, width, hidden] view (w2: to [E, hidden, width]).
_EXPERTS = {"w1": ("ffn_gate_exps", None), "v1": ("ffn_up_exps", None)}
_EXPERTS["w2"] = ("ffn_down_exps", (0, 2, 1))


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, as conversion/dbrx.py writes them."""
    ffn = hf.config.ffn_config
    experts, width, hidden = ffn.moe_num_experts, ffn.ffn_hidden_size, hf.config.d_model
    out = {}
    for name, t in hf.state_dict().items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t.float().numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest in _LAYER:
            out[f"blk.{layer}.{_LAYER[rest]}"] = t.float().numpy()
            continue
        stack, permutation = _EXPERTS[rest.rpartition(".")[2]]
        data = t.view(experts, width, hidden)
        if permutation is not None:
            data = data.permute(*permutation)
        out[f"blk.{layer}.{stack}.weight"] = np.ascontiguousarray(data.float().numpy())
    return out


def write_dbrx_gguf(path, hf, qtype=None, **changed):
    """hf as llama.cpp's converter writes DBRX: its own keys (no key_length, no
    rope.dimension_count), layer_norm_epsilon 1e-5, clamp_kqv. `qtype`: the matrices'
    type but the routers' (F32). `changed`: keys replaced (None: left out)."""
    config, attn, ffn = hf.config, hf.config.attn_config, hf.config.ffn_config
    keys = {
        gguf.Keys.LLM.BLOCK_COUNT: config.n_layers,
        gguf.Keys.LLM.CONTEXT_LENGTH: config.max_seq_len,
        gguf.Keys.LLM.EMBEDDING_LENGTH: config.d_model,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: ffn.ffn_hidden_size,
        gguf.Keys.Attention.HEAD_COUNT: config.n_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: attn.kv_n_heads,
        gguf.Keys.Rope.FREQ_BASE: config.rope_parameters["rope_theta"],
        gguf.Keys.Attention.CLAMP_KQV: float(attn.clip_qkv),
        gguf.Keys.LLM.EXPERT_COUNT: ffn.moe_num_experts,
        gguf.Keys.LLM.EXPERT_USED_COUNT: ffn.moe_top_k,
        gguf.Keys.Attention.LAYERNORM_EPS: 1e-5,
        gguf.Keys.General.FILE_TYPE: 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
    }
    keys.update(changed)
    return write_keyed_gguf(path, dbrx_loading.ARCH, keys, converted(hf), qtype)


def round_to_q8_0(hf) -> None:
    """hf's matrices in place as a Q8_0 GGUF holds them (the router's F32): each row of
    the stacks rounded in blocks, w2's in its transposed layout."""
    ffn = hf.config.ffn_config
    experts, width, hidden = ffn.moe_num_experts, ffn.ffn_hidden_size, hf.config.d_model

    def rounded(data: torch.Tensor) -> torch.Tensor:
        blocks = gguf.quants.quantize(np.ascontiguousarray(data.numpy()), Q8)
        return torch.from_numpy(gguf.quants.dequantize(blocks, Q8).copy())

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() < 2 or name.endswith("router.layer.weight"):
                continue
            if name.endswith(".w2"):
                stack = p.view(experts, width, hidden).transpose(1, 2)
                p.copy_(rounded(stack).transpose(1, 2).reshape(p.shape))
            else:
                p.copy_(rounded(p))


# ---- the model ----------------------------------------------------------------------


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)


def test_each_feature_moves_the_logits():
    """The clamp and the renormalization change transformers' logits by far more than
    the tolerance, and llmrun's without them miss; so do RMSNorms for the LayerNorms."""
    hf = hf_model()
    expected = reference(hf)
    assert max_diff(reference(hf_model(clip_qkv=NO_CLAMP)), expected) > 0.1
    assert max_diff(reference(hf_model(moe_normalize_expert_weights=None)), expected) > 0.1
    unclamped = ours(hf)
    for layer in unclamped.model.layers:
        layer.self_attn.clip = None
    assert max_diff(cached_logits(unclamped, IDS), expected) > 0.1
    unnormalized = ours(hf)
    for layer in unnormalized.model.layers:
        layer.mlp.norm_p = None
    assert max_diff(cached_logits(unnormalized, IDS), expected) > 0.1
    rms = ours(hf)
    for layer in rms.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name)
            setattr(layer, name, _RMSNorm(norm.weight, norm.eps))
    assert max_diff(cached_logits(rms, IDS), expected) > 0.1


class _RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_every_expert_is_chosen():
    """The routers use all 16 experts of each layer on IDS, so every expert's weights
    (and their layout) count in the logits."""
    hf = hf_model()
    chosen = []
    hooks = [
        block.ffn.router.register_forward_hook(
            lambda _m, _i, logits: chosen.append(logits.topk(4, dim=-1).indices.unique().numel())
        )
        for block in hf.transformer.blocks
    ]
    reference(hf)
    for hook in hooks:
        hook.remove()
    assert chosen == [16, 16]


def test_the_hub_config_reads_as_transformers_reads_it():
    """The Hub's config.json nests the settings, names the sizes its own way and gives
    the RoPE base in attn_config alone; a base given twice and differently is refused."""
    config = dict(hf_config(), model_type="dbrx")
    hub = {k: v for k, v in config.items() if k != "rope_parameters"}
    args = dbrx.ModelArgs.from_config(hub)
    assert (args.hidden_size, args.num_attention_heads, args.num_hidden_layers) == (64, 4, 2)
    assert (args.num_key_value_heads, args.clip_qkv, args.intermediate_size) == (2, CLIP, 32)
    assert (args.num_local_experts, args.num_experts_per_tok) == (16, 4)
    assert args.rope_parameters["rope_theta"] == 500000.0
    assert (
        dbrx.ModelArgs.from_config(dict(config, attn_config={})).rope_parameters["rope_theta"]
        == 500000.0
    )
    with pytest.raises(ModelFormatError, match="rope_theta"):
        dbrx.ModelArgs.from_config(dict(config, rope_parameters={"rope_theta": 10000.0}))
    with pytest.raises(ModelFormatError, match="moe_top_k is 17"):
        dbrx.ModelArgs.from_config(
            dict(config, ffn_config={**config["ffn_config"], "moe_top_k": 17})
        )


def test_serves_from_paged_blocks_as_every_family_does(family):
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(cache_type):
    hf = hf_model()
    check_typed_cache(ours(hf), IDS, reference(hf), cache_type, DRIFT[cache_type])


def test_no_static_decode_step():
    """CUDA graphs' static step refuses a mixture of experts (its routers' choices are
    read back to the host)."""
    model = ours(hf_model())
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None  # the native step does not know DBRX
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_with_a_foreign_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    state["transformer.blocks.0.ffn.extra.weight"] = torch.zeros(2)
    save_file(state, file)
    with pytest.raises(ModelFormatError, match="ffn.extra.weight"):
        load_model(tmp_path / "hf", CPU, "f32")


def test_a_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_dbrx_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "dbrx" and config["clip_qkv"] == CLIP
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (16, 4)
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_without_a_clamp_matches_transformers_without_one(tmp_path):
    """clamp_kqv 0: llama.cpp clamps nothing."""
    hf = hf_model(clip_qkv=NO_CLAMP)
    path = write_dbrx_gguf(tmp_path / "m.gguf", hf_model(), **{gguf.Keys.Attention.CLAMP_KQV: 0.0})
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["clip_qkv"] is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    """Every matrix and stack of experts Q8_0 but the routers, which the converter keeps
    in F32."""
    hf = hf_model()
    loaded = load_model(write_dbrx_gguf(tmp_path / "q.gguf", hf, Q8), CPU, "f32")
    unrounded = reference(hf)
    round_to_q8_0(hf)
    expected = reference(hf)
    assert max_diff(unrounded, expected) > 1e-3  # the rounding shows
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize(
    ("changed", "error", "message"),
    [
        ({gguf.Keys.Attention.CLAMP_KQV: None}, ModelFormatError, "clamp_kqv' is missing"),
        ({gguf.Keys.Attention.LAYERNORM_EPS: None}, ModelFormatError, "epsilon' is missing"),
        ({gguf.Keys.LLM.EXPERT_USED_COUNT: None}, ModelFormatError, "expert_used_count is 0"),
        ({gguf.Keys.LLM.EXPERT_COUNT: 2}, ModelFormatError, "expert_used_count is 4"),
        ({gguf.Keys.Attention.KEY_LENGTH: 32}, UnsupportedError, "heads of 32 features"),
        ({gguf.Keys.Rope.DIMENSION_COUNT: 8}, UnsupportedError, "rotates whole heads"),
    ],
)
def test_what_is_refused(tmp_path, changed, error, message):
    path = write_dbrx_gguf(tmp_path / "bad.gguf", hf_model(), **changed)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text_and_show_describes_it(tmp_path):
    hf = hf_model()
    path = write_dbrx_gguf(tmp_path / "dbrx.gguf", hf)
    check_run_and_show(hf, path, "dbrx")
    # 2 layers x 2 KV heads x 16 features x keys and values x 4 bytes x 8192 positions
    check_show(path, "dbrx", 2 * 2 * 16 * 2 * 4 * 8192, moe=True)

"""Qwen3.5 and Qwen3.5-MoE against transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM, from config.json folders (text-only, multimodal, experts fused as
transformers 5 saves them) and from "qwen35"/"qwen35moe" GGUFs written as llama.cpp's
converter writes them (conversion/qwen.py: norms but the gated one stored as 1 + w,
A_log as -exp(A_log), dt_bias as ssm_dt.bias, the convolution squeezed, value heads
reordered from grouped to tiled, experts stacked, a multi-token-prediction layer after
the trunk).

The tiny models have two key heads serving four value heads (so the grouped and tiled
orders differ), a convolution of 4 taps, value heads as wide as key heads (llama.cpp's
layout), partial RoPE on 8 of 32 features, and decays slow enough (A = exp(A_log) in
0.02 .. 0.37) that the state carries tokens far. Each feature's removal was checked to
fail these tests (see the report of the change); test_each_feature_moves_the_logits
keeps some of them checked here.

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole,
through the KV cache and recurrent state (prefills in chunks, then one token at a
time), in padded batches and from serve's paged blocks. The chunked delta rule against
the per-token recurrence: 1e-5. A Q8_0 GGUF against an F32 GGUF of the same weights
round-tripped through Q8_0: 1e-4 (and within 1.0 of transformers on the exact weights,
which Q8_0 rounding moves by about 0.5 here; the MoE's by more, as experts change).
A typed (f16/bf16) KV cache: 1e-5 against an f32 cache that stores the rounded values,
and less than DRIFT from f32.
"""

import gguf
import numpy as np
import pytest
import torch
from family_checks import (
    check_run_and_show,
    check_typed_cache,
    max_diff,
)
from helpers import CHUNKS, STORIES_GGUF, cached_logits, fuse_gate_up_experts, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api, native, ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.loading.qwen35 import RECURRENT_LAYERS
from llmrun.models import qwen3_5
from llmrun.models.recurrent import RecurrentState

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
DENSE = dict(
    model_type="qwen3_5_text",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,  # stories260K's tokenizer
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)
MOE = dict(
    DENSE,
    model_type="qwen3_5_moe_text",
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
)
CONFIGS = {"dense": DENSE, "moe": MOE}
ARCH = {"dense": "qwen35", "moe": "qwen35moe"}
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
DRIFT = {"f16": 1e-2, "bf16": 1e-1}  # measured: f16 about 1e-3, bf16 about 1e-2


def hf_model(kind: str | None = "dense", **overrides):
    """A transformers model of CONFIGS[kind] (None: of `overrides` alone) with
    randomize()'s weights (the output matrix scaled down to keep logits within about
    ±6) and slow decays."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIGS.get(kind, {}), **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"lm_head.weight": 0.4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.0)
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """The weights under llmrun's (the Hub's) keys: fused experts split per expert."""
    out = {}
    for key, value in hf.state_dict().items():
        head, sep, tail = key.partition(".mlp.experts.")
        if sep and tail == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{head}{sep}{e}.gate_proj.weight"] = value[e, :width]
                out[f"{head}{sep}{e}.up_proj.weight"] = value[e, width:]
        elif sep and tail == "down_proj":
            for e in range(value.shape[0]):
                out[f"{head}{sep}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def ours(hf) -> torch.nn.Module:
    config = hf.config.to_dict()
    module = qwen3_5 if config["model_type"] == "qwen3_5_text" else _moe_module()
    model = module.Model(module.ModelArgs.from_config(config))
    model.load_state_dict(hub_state(hf), strict=True)
    return model.eval()


def _moe_module():
    from llmrun.models import qwen3_5_moe

    return qwen3_5_moe


@pytest.fixture(scope="module", params=["dense", "moe"])
def family(request):
    hf = hf_model(request.param)
    return request.param, hf, reference(hf)


# ---- the model against transformers ---------------------------------------------------


def test_whole_chunked_and_decoded_match_transformers(family):
    kind, hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Prefills of CHUNKS (one of them a single token), then decode steps.
    assert max_diff(cached_logits(model, IDS, CHUNKS), expected) < 1e-4
    # A short prefill, then every token decoded through the cache.
    assert max_diff(cached_logits(model, IDS, (3,)), expected) < 1e-4


def test_chunked_delta_rule_matches_the_recurrence():
    """The chunked prefill form (several chunks, a partial last one, a state to start
    from) gives the per-token recurrence's outputs and final state."""
    gen = torch.Generator().manual_seed(2)
    b, h, t, dk, dv = 2, 3, 150, 8, 6
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    decay = -torch.rand(b, h, t, generator=gen) * 0.3
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    out, final = qwen3_5.recurrent_delta_rule(q, k, v, decay, beta, state)
    for chunk in (64, 16):
        got, got_final = qwen3_5.chunked_delta_rule(q, k, v, decay, beta, state, chunk)
        assert max_diff(got, out) < 1e-5 and max_diff(got_final, final) < 1e-5
    assert out.abs().max() > 1


@pytest.mark.parametrize(
    "removed",
    ["conv state", "delta state", "l2 norm", "value head order"],
)
def test_each_feature_moves_the_logits(removed, monkeypatch):
    """Without each feature (the state a cache carries between forwards, the L2 norm of
    queries and keys, the value heads' grouping) the cached
    logits move from transformers' by far more than the tolerance."""
    hf = hf_model()
    expected = reference(hf)
    model = ours(hf)
    if removed in ("conv state", "delta state"):
        part = 0 if removed == "conv state" else 1
        read = RecurrentState.read

        def forgetful(self, layer):
            parts = read(self, layer)
            parts[part] = torch.zeros_like(parts[part])
            return parts

        monkeypatch.setattr(RecurrentState, "read", forgetful)
    elif removed == "l2 norm":
        monkeypatch.setattr(qwen3_5, "_l2_normalize", lambda x: x)
    else:
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.tiled = True
    assert max_diff(cached_logits(model, IDS, (7, 9)), expected) > 0.05


def test_padded_rows_of_a_batch_keep_their_own_state():
    """Rows of 12, 7 and 10 tokens prefilled together, padded on the right as the server
    pads them (a padded token repeats its row's last position), then decoded together:
    each row's logits are transformers' for it alone."""
    hf = hf_model("moe")
    check_padded_rows_decoded_together(ours(hf), lambda ids: reference(hf, ids), IDS)


def test_serves_from_paged_blocks(family):
    """serve's paged KV blocks (shuffled) with the scheduler's recurrent state rows: a
    sequence prefilled in chunks that end inside blocks, then decoded."""
    _, hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The attention layers' keys and values rounded to the type; the recurrent state
    stays float32."""
    _, hf, expected = family
    model = ours(hf)
    assert model.new_cache(1, 8, cache_type, "cpu").recurrent.dtype == torch.float32
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_decode_step(family):
    """CUDA graphs' static step keeps no recurrent state: it is not offered."""
    check_no_static_decode(ours(family[1]))


# ---- Hugging Face folders ------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """A text-only folder as transformers 5 saves it (the MoE's experts fused)."""
    _, hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_multimodal_folder_runs_its_language_model(tmp_path):
    """Qwen3_5ForConditionalGeneration: the language model under model.language_model,
    the vision tower (and the multi-token-prediction weights the Hub's files carry)
    left out, with a note."""
    from safetensors.torch import load_file, save_file

    text = hf_model()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen3_5Config(
        text_config={k: v for k, v in DENSE.items() if k != "model_type"},
        vision_config=vision,
    )
    multimodal = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    state = {
        k.replace("model.", "model.language_model.", 1): v for k, v in text.state_dict().items()
    }
    missing, unexpected = multimodal.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    multimodal.save_pretrained(tmp_path / "mm")
    files = list((tmp_path / "mm").glob("*.safetensors"))
    tensors = load_file(files[0])
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, files[0], metadata={"format": "pt"})
    loaded = load_model(tmp_path / "mm", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "qwen3_5"
    assert any("language model only" in note for note in loaded.checkpoint.notes)
    assert max_diff(cached_logits(loaded.model, IDS), reference(text)) < 1e-4


# ---- llama.cpp's GGUFs ---------------------------------------------------------------


def _to_tiled(x: np.ndarray, axis: int, k_heads: int, head: int) -> np.ndarray:
    """The converter's _reorder_v_heads: value heads along `axis` from grouped by key
    head [k, v/k, head] to tiled [v/k, k, head]."""
    shape = list(x.shape)
    grouped = x.reshape(*shape[:axis], k_heads, -1, head, *shape[axis + 1 :])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def converted_tensors(hf, mtp: bool = False, state=None) -> dict[str, np.ndarray]:
    """The model's tensors (`state`, default its state dict) under GGUF names, as llama.cpp's
    converter transforms them; with `mtp`, a multi-token-prediction layer after the
    trunk, as Hub files have one. Qwen3-Next's value heads are not reordered."""
    c = hf.config
    k_heads, v_heads = c.linear_num_key_heads, c.linear_num_value_heads
    kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
    reorder = k_heads != v_heads and c.model_type != "qwen3_next"
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "linear_attn.in_proj_qkv": "attn_qkv",
        "linear_attn.in_proj_z": "attn_gate",
        "linear_attn.in_proj_b": "ssm_beta",
        "linear_attn.in_proj_a": "ssm_alpha",
        "linear_attn.in_proj_ba": "ssm_ba",
        "linear_attn.in_proj_qkvz": "ssm_in",
        "linear_attn.conv1d": "ssm_conv1d",
        "linear_attn.norm": "ssm_norm",
        "linear_attn.out_proj": "ssm_out",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
    }
    out = {}
    for key, tensor in (hf.state_dict() if state is None else state).items():
        x = tensor.float().numpy().copy()
        if key.endswith("norm.weight") and ".linear_attn.norm" not in key:
            x = x + 1
        if key == "model.embed_tokens.weight":
            out["token_embd.weight"] = x
            continue
        if key == "model.norm.weight":
            out["output_norm.weight"] = x
            continue
        if key == "lm_head.weight":
            out["output.weight"] = x
            continue
        _, _, layer, rest = key.split(".", 3)
        blk = f"blk.{layer}"
        if rest.endswith("A_log"):
            x = -np.exp(x)
        if reorder and ".linear_attn." in key:
            if "in_proj_qkv" in rest:
                x[2 * k_heads * kd :] = _to_tiled(x[2 * k_heads * kd :], 0, k_heads, vd)
            elif "conv1d" in rest:
                x[2 * k_heads * kd :] = _to_tiled(x[2 * k_heads * kd :], 0, k_heads, vd)
            elif "in_proj_z" in rest:
                x = _to_tiled(x, 0, k_heads, vd)
            elif any(p in rest for p in ("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
                x = _to_tiled(x, 0, k_heads, 1)
            elif "out_proj" in rest:
                x = _to_tiled(x, 1, k_heads, vd)
        if rest.endswith("A_log"):
            out[f"{blk}.ssm_a"] = x
        elif rest.endswith("dt_bias"):
            out[f"{blk}.ssm_dt.bias"] = x
        elif rest == "mlp.experts.gate_up_proj":
            width = x.shape[1] // 2
            out[f"{blk}.ffn_gate_exps.weight"] = np.ascontiguousarray(x[:, :width])
            out[f"{blk}.ffn_up_exps.weight"] = np.ascontiguousarray(x[:, width:])
        elif rest == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = x
        else:
            module = rest.removesuffix(".weight")
            if module == "linear_attn.conv1d":
                x = x.squeeze(1)
            out[f"{blk}.{names[module]}.weight"] = x
    if mtp:
        # A copy of the last (full-attention) layer, with the MTP block's own tensors.
        last = c.num_hidden_layers - 1
        for name, x in list(out.items()):
            if name.startswith(f"blk.{last}."):
                out[name.replace(f"blk.{last}.", f"blk.{last + 1}.")] = x * 0.5
        out[f"blk.{last + 1}.nextn.eh_proj.weight"] = np.zeros((64, 128), np.float32)
        out[f"blk.{last + 1}.nextn.enorm.weight"] = np.ones(64, np.float32)
        out[f"blk.{last + 1}.nextn.hnorm.weight"] = np.ones(64, np.float32)
    return out


# Tensors the converter keeps in F32 whatever the file type (conversion/base.py).
F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _quantized(name: str, x: np.ndarray) -> bool:
    return x.ndim >= 2 and not name.endswith(F32_ALWAYS) and not name.endswith("norm.weight")


def write_qwen35_gguf(
    path,
    hf,
    qtype=None,
    round_trip=None,
    mtp=False,
    layer_flags=True,
    state=None,
    fuse_experts=False,
    **override,
) -> str:
    """The model as llama.cpp's converter writes Qwen3.5(-MoE): TextModel's keys, the
    ssm.* keys, attention.recurrent_layers (else only full_attention_interval, with
    layer_flags=False), the rope dimension count and sections, the tensors converted
    (converted_tensors), 2-D and expert weights in `qtype`, or F32 rounded through
    `round_trip`; `state`: the tensors to convert (default the model's); `fuse_experts`:
    gate and up experts fused, as `--fuse-gate-up-exps` writes them. `override`:
    metadata keys (without the arch) to write instead. Qwen3-Next's arch is qwen3next."""
    c = hf.config
    moe = c.model_type in ("qwen3_5_moe_text", "qwen3_next")
    arch = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}.get(
        c.model_type, "qwen3next"
    )
    writer = gguf.GGUFWriter(str(path), arch)
    blocks = c.num_hidden_layers + (1 if mtp else 0)
    meta = {
        "block_count": blocks,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "rope.freq_base": c.rope_parameters["rope_theta"],
        "rope.dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
        "ssm.conv_kernel": c.linear_conv_kernel_dim,
        "ssm.state_size": c.linear_key_head_dim,
        "ssm.group_count": c.linear_num_key_heads,
        "ssm.time_step_rank": c.linear_num_value_heads,
        "ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
        "full_attention_interval": 4,
    }
    if c.model_type != "qwen3_5_moe_text":  # Qwen3.5-MoE's config has no dense width
        meta["feed_forward_length"] = c.intermediate_size
    if moe:
        meta.update(
            {
                "expert_count": c.num_experts,
                "expert_used_count": c.num_experts_per_tok,
                "expert_feed_forward_length": c.moe_intermediate_size,
                "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
            }
        )
    if mtp:
        meta["nextn_predict_layers"] = 1
    meta.update(override)
    for name, value in meta.items():
        key = f"{arch}.{name}"
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    if layer_flags:
        flags = [t == "linear_attention" for t in c.layer_types] + [False] * (
            blocks - len(c.layer_types)
        )
        writer.add_array(RECURRENT_LAYERS.format(arch=arch), flags)
    writer.add_array(f"{arch}.rope.dimension_sections", [2, 1, 1, 0])
    meta_stories = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta_stories["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta_stories["tokenizer.ggml.scores"])
    writer.add_token_types(meta_stories["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    tensors = converted_tensors(hf, mtp, state)
    for name, x in (fuse_gate_up_experts(tensors) if fuse_experts else tensors).items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        kind = qtype or round_trip
        if kind is not None and _quantized(name, x):
            raw = gguf.quants.quantize(x, kind)
            if qtype is not None:
                writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
                continue
            x = gguf.quants.dequantize(raw, kind).reshape(x.shape)
        writer.add_tensor(name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_matches_transformers(family, tmp_path):
    kind, hf, expected = family
    loaded = load_model(write_qwen35_gguf(tmp_path / "m.gguf", hf, mtp=True), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == {"dense": "qwen3_5", "moe": "qwen3_5_moe"}[kind]
    assert config["num_hidden_layers"] == 4 and config["tiled_value_heads"]
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_turns_image_tokens_by_its_interleaved_sections(family, tmp_path):
    """A GGUF keeps its rope.dimension_sections for prompts with images: 12 embeddings in
    place of tokens 10..21 (a 3x4 grid of an image's tokens, as Qwen3.5's vision tower
    gives them) at their (time, height, width) positions turn as transformers' language
    model turns them given the same inputs_embeds and position_ids [3, 1, T] (its sections,
    [11, 11, 10] by default, assign these 4 pairs as the file's [2, 1, 1] do)."""
    from llmrun.models.mrope import MRopeImages
    from llmrun.qwen2_vl_images import rope_index

    _, hf, _ = family
    loaded = load_model(write_qwen35_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["rope_parameters"]["mrope_section"] == [2, 1, 1]
    start, (rows, columns) = 10, (3, 4)
    rope = rope_index(SEQ, [start], [(rows, columns)])
    embeds = torch.randn(rows * columns, 64, generator=torch.Generator().manual_seed(3))
    groups = torch.full((SEQ,), -1)
    groups[start : start + rows * columns] = 0
    images = MRopeImages(embeds, groups, rope, int(rope.max()) + 1 - SEQ)
    with torch.no_grad():
        x = hf.model.embed_tokens(IDS)
        x[0, groups >= 0] = embeds
        expected = hf(inputs_embeds=x, position_ids=rope[:, None]).logits
        ours = loaded.model(IDS, torch.arange(SEQ)[None], images=images)
    assert (expected - hf(IDS).logits).abs().max() > 1e-1  # the image moves the logits
    assert max_diff(ours, expected) < 1e-4


def test_decoding_takes_the_native_deltanet_step(family, tmp_path, monkeypatch):
    """One token at a time, each Gated DeltaNet layer is one native call (where the
    kernels are built), and the logits still match transformers'."""
    if not native.available():
        pytest.skip(f"no native kernels here: {native.status()}")
    kind, hf, expected = family
    calls = []
    step = ops.gated_delta_step
    monkeypatch.setattr(ops, "gated_delta_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    loaded = load_model(write_qwen35_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS, (3,)), expected) < 1e-4
    assert len(calls) == (SEQ - 3) * hf.config.layer_types.count("linear_attention")


def test_a_gguf_without_layer_flags_takes_the_interval(tmp_path):
    hf = hf_model()
    path = write_qwen35_gguf(tmp_path / "m.gguf", hf, layer_flags=False)
    loaded = load_model(path, CPU, "f32")
    assert loaded.checkpoint.config["layer_types"] == hf.config.layer_types
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_holds_its_dequantized_weights(family, tmp_path):
    kind, hf, expected = family
    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = load_model(write_qwen35_gguf(tmp_path / "q.gguf", hf, qtype=q8), CPU, "f32")
    exact = load_model(write_qwen35_gguf(tmp_path / "r.gguf", hf, round_trip=q8), CPU, "f32")
    got = cached_logits(quantized.model, IDS)
    assert max_diff(got, cached_logits(exact.model, IDS)) < 1e-4
    if kind == "dense":  # the MoE's rounded weights choose other experts here and there
        assert max_diff(got, expected) < 1.0  # Q8_0 rounding, through 4 layers


@pytest.mark.parametrize("rotated", [0.5, 1.0])
def test_the_rotated_share_of_each_head_is_the_files(rotated, tmp_path):
    """rope.dimension_count says how much of each head turns, the whole head where it is
    the head size (the config's default, a quarter, is transformers')."""
    rope = dict(DENSE["rope_parameters"], partial_rotary_factor=rotated)
    hf = hf_model(rope_parameters=rope)
    loaded = load_model(write_qwen35_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == rotated
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_equal_key_and_value_heads_are_not_reordered(tmp_path):
    hf = hf_model(linear_num_value_heads=2)
    loaded = load_model(write_qwen35_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"ssm.inner_size": 48}, ModelFormatError, "ssm.inner_size 48"),
        ({"attention.scale": 0.5}, UnsupportedError, "attention scale of 0.5"),
        ({"full_attention_interval": 0}, ModelFormatError, "full_attention_interval is 0"),
    ],
)
def test_files_llmrun_cannot_run_are_refused(tmp_path, override, error, message):
    path = write_qwen35_gguf(tmp_path / "m.gguf", hf_model(), layer_flags=False, **override)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_llmrun_run_and_show(tmp_path):
    hf = hf_model("moe")
    path = write_qwen35_gguf(tmp_path / "q35.gguf", hf)
    check_run_and_show(hf, path, "qwen35moe")
    info = inspect.describe(path)
    # Keys and values of the one full-attention layer: 2 heads of 32, f32.
    assert info["kv_cache_bytes_8k"] == 8192 * 2 * 2 * 32 * 4
    assert 0 < info["active_parameters"] < info["parameters"]


def test_serve_gives_concurrent_requests_transformers_greedy_text(tmp_path):
    """serve's scheduler: three prompts of different lengths decoded together, each
    given the text transformers' greedy search gives it alone."""
    hf = hf_model()
    path = write_qwen35_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The cat", "One day, a little girl named Lily went"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)

"""Inkling 2 (llmrun/models/inkling2.py) against transformers' Inkling2ForCausalLM and
Inkling2ForConditionalGeneration, on one tiny random model (hidden 64, 4 layers: sliding
and full in turn, each kind with its own head counts and widths; blocks of 2 layers, so
that both kinds start a block and both continue one; a window of 8 and a relative extent
of 16 inside a 40-token prompt; log scaling from position 8; clip thresholds low enough
to clip; a selection bias on the router) saved with save_pretrained, which writes the Hub's
keys (model.llm.*, gate and up rows interleaved, the unembedding padded to vocab_size).

Tolerances: f32 logits (within about ±6, soft-capped at 10) 1e-4 max abs against
transformers, whole, through the KV cache and its convolution states (prefills in
chunks, then one token at a time) and through serve's paged cache. `llmrun run` picks
transformers' 8 greedy token ids. Each feature, left out, moves the logits by more than
1e-2, so the comparison sees it.
"""

import json

import pytest
import torch
from family_checks import check_run_token_ids, hf_model_of, max_diff
from helpers import BASE, cached_logits, our_model, save_hf_dir
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)
from in_process import llmrun

from llmrun import api
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import inkling2, kv_cache_bytes

pytest.importorskip("transformers.models.inkling2")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="inkling2_text",
    vocab_size=520,  # padded: the unembedding is stored with 520 rows, 512 used
    unpadded_vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    swa_num_attention_heads=2,
    swa_num_key_value_heads=1,
    swa_head_dim=32,
    sliding_window_size=8,
    d_rel=8,
    rel_extent=16,
    log_scaling_n_floor=8,
    log_scaling_alpha=0.5,
    n_layers_per_attn_res_block=2,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    route_scale=2.0,
    qk_l2_clip_threshold=1.5,
    rel_l2_clip_threshold=1.0,
    mlp_gate_softcap=2.0,
    mlp_up_softcap=3.0,
    final_logit_softcapping=10.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))


def randomized(model):
    """`model` with selection biases of the size of the router's scores (hf_model_of
    draws the parameters; the biases are buffers, left zero)."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def hf():
    return randomized(hf_model_of(CONFIG))


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


@pytest.fixture(scope="module")
def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hf_dir(hf, tmp_path_factory.mktemp("inkling2") / "Inkling-2", tokenizer=True)


def test_matches_transformers_whole_cached_paged_and_padded(hf, ours, expected):
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(ours(IDS, torch.arange(IDS.shape[1])[None]), expected) < 1e-4
    assert max_diff(cached_logits(ours, IDS), expected) < 1e-4
    check_paged_with_a_state_row(ours, IDS, expected)
    check_padded_rows_decoded_together(ours, lambda ids: hf(ids).logits, IDS)
    check_padded_rows_in_scattered_slots(ours, lambda ids: hf(ids).logits, IDS)
    check_no_static_decode(ours)


# Each feature of the config, left out of llmrun's model (its layers).
PLANTED = {
    "log scaling": lambda layers: setattr(layers[1].self_attn.q_proj.norm, "log", None),
    "attention sinks": lambda layers: layers[0].self_attn.sink_proj.weight.data.fill_(-30),
    "selection bias": lambda layers: layers[2].mlp.gate.e_score_correction_bias.zero_(),
    "dynamic taps": lambda layers: layers[3].self_attn.k_proj.sconv.weight_proj.weight.data.zero_(),
    "relative bias": lambda layers: layers[2].self_attn.relative_position_bias.proj.data.zero_(),
    "block boundary": lambda layers: setattr(layers[2], "is_block_boundary", False),
}


@pytest.mark.parametrize("feature", PLANTED)
def test_each_feature_left_out_moves_the_logits(hf, expected, feature):
    broken = our_model(hf.config.to_dict(), hf.state_dict())
    PLANTED[feature](broken.model.layers)
    with torch.no_grad():
        assert max_diff(broken(IDS, torch.arange(IDS.shape[1])[None]), expected) > 1e-2


def test_the_saved_folder_runs_and_shows(hf, expected, folder):
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Inkling2ForCausalLM"]
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "inkling2_text"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    check_run_token_ids(hf, folder, tokens=8, text=False)  # ids: the first space aside
    shown = llmrun("show", str(folder))
    assert shown.returncode == 0, shown.stderr
    assert "inkling2_text" in shown.stdout
    # Per token and layer 64 keys and values (sliding: 1 head of 32; full: 2 of 16), f32.
    assert kv_cache_bytes(saved, 8192) == inspect.kv_cache_bytes(saved, 8192) == 8192 * 4 * 64 * 4


def test_served_requests_equal_transformers_greedy_text(hf, folder):
    """serve's scheduler with two state rows and more requests than rows, of different
    lengths: each request's greedy text is transformers' for its prompt alone."""
    engine = api.load(str(folder), device="cpu", dtype="f32", ctx_size=128)
    prompts = ["Once upon a time", "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, folder, prompts, parallel=2)


def test_bf16_logits_are_transformers_bf16_logits(folder):
    """In bf16, transformers keeps routers, convolution taps and block queries in f32 and
    rounds where its modules do: llmrun's bf16 logits are its own, bit for bit."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference.eval()(IDS).logits
    loaded = load_model(folder, CPU, "bf16")
    assert torch.equal(cached_logits(loaded.model, IDS), expected.float())


def mxfp8(weight):
    """weight [..., cols] in MXFP8's blocks of 32: FP8 E4M3 values and a ue8m0 scale byte
    (2^(byte - 127)) per block, the largest value within E4M3's 448."""
    blocks = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448))
    values = (blocks / torch.exp2(exponent)).to(torch.float8_e4m3fn).flatten(-2)
    return values, (exponent.squeeze(-1) + 127).to(torch.uint8)


def quantize_as_the_hub(path) -> dict:
    """The folder at `path` in the Hub's MXFP8 layout, in place: every attention matrix
    and expert stack FP8 with a ue8m0 scale byte per 32 weights (<name>_scale_inv, the
    experts' <name>_scale), quantization_config quant_method fp8 at the top of
    config.json. Returns the tensors written."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, w in load_file(path / "model.safetensors").items():
        if name.endswith(("w13_weight", "w2_weight")) or (".attn.w" in name and w.dim() == 2):
            tensors[name], scales = mxfp8(w)
            tensors[name + ("_scale" if ".experts." in name else "_scale_inv")] = scales
        else:
            tensors[name] = w
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="fp8", scale_fmt="ue8m0", weight_block_size=[1, 32]
    )
    (path / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture(scope="module")
def mxfp8_folder(folder, tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("inkling2-mxfp8")
    shutil.copytree(folder, path, dirs_exist_ok=True)
    return path, quantize_as_the_hub(path)


@pytest.fixture(scope="module")
def mxfp8_expected(mxfp8_folder, expected):
    """transformers' logits of the MXFP8 folder on CPU, where it dequantizes the matrices
    at load (w * 2^(byte - 127)). transformers 5.25 leaves the experts' FP8 values unscaled
    there, so they are dequantized by its own GPU path's function (_dequantize_fp8_weight)
    and de-interleaved as its loader does."""
    import transformers
    from transformers.core_model_loading import Interleave
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    path, tensors = mxfp8_folder
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i, layer in enumerate(reference.model.layers):
        stacks = {}
        for stack in ("w13_weight", "w2_weight"):
            name = f"model.llm.layers.{i}.mlp.experts.{stack}"
            scales = tensors[f"{name}_scale"].view(torch.float8_e8m0fnu)
            stacks[stack] = _dequantize_fp8_weight(tensors[name], scales, [1, 32], torch.float32)
        gate_up = Interleave(dim=1).convert({"w": stacks["w13_weight"]}, None, ["w"])["w"]
        layer.mlp.experts.gate_up_proj.data.copy_(gate_up)
        layer.mlp.experts.down_proj.data.copy_(stacks["w2_weight"])
    with torch.no_grad():
        logits = reference.eval()(IDS).logits
    assert max_diff(logits, expected) > 1e-3  # the FP8 rounding shows
    return logits


def test_an_mxfp8_folder_runs_as_transformers_dequantizes_it(mxfp8_folder, mxfp8_expected):
    loaded = load_model(mxfp8_folder[0], CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), mxfp8_expected) < 1e-4


def test_a_conditional_generation_folder_runs_its_language_model(hf, mxfp8_expected, tmp_path):
    """Inkling2ForConditionalGeneration's folder (a vision tower beside the same text
    weights, model_type inkling2): its text within 1e-4 of transformers' logits without
    images, and so in the Hub's MXFP8 layout (the quantization_config at the top)."""
    import transformers

    text = {k: v for k, v in CONFIG.items() if k != "model_type"}
    vision = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
        projection_hidden_dim=32, text_hidden_size=64, posemb_grid_size=4,
        rope_parameters=dict(rope_type="axial", rope_theta=100.0),
    )  # fmt: skip
    config = transformers.Inkling2Config(text_config=text, vision_config=vision)
    model = transformers.Inkling2ForConditionalGeneration(config).eval()
    source = hf.state_dict()
    text_weights = {
        f"model.language_model.{k.removeprefix('model.')}": v
        for k, v in source.items()
        if k.startswith("model.")
    }
    assert model.state_dict().keys() >= text_weights.keys()
    model.load_state_dict(text_weights | {"lm_head.weight": source["lm_head.weight"]}, strict=False)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, CPU, "f32")
    assert any("multimodal Inkling 2" in note for note in loaded.checkpoint.notes)
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    quantize_as_the_hub(tmp_path)
    loaded = load_model(tmp_path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), mxfp8_expected) < 1e-4


def test_fp8_weights_of_another_family_are_refused_in_one_line(tmp_path):
    """FP8 values are not the weights without their scales: only Inkling 2's loader reads
    them; another family's folder is refused (error line, exit 1)."""
    from helpers import tiny_hf_model
    from safetensors.torch import load_file, save_file

    model, _ = tiny_hf_model("llama")
    save_hf_dir(model, tmp_path, tokenizer=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = llmrun("run", str(tmp_path), "Once", "-n", "2")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "dtype F8_E4M3" in result.stderr
    assert result.stderr.count("\n") == 1


def test_inkling_2_small_shapes_match_its_config():
    """Inkling2TextConfig's defaults (Inkling-2-Small), which llmrun takes where config.json
    leaves them out: 40 sliding layers of 8 x 128 and 8 full ones of 8 x 128, so 48 x 2 x
    8 x 128 values a token; four convolution states a layer of three inputs each."""
    from transformers import Inkling2TextConfig

    config = Inkling2TextConfig().to_dict()
    assert inspect.kv_cache_bytes(config, 1000, 2) == kv_cache_bytes(config, 1000, 2)
    assert kv_cache_bytes(config, 1000, 2) == 1000 * 48 * 2 * 8 * 128 * 2
    args = inkling2.ModelArgs.from_config(config)
    # config.json leaves out what equals the defaults: llmrun's are transformers'.
    assert inkling2.ModelArgs.from_config({"model_type": "inkling2_text"}) == args
    assert args.layer_types.count("hybrid") == 8
    assert args.recurrent_shapes()[5] == [(1024, 3), (1024, 3), (4608, 3), (4608, 3)]

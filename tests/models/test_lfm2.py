"""LFM2 and LFM2-MoE against transformers' Lfm2ForCausalLM and Lfm2MoeForCausalLM, from a
config.json and from "lfm2" / "lfm2moe" GGUFs written as llama.cpp's converter writes
them (conversion/lfm2.py: head_count_kv per layer, 0 for a convolution layer; the
auto-adjusted feed_forward_length; the convolution kernels squeezed to [hidden, L]; the
experts stacked; expert_bias as exp_probs_b.bias; tensor names by gguf's TensorNameMap,
the converter's own).

Their features each move the logits by far more than the tolerance, and llmrun follows
each: the convolution state carried from one forward to the next (zeroing it mid-way
moves the logits), the per-head q/k norms, the layer pattern (layer_types or
full_attn_idxs), LFM2's feed-forward width adjustment, and LFM2-MoE's routing (the
sigmoid's top-k chosen by score + expert_bias, renormalized) after its dense layers.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers: whole, or
through the KV cache and the convolution state (prefills in chunks, then one token at a
time), contiguous or paged, rows of a batch padded on the right. A Q8_0 GGUF: 1e-4
against transformers run on the weights gguf dequantizes. An f16/bf16/q8_0 KV cache:
1e-5 against an f32 cache holding the rounded values, and DRIFT from f32.
"""

import gguf
import numpy as np
import pytest
import torch
from family_checks import (
    check_run_and_show,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    max_diff,
)
from helpers import STORIES_GGUF, cached_logits, our_model, randomize
from hybrid_checks import check_paged_with_a_state_row

from llmrun import api, static_decode
from llmrun.batching import Request, Scheduler
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models.paged import PagedKVCache
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
COMMON = dict(
    hidden_size=128,  # 4 heads of 32 (2 KV heads): a q8_0 cache's blocks fit a head
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # stories260K's tokenizer
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    # The feed-forward is int(1.5 * int(2 * 144 / 3)) = 144 rounded up to 32: 160 wide.
    "lfm2": dict(
        COMMON,
        model_type="lfm2",
        intermediate_size=144,
        num_hidden_layers=5,
        layer_types=["conv", "conv", "full_attention", "conv", "full_attention"],
        block_ffn_dim_multiplier=1.5,
        block_multiple_of=32,
    ),
    "lfm2_moe": dict(
        COMMON,
        model_type="lfm2_moe",
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
}
ARCHS = {"lfm2": "lfm2", "lfm2_moe": "lfm2moe"}
SEQ = 40
IDS = torch.randint(3, COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 about 1e-3, bf16 and q8_0 1e-2;
# but q8_0's rounding flips one of LFM2-MoE's expert choices, a jump of 2.3.
DRIFT = {"f16": 1e-2, "bf16": 1e-1, "q8_0": 1e-1}
MOE_Q8_0_DRIFT = 5.0


def hf_model(name: str, **overrides):
    """transformers' model of CONFIGS[name] with randomize()'s weights and, for the
    MoE, an expert bias of N(0, 0.3) (zeros would leave it untested)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIGS[name], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        for key, buffer in model.named_buffers():
            if key.endswith("expert_bias"):
                buffer.normal_(0, 0.3)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hub_state(hf) -> dict[str, torch.Tensor]:
    """The model's weights under the Hub's keys: transformers 5 fuses each layer's
    experts (gate_up_proj [E, 2I, D], gate rows first; down_proj [E, D, I]), the Hub
    checkpoint keeps experts.N.w1 (gate), w3 (up) and w2 (down)."""
    state = {}
    for key, value in hf.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "gate_up_proj":
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                state[f"{prefix}.{e}.w1.weight"] = value[e, :width]
                state[f"{prefix}.{e}.w3.weight"] = value[e, width:]
        elif leaf == "down_proj" and prefix.endswith("experts"):
            for e in range(value.shape[0]):
                state[f"{prefix}.{e}.w2.weight"] = value[e]
        else:
            state[key] = value
    return state


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), hub_state(hf))


def write_lfm2_gguf(path, hf, qtype=None, **metadata):
    """The model as llama.cpp's converter writes it (see the module docstring), 2-D and
    3-D weights in `qtype` (default F32) but the convolution kernels, whose rows of
    conv_L_cache values are no whole block. `metadata`: GGUFWriter add_* calls to add or
    replace (None: leave the key out), for the refusals."""
    config = hf.config
    moe = config.model_type == "lfm2_moe"
    arch = ARCHS[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    width = config.intermediate_size
    if not moe:
        width = int(config.block_ffn_dim_multiplier * int(2 * width / 3))
        width = -(-width // config.block_multiple_of) * config.block_multiple_of
    keys = dict(
        block_count=config.num_hidden_layers,
        context_length=config.max_position_embeddings,
        embedding_length=config.hidden_size,
        feed_forward_length=width,
        head_count=config.num_attention_heads,
        head_count_kv=[
            config.num_key_value_heads if kind == "full_attention" else 0
            for kind in config.layer_types
        ],
        rope_freq_base=config.rope_parameters["rope_theta"],
        layer_norm_rms_eps=config.norm_eps,
        vocab_size=config.vocab_size,
        shortconv_l_cache=config.conv_L_cache,
    )
    if moe:
        keys.update(
            expert_count=config.num_experts,
            expert_used_count=config.num_experts_per_tok,
            expert_feed_forward_length=config.moe_intermediate_size,
            leading_dense_block_count=config.num_dense_layers,
            expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID,
        )
    keys.update(metadata)
    for name, value in keys.items():
        if value is not None:
            getattr(writer, f"add_{name}")(value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, config.num_hidden_layers)
    for name, tensor in converted_tensors(hf):
        data = tensor.float().numpy()
        gguf_name = "output.weight" if name == "lm_head.weight" else None
        gguf_name = gguf_name or names.get_name(name, try_suffixes=(".weight", ".bias"))
        if moe and gguf_name is None:  # the stacked experts, LFM2-MoE's own names
            moe_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE, config.num_hidden_layers)
            gguf_name = moe_names.get_name(name, try_suffixes=(".weight", ".bias"))
        if data.ndim >= 2 and qtype is not None and "conv.conv" not in name:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def converted_tensors(hf):
    """(HF name, tensor) as the converter hands them to its name map: the kernels
    squeezed, each layer's experts stacked under layers.N.feed_forward.experts.wK,
    expert_bias renamed expert_bias.bias; no lm_head where the embedding is tied."""
    state = hub_state(hf)
    stacks: dict[str, list] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        if "conv.conv" in name:
            yield name, tensor.squeeze(1)
        elif ".experts." in name:
            layer, expert, proj = name.split(".")[2], name.split(".")[5], name.split(".")[6]
            stacks.setdefault(f"layers.{layer}.feed_forward.experts.{proj}.weight", []).append(
                (int(expert), tensor)
            )
        elif name.endswith(".expert_bias"):
            yield name + ".bias", tensor
        else:
            yield name, tensor
    for name, experts in stacks.items():
        yield name, torch.stack([t for _, t in sorted(experts, key=lambda e: e[0])])


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request):
    hf = hf_model(request.param)
    return hf, reference(hf)


def test_config_json_matches_transformers_whole_chunked_and_decoded(family):
    """Whole; prefills of 7, 3, 5, 1, 9, 2, 6 tokens through the cache, then one token
    at a time: each convolution layer goes on from the state the last forward left."""
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 3
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(SEQ,)), expected) < 1e-4


def test_the_convolution_state_carries_the_sequence(family):
    """Zeroing the state after a prefill (as if each forward started afresh) moves the
    next logits by far more than the tolerance: the state is what carries them."""
    hf, expected = family
    model = ours(hf)
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    with torch.no_grad():
        model(IDS[:, :20], torch.arange(20)[None], cache)
        for parts in cache.recurrent.tensors.values():
            for t in parts:
                t.zero_()
        moved = model(IDS[:, 20:21], torch.tensor([[20]]), cache)
    assert max_diff(moved[0, 0], expected[0, 20]) > 0.1


def test_each_feature_moves_the_logits():
    """The layer pattern (both forms), the convolution blocks' biases (conv_bias), the
    q/k norms, and the MoE's expert bias, renormalization, scaling and dense layers:
    each variant changes the logits by far more than the tolerance, and llmrun follows
    each."""
    base = reference(hf_model("lfm2"))
    for variant in (
        dict(layer_types=None, full_attn_idxs=[0, 3]),
        dict(layer_types=["conv", "full_attention", "conv", "conv", "conv"]),
        dict(conv_bias=True),
    ):
        hf = hf_model("lfm2", **variant)
        assert max_diff(reference(hf), base) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4
    hf = hf_model("lfm2")
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                p.mul_(3.0)
    assert max_diff(reference(hf), base) > 0.1
    assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4
    moe_base = reference(hf_model("lfm2_moe"))
    unbiased = hf_model("lfm2_moe")
    with torch.no_grad():
        for key, buffer in unbiased.named_buffers():
            if key.endswith("expert_bias"):
                buffer.zero_()
    for hf in (
        unbiased,
        hf_model("lfm2_moe", norm_topk_prob=False),
        hf_model("lfm2_moe", num_dense_layers=0),
        hf_model("lfm2_moe", use_expert_bias=False, routed_scaling_factor=2.0),
    ):
        assert max_diff(reference(hf), moe_base) > 0.1
        assert max_diff(cached_logits(ours(hf), IDS), reference(hf)) < 1e-4


def test_rows_padded_on_the_right_give_each_row_its_logits():
    """Through serve's paged blocks with a recurrent row per sequence, in scattered
    slots (the scheduler's padded prefill: padding repeats the row's last token and
    position, and is never stored): each row's last real token gets transformers'
    logits of that row alone, and the decode step after it goes on from the row's own
    convolution state."""
    hf = hf_model("lfm2")
    model = ours(hf)
    lengths = [12, 5, 9]
    rows = [IDS[0, : n + 1] for n in lengths]  # the prompt, and a token to decode
    expected = [reference(hf, row[None])[0] for row in rows]
    width = max(lengths)
    ids = torch.stack(
        [torch.cat((r[:n], r[n - 1].repeat(width - n))) for r, n in zip(rows, lengths, strict=True)]
    )
    positions = torch.tensor([[min(i, n - 1) for i in range(width)] for n in lengths])
    with torch.no_grad():
        like = model.new_cache(1, 1, "f32", "cpu")
        pool = PagedKVCache(like, 16, 16, 256)
        states = like.recurrent.empty_like(4)
        tables, slots = [[3], [7], [1]], [2, 0, 3]
        view = pool.view(tables, lengths)
        view.recurrent = states.select(slots)
        last = torch.tensor([n - 1 for n in lengths])
        prefill = model(ids, positions, view, last=last)
        view = pool.view(tables)
        view.recurrent = states.select(slots)
        step = model(
            torch.stack([r[n:] for r, n in zip(rows, lengths, strict=True)]),
            torch.tensor([[n] for n in lengths]),
            view,
        )
    for row, n in enumerate(lengths):
        assert max_diff(prefill[row, 0], expected[row][n - 1]) < 1e-4
        assert max_diff(step[row, 0], expected[row][n]) < 1e-4


def test_one_sequence_on_paged_blocks_gives_the_contiguous_logits(family):
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected, rows=2, row=1)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py (the convolution state stays f32 whatever the type)."""
    hf, expected = family
    model = ours(hf)
    assert model.new_cache(1, 8, cache_type, "cpu").recurrent.dtype == torch.float32
    drift = DRIFT[cache_type]
    if hf.config.model_type == "lfm2_moe" and cache_type == "q8_0":
        drift = MOE_Q8_0_DRIFT
    check_typed_cache(model, IDS, expected, cache_type, drift)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_lfm2_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == hf.config.model_type
    assert config["layer_types"] == hf.config.layer_types
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    # Neither the native decode step nor CUDA graphs' static step takes the family.
    assert loaded.model.decode_step is None
    cache = loaded.model.new_cache(1, 32, torch.float32, "cpu")
    assert not static_decode.supported(loaded.model, cache)


def test_an_untied_gguf_reads_its_output_matrix(tmp_path):
    hf = hf_model("lfm2", tie_word_embeddings=False)
    loaded = load_model(write_lfm2_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert not loaded.checkpoint.config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_q8_0_gguf_matches_its_dequantized_weights(name, tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(name)
    loaded = load_model(write_lfm2_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if p.dim() >= 2 and "conv.conv" not in key:
                p.copy_(
                    torch.from_numpy(
                        gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                    )
                )
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_older_config_json_names_its_fields_otherwise(tmp_path):
    """LFM2's first config.json files: block_ff_dim, full_attn_idxs and tie_embedding."""
    import json

    hf = hf_model("lfm2", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["block_ff_dim"] = config.pop("intermediate_size")
    config["full_attn_idxs"] = [2, 4]
    config["tie_embedding"] = config.pop("tie_word_embeddings")
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_serves_concurrent_requests_with_transformers_greedy_text(tmp_path):
    """serve's scheduler decodes three prompts of different lengths together (padded
    prefills, a recurrent row each); each gets transformers' greedy continuation."""
    from test_batching import Collector

    hf = hf_model("lfm2_moe")
    engine = api.load(str(write_lfm2_gguf(tmp_path / "m.gguf", hf)), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    scheduler = Scheduler(engine, parallel=3, queue=8)
    collectors = [Collector() for _ in prompts]
    tokens = 12
    for prompt, collector in zip(prompts, collectors, strict=True):
        ids = engine.tokenizer.encode(prompt)
        scheduler.submit(Request(ids, SamplingParams(temperature=0), tokens), collector)
    scheduler.start()
    try:
        for prompt, collector in zip(prompts, collectors, strict=True):
            ids = engine.tokenizer.encode(prompt)
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=2
                )
            new = [t for t in out[0, len(ids) :].tolist() if t != 2]
            expected = engine.tokenizer.decode(ids + new)[len(engine.tokenizer.decode(ids)) :]
            assert len(new) > 5
            assert collector.result()[0] == expected
    finally:
        scheduler.close()


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model("lfm2")
    path = write_lfm2_gguf(tmp_path / "lfm2.gguf", hf)
    check_run_and_show(hf, path, "lfm2")
    # Two attention layers of 2 KV heads of 32 floats cache keys and values; the
    # convolution layers none.
    check_show(path, "lfm2", 2 * 2 * 2 * 32 * 4 * 8192)


def test_a_moe_gguf_gated_otherwise_is_refused(tmp_path):
    hf = hf_model("lfm2_moe")
    softmax = gguf.ExpertGatingFuncType.SOFTMAX
    path = write_lfm2_gguf(tmp_path / "m.gguf", hf, expert_gating_func=softmax)
    with pytest.raises(UnsupportedError, match="gated by the sigmoid"):
        load_model(path, CPU, "f32")
    path = write_lfm2_gguf(tmp_path / "n.gguf", hf, expert_gating_func=None)
    with pytest.raises(ModelFormatError, match="expert_gating_func' is missing"):
        load_model(path, CPU, "f32")


@pytest.mark.parametrize(
    "metadata, message",
    [
        (dict(causal_attention=False), "embedding model"),
        (dict(sliding_window=64), "sliding-window"),
        (dict(head_count_kv=[0, 0, 2, 0, 1]), "same number of key/value heads"),
        (dict(shortconv_l_cache=None), "shortconv.l_cache' is missing"),
    ],
)
def test_what_llmrun_does_not_compute_is_refused(metadata, message, tmp_path):
    path = write_lfm2_gguf(tmp_path / "m.gguf", hf_model("lfm2"), **metadata)
    with pytest.raises((UnsupportedError, ModelFormatError), match=message):
        load_model(path, CPU, "f32")


def test_an_unknown_layer_type_is_refused():
    config = {**CONFIGS["lfm2"], "layer_types": ["conv", "mamba", "conv", "conv", "conv"]}
    with pytest.raises(UnsupportedError, match="layer type 'mamba'"):
        our_model(config, {})


@pytest.mark.parametrize(
    "config",
    [
        CONFIGS["lfm2"],
        CONFIGS["lfm2_moe"],
        {**CONFIGS["lfm2"], "layer_types": None, "full_attn_idxs": [1]},
    ],
    ids=["lfm2", "lfm2_moe", "full_attn_idxs"],
)
def test_show_counts_the_kv_cache_of_the_attention_layers_alone(config):
    """inspect's torch-free count is the cache the model allocates: its attention layers'."""
    from llmrun.loading.inspect import kv_cache_bytes
    from llmrun.models import kv_cache_bytes as allocated

    for context in (1, 12, 8192):
        assert kv_cache_bytes(config, context) == allocated(config, context)
    assert kv_cache_bytes(config, 1) < 2 * 2 * 32 * 4 * config["num_hidden_layers"]

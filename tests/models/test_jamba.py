"""Jamba against transformers' JambaForCausalLM, from a config.json (transformers 5's
stacked experts) and from "jamba" GGUFs written as llama.cpp's converter writes them
(conversion/jamba.py JambaModel: head_count_kv per layer, 0 for a Mamba layer; the
experts stacked; A_log stored as A = -exp(A_log), the convolution squeezed).

Its features each move the logits by far more than the tolerance, and llmrun follows
each: the layer pattern (attention among Mamba layers), the experts every other layer
(softmax top-2, not renormalized), the Mamba states carried between forwards, and the
norms (with weights) of dt, B and C (test_each_feature_moves_the_logits).

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers: whole, or
through the KV cache and the states (prefills in chunks, then one token at a time),
contiguous or paged, rows of a batch padded on the right. A Q8_0 GGUF: 1e-4 against
transformers run on the weights gguf dequantizes.
"""

import gguf
import pytest
import torch
from family_checks import (
    check_run_and_show,
    check_show,
    check_typed_cache,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import jamba as loading
from llmrun.loading.loader import Weight, load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
CONFIG = dict(
    model_type="jamba",
    hidden_size=128,  # 4 heads of 32: a q8_0 cache's blocks fit a head
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # stories260K's tokenizer
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,  # experts in layers 1 and 3
    attn_layer_period=3,
    attn_layer_offset=1,  # attention in layers 1 and 4
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
DRIFT = {"f16": 2e-2, "bf16": 2e-1, "q8_0": 5e-1}  # a typed cache's bound, 5x measured
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """transformers' model of CONFIG (and `overrides`), f32 and eval, with randomize()'s
    weights (the output matrix halved, so logits stay within about ±5)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, {"lm_head.weight": 0.5})
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def state_dict(hf) -> dict[str, torch.Tensor]:
    """hf's weights, its stacked experts one module each (as llmrun holds them)."""
    weights = {k: Weight(v) for k, v in hf.state_dict().items()}
    split = loading.hf_weights(weights, hf.config.to_dict(), Weight)
    return {k: w.tensor for k, w in split.items()}


def ours(hf):
    return our_model(hf.config.to_dict(), state_dict(hf))


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


def gguf_tensors(hf) -> dict:
    """hf's tensors under llama.cpp's names, as JambaModel.modify_tensors writes them."""
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.final_layernorm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {hf_key: gguf_key for gguf_key, hf_key in loading.LAYER_NAMES.items()}
    out = {}
    width = hf.config.intermediate_size
    for key, value in hf.state_dict().items():
        if key in names:
            out[names[key]] = value.numpy()
            continue
        _, _, layer, part = key.split(".", 3)
        if part == "feed_forward.experts.gate_up_proj":
            out[f"blk.{layer}.ffn_gate_exps.weight"] = value[:, :width].numpy()
            out[f"blk.{layer}.ffn_up_exps.weight"] = value[:, width:].numpy()
        elif part == "feed_forward.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = value.numpy()
        else:
            if part == "mamba.A_log":
                value = -torch.exp(value)  # the converter stores A
            if part == "mamba.conv1d.weight":
                value = value.squeeze(1)  # [inner, 1, K] -> [inner, K]
            out[f"blk.{layer}.{layer_names[part]}"] = value.numpy()
    return out


def write_jamba_gguf(path, hf, qtype=None, keys: dict | None = None):
    """A "jamba" GGUF of `hf` as llama.cpp's converter writes it, with stories260K's
    vocabulary and every key llama.cpp's loader reads; `keys` ("{arch}.…" templates ->
    value) replaces some (None leaves one out)."""
    config = hf.config
    kinds = config.layers_block_type
    written = {
        gguf.Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        gguf.Keys.LLM.CONTEXT_LENGTH: config.max_position_embeddings,
        gguf.Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: config.intermediate_size,
        gguf.Keys.Attention.HEAD_COUNT: config.num_attention_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: [
            config.num_key_value_heads if kind == "attention" else 0 for kind in kinds
        ],
        gguf.Keys.SSM.CONV_KERNEL: config.mamba_d_conv,
        gguf.Keys.SSM.INNER_SIZE: config.mamba_expand * config.hidden_size,
        gguf.Keys.SSM.STATE_SIZE: config.mamba_d_state,
        gguf.Keys.SSM.TIME_STEP_RANK: config.mamba_dt_rank,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: config.rms_norm_eps,
        gguf.Keys.LLM.EXPERT_COUNT: config.num_experts,
        gguf.Keys.LLM.EXPERT_USED_COUNT: config.num_experts_per_tok,
    }
    written.update(keys or {})
    tensors = gguf_tensors(hf)
    keep = ("ssm_conv1d", ".ssm_a")
    return write_keyed_gguf(path, "jamba", written, tensors, qtype, True, keep)


def test_whole_cached_and_chunked_forwards_match_transformers(family):
    hf, expected = family
    model = ours(hf)
    assert model.args.layer_types == ["mamba", "attention", "mamba", "mamba", "attention"]
    assert model.args.expert_layers == [1, 3]
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    for chunks in ((16, 1, 5), (SEQ,), (1,)):
        assert max_diff(cached_logits(model, IDS, chunks), expected) < 1e-4


def test_each_feature_moves_the_logits(family):
    """The Mamba states (zeroed after a prefill), the experts' weights (renormalized),
    the norms of dt, B and C (their weights set to 1) each move the logits."""
    hf, expected = family
    model = ours(hf)
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    with torch.no_grad():
        model(IDS[:, :20], torch.arange(20)[None], cache)
        for layer in cache.recurrent.tensors:
            cache.recurrent.write(layer, [torch.zeros_like(t) for t in cache.recurrent.read(layer)])
        rest = model(IDS[:, 20:], torch.arange(20, SEQ)[None], cache)
        assert max_diff(rest, expected[:, 20:]) > 1e-2
        for name, p in model.named_parameters():
            if "_layernorm" in name and ".mamba." in name:
                p.fill_(1.0)
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) > 1e-2
    renormalized = hf_model()
    from transformers.models.jamba import modeling_jamba

    original = modeling_jamba.JambaTopKRouter.forward

    def forward(self, x):
        logits, weights, index = original(self, x)
        return logits, weights / weights.sum(-1, keepdim=True), index

    modeling_jamba.JambaTopKRouter.forward = forward
    try:
        assert max_diff(reference(renormalized), expected) > 1e-2
    finally:
        modeling_jamba.JambaTopKRouter.forward = original


def test_padded_rows_of_a_batch_keep_their_own_state(family):
    hf, _ = family
    model = ours(hf)
    check_padded_rows_in_scattered_slots(model, lambda ids: reference(hf, ids), IDS)
    check_padded_rows_decoded_together(model, lambda ids: reference(hf, ids), IDS)


def test_one_sequence_on_paged_blocks_gives_the_contiguous_logits(family):
    hf, expected = family
    model = ours(hf)
    check_paged_with_a_state_row(model, IDS, expected, rows=2, row=1)
    check_no_static_decode(model)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py (the Mamba states stay f32 whatever the type); drift
    from f32 measured: f16 4e-3, bf16 3e-2, q8_0 9e-2."""
    hf, expected = family
    model = ours(hf)
    assert model.new_cache(1, 8, cache_type, "cpu").recurrent.dtype == torch.float32
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_jamba_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["layer_types"] == hf.config.layers_block_type
    assert config["expert_layers"] == [1, 3]
    assert not config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    assert loaded.model.decode_step is None
    check_no_static_decode(loaded.model)


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    hf = hf_model()
    path = write_jamba_gguf(tmp_path / "q.gguf", hf, Q8_0)
    loaded = load_model(path, CPU, "f32")
    with torch.no_grad():
        for key, p in hf.named_parameters():
            rows = p.shape[-1]
            quantized = p.dim() >= 2 and rows % 32 == 0 and "router" not in key
            if quantized and "A_log" not in key and "conv1d" not in key:
                flat = p.reshape(-1, rows).numpy()
                blocks = gguf.quants.quantize(flat, Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0)).view_as(p))
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """As save_pretrained writes it (the Hub's layout: each expert apart), and with
    transformers 5's stacks of experts (experts.gate_up_proj, experts.down_proj)."""
    from safetensors.torch import save_file

    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4
    stacked = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in stacked
    save_file(stacked, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_concurrent_requests_with_transformers_greedy_text(tmp_path):
    hf = hf_model()
    path = write_jamba_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model()
    path = write_jamba_gguf(tmp_path / "jamba.gguf", hf)
    check_run_and_show(hf, path, "jamba")
    # Two attention layers of 2 KV heads of 32 floats cache keys and values.
    check_show(path, "jamba", 2 * 2 * 2 * 32 * 4 * 8192)


def test_show_counts_the_kv_cache_of_the_attention_layers_alone():
    from llmrun.loading.inspect import kv_cache_bytes
    from llmrun.models import kv_cache_bytes as allocated

    for context in (1, 8192):
        assert kv_cache_bytes(CONFIG, context) == allocated(CONFIG, context)


@pytest.mark.parametrize(
    "keys, error, message",
    [
        ({gguf.Keys.SSM.TIME_STEP_RANK: None}, ModelFormatError, "time_step_rank' is missing"),
        ({gguf.Keys.Attention.HEAD_COUNT_KV: [0, 2, 0, 0, 1]}, UnsupportedError, "one value"),
        ({gguf.Keys.LLM.EXPERT_USED_COUNT: 0}, ModelFormatError, "expert_used_count is 0"),
    ],
)
def test_what_llmrun_does_not_read_is_refused(keys, error, message, tmp_path):
    path = write_jamba_gguf(tmp_path / "m.gguf", hf_model(), keys=keys)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")

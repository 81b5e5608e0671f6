"""Qwen4-Exp (text) against transformers' Qwen4ExpForCausalLM, from config.json folders
(text-only, multimodal, experts fused and the n-gram table in shards as transformers 5
saves them) and from "qwen4exp" GGUFs written as llama.cpp's converter writes them
(conversion/qwen4exp.py over Qwen3.5-MoE's conversion/qwen.py: norms stored as 1 + w but
the gated one, A_log as -exp(A_log), dt_bias as ssm_dt.bias, convolutions squeezed, value
heads tiled, experts stacked, index_qk_proj split, the hash's constants as metadata, the
n-gram table as per_layer_token_embd).

The tiny model has three streams, two key heads serving four value heads, an attention
layer in every four with a QSA indexer of 8 heads choosing 2 blocks of 2 tokens (so
queries past 5 tokens attend to some keys only), and PLE on layers 1 and 3 (one-indexed;
the GGUF's single layer: 1) with tri-grams hashed into 2 heads per order. The prompts
hold an EOS token (2), where the n-grams start again.

Tolerances: f32 logits (within about ±4) 1e-4 max abs against transformers, whole,
through the KV cache and recurrent state (prefills in chunks, then one token at a
time), in padded batches and from serve's paged blocks. A Q8_0 GGUF against an F32 GGUF
of the same weights rounded through Q8_0: 1e-4. A typed (f16/bf16/q8_0) KV cache: 1e-5
against an f32 cache that stores the rounded values, and less than DRIFT from f32. Each
feature checked in test_each_feature_moves_the_logits was removed from the code once and
these tests failed.
"""

import gguf
import numpy as np
import pytest
import torch
from family_checks import check_run_and_show, check_typed_cache, max_diff, write_keyed_gguf
from helpers import CHUNKS, cached_logits, randomize
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
    check_served_greedy_text,
)
from test_qwen3_5 import converted_tensors

from llmrun import api, native, ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect, qwen4exp
from llmrun.loading.loader import load_model
from llmrun.models import qwen4_exp

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="qwen4_exp_text",
    hidden_size=64,
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
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    hc_count=3,
    hc_lowrank=16,
    ple_layer_ids=[1, 3],
    ple_embed_dim=64,  # hidden_size, as llama.cpp's PLE tensors take it
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=100,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=4,
    indexer_n_heads=8,
    indexer_kv_heads=1,
    indexer_head_dim=32,
    indexer_budget=4,
    indexer_compress_ratio=2,
    output_gate_type="sigmoid",  # llama.cpp's graph's (it has no key for it)
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
IDS[0, 17] = 2  # an EOS: the n-grams after it start again
# measured: f16 about 1e-3, bf16 about 5e-3, q8_0 about 2e-2 but 0.4 at two tokens where
# the rounding moves a router's choice of experts (the indexer's choices stay the same)
DRIFT = {"f16": 1e-2, "bf16": 1e-1, "q8_0": 1.0}
HASH_BUFFERS = qwen4exp.HASH_BUFFERS


def hf_model(**overrides):
    """transformers' Qwen4-Exp of CONFIG and `overrides` (f32, eval) with randomize()'s
    weights (the output matrix scaled down to keep logits within about ±4) and slow
    decays."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
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
    """The weights under llmrun's names: experts per expert, the indexer's projection
    split, the hash's constants left out (the model computes them)."""
    c, out = hf.config, {}
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
        elif key.endswith("index_qk_proj.weight"):
            queries = c.indexer_n_heads * c.indexer_head_dim
            base = key.removesuffix("index_qk_proj.weight")
            out[f"{base}index_q_proj.weight"] = value[:queries]
            out[f"{base}index_k_proj.weight"] = value[queries:]
        elif not key.endswith(HASH_BUFFERS):
            out[key] = value
    return out


def ours(hf) -> torch.nn.Module:
    model = qwen4_exp.Model(qwen4_exp.ModelArgs.from_config(hf.config.to_dict()))
    model.load_state_dict(hub_state(hf), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


# ---- the model against transformers ---------------------------------------------------


def test_whole_chunked_and_decoded_match_transformers(family):
    hf, expected = family
    model = ours(hf)
    assert expected.abs().max() > 2
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    # Prefills of CHUNKS (one of them a single token), then decode steps.
    assert max_diff(cached_logits(model, IDS, CHUNKS), expected) < 1e-4
    # A short prefill, then every token decoded through the cache.
    assert max_diff(cached_logits(model, IDS, (3,)), expected) < 1e-4


def test_the_hash_constants_are_transformers(family):
    hf, _ = family
    args = qwen4_exp.ModelArgs.from_config(hf.config.to_dict())
    for index, layer_id in enumerate(args.ple_layer_ids):
        ngrams = hf.model.layers[layer_id - 1].ple.ple_embedding
        assert ngrams.layer_multipliers.tolist() == args.ple_multipliers[index]
        assert ngrams.ngram_heads_vocab_sizes.tolist() == args.ple_head_vocab_sizes[index]
        assert ngrams.ngram_heads_offsets.tolist() == args.ple_head_offsets[index]
        assert ngrams.ngram_embedding.num_embeddings == args.ple_table_rows[index]


def test_the_native_deltanet_step_takes_a_silu_gate_only(family, monkeypatch):
    """transformers' default gate, hidden_act (silu), decodes through the native Gated
    DeltaNet step; the sigmoid gate (llama.cpp's) through torch, the native step gating
    by silu alone. Both match transformers."""
    if not native.available():
        pytest.skip(f"no native kernels here: {native.status()}")
    calls = []
    step = ops.gated_delta_step
    monkeypatch.setattr(ops, "gated_delta_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    hf = hf_model(output_gate_type=None)
    assert max_diff(cached_logits(ours(hf), IDS, (3,)), reference(hf)) < 1e-4
    assert len(calls) == (SEQ - 3) * hf.config.layer_types.count("linear_attention")
    calls.clear()
    hf, expected = family
    assert max_diff(cached_logits(ours(hf), IDS, (3,)), expected) < 1e-4
    assert not calls


def _dense_attention(monkeypatch):
    monkeypatch.setattr(qwen4_exp.Indexer, "choose", lambda self, q, k, frame: frame.mask)


def _no_eos_reset(monkeypatch):
    monkeypatch.setattr(
        qwen4_exp.NGramEmbedding, "stops", lambda self, history: torch.zeros_like(history) > 0
    )


def _forgotten_state(part):
    def remove(monkeypatch):
        forward = qwen4_exp.PLE.forward

        def forgetful(self, x, frame, cache):
            if cache is not None:
                cache.recurrent.tensors[self.key][part].zero_()
            return forward(self, x, frame, cache)

        monkeypatch.setattr(qwen4_exp.PLE, "forward", forgetful)

    return remove


def _uninjected(monkeypatch):
    monkeypatch.setattr(
        qwen4_exp.GatedResidual, "add", lambda self, x, out, inject: x + out.repeat(1, 1, 3)
    )


def _silu_gate(monkeypatch):
    init = qwen4_exp.GatedDeltaNet.__init__

    def silu(self, args, layer):
        init(self, args, layer)
        self.norm.act = torch.nn.functional.silu

    monkeypatch.setattr(qwen4_exp.GatedDeltaNet, "__init__", silu)


def _unrotated_blocks(monkeypatch):
    monkeypatch.setattr(qwen4_exp, "rotate_blocks", lambda x, cos, sin: x)


REMOVALS = {
    "indexer": _dense_attention,
    "eos reset": _no_eos_reset,
    "ngram context": _forgotten_state(1),
    "ple conv state": _forgotten_state(0),
    "injection": _uninjected,
    "sigmoid gate": _silu_gate,
    "block rope": _unrotated_blocks,
}


@pytest.mark.parametrize("removed", list(REMOVALS))
def test_each_feature_moves_the_logits(family, removed, monkeypatch):
    """Without each of Qwen4-Exp's features (the indexer's choice of blocks and their
    RoPE, the n-grams' start at EOS, the PLE state carried between forwards, the streams'
    injection weights, the sigmoid output gate) the cached logits move from
    transformers' by far more than the tolerance."""
    hf, expected = family
    REMOVALS[removed](monkeypatch)
    model = ours(hf)
    assert max_diff(cached_logits(model, IDS, (7, 9)), expected) > 0.2


def test_padded_rows_of_a_batch_keep_their_own_state(family):
    """Rows of different lengths prefilled together, padded on the right as the server
    pads them (a padded token repeats its row's last position), then decoded together,
    also in scattered rows of a larger cache: each row's logits are transformers' for it
    alone."""
    hf, _ = family
    model = ours(hf)
    check_padded_rows_decoded_together(model, lambda ids: reference(hf, ids), IDS)
    check_padded_rows_in_scattered_slots(model, lambda ids: reference(hf, ids), IDS)


def test_serves_from_paged_blocks(family):
    """serve's paged KV blocks (shuffled) with the scheduler's recurrent state rows: a
    sequence prefilled in chunks that end inside blocks, then decoded."""
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", list(DRIFT))
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """The attention layers' keys, index keys and values rounded to the type; the
    recurrent state stays float32."""
    hf, expected = family
    model = ours(hf)
    assert model.new_cache(1, 8, cache_type, "cpu").recurrent.dtype == torch.float32
    check_typed_cache(model, IDS, expected, cache_type, DRIFT[cache_type])


def test_no_static_decode_step(family):
    check_no_static_decode(ours(family[0]))


def test_configs_llmrun_cannot_run_are_refused():
    config = hf_model().config.to_dict()
    with pytest.raises(ModelFormatError, match="indexer_budget"):
        qwen4_exp.ModelArgs.from_config({**config, "indexer_budget": None})
    with pytest.raises(UnsupportedError, match="output gate 'gelu'"):
        qwen4_exp.ModelArgs.from_config({**config, "output_gate_type": "gelu"})
    with pytest.raises(UnsupportedError, match="full-attention layer"):
        qwen4_exp.ModelArgs.from_config({**config, "ple_layer_ids": [4]})


# ---- Hugging Face folders ------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    """A text-only folder as transformers 5 saves it: experts fused, the n-gram tables
    in split_ngram_parts shards, the hash's constants (checked, then left out)."""
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_multimodal_folder_runs_its_language_model(family, tmp_path):
    """Qwen4ExpForConditionalGeneration: the language model under model.language_model,
    the vision tower left out, with a note."""
    text, expected = family
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen4ExpConfig(
        text_config={k: v for k, v in CONFIG.items() if k != "model_type"},
        vision_config=vision,
    )
    multimodal = transformers.Qwen4ExpForConditionalGeneration(config).eval()
    state = {
        k.replace("model.", "model.language_model.", 1): v for k, v in text.state_dict().items()
    }
    missing, unexpected = multimodal.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    multimodal.save_pretrained(tmp_path / "mm")
    loaded = load_model(tmp_path / "mm", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "qwen4_exp"
    assert any("language model only" in note for note in loaded.checkpoint.notes)
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


# ---- llama.cpp's GGUFs ---------------------------------------------------------------

# GGUF tensor names of what Qwen3.5-MoE does not have (conversion/qwen4exp.py and
# gguf-py's tensor_mapping.py).
HC_PARTS = {
    "hc_norm": "norm",
    "input_mix_weight_down": "down",
    "input_mix_weight_up": "up",
    "block_inject_weight": "inject",
}
PLE_PARTS = {
    "key_proj": "ple_key",
    "value_proj": "ple_value",
    "norm_key": "ple_norm_key",
    "norm_query": "ple_norm_query",
    "norm_conv": "ple_norm_conv",
    "conv1d": "ple_conv1d",
}


def _qwen4_tensors(hf, ple_layer: int) -> dict[str, np.ndarray]:
    """The tensors Qwen3.5-MoE lacks, as llama.cpp's converter writes them (PLE: the
    layer `ple_layer`'s, zero-indexed)."""
    c, out = hf.config, {}
    for key, tensor in hf.state_dict().items():
        x = tensor.float().numpy().copy()
        parts = key.split(".")
        if key.startswith("model.hyper_connection_mixer."):
            part = HC_PARTS[parts[2]]
            out[f"output_hc_{part}.weight"] = x + 1 if part == "norm" else x
        elif "_hyper_connection." in key:
            stream = "attn" if parts[3].startswith("attn") else "ffn"
            part = HC_PARTS[parts[4]]
            out[f"blk.{parts[2]}.hc_{stream}_{part}.weight"] = x + 1 if part == "norm" else x
        elif ".indexer." in key:
            blk = f"blk.{parts[2]}.indexer"
            if parts[5] == "index_qk_proj":
                queries = c.indexer_n_heads * c.indexer_head_dim
                out[f"{blk}.q_proj.weight"], out[f"{blk}.k_proj.weight"] = x[:queries], x[queries:]
            else:
                out[f"{blk}.{parts[5][0]}_norm.weight"] = x + 1
        elif ".ple." in key and int(parts[2]) == ple_layer:
            if parts[4] == "ple_embedding":
                if parts[5] == "ngram_embedding":
                    out["per_layer_token_embd.weight"] = x
            elif parts[4] == "conv1d":
                out[f"blk.{parts[2]}.ple_conv1d.weight"] = x.squeeze(1)
            else:
                norm = parts[4].startswith("norm")
                out[f"blk.{parts[2]}.{PLE_PARTS[parts[4]]}.weight"] = x + 1 if norm else x
    return out


def _qwen35_part(hf) -> dict[str, torch.Tensor]:
    """The weights Qwen3.5-MoE has too, for test_qwen3_5's converter."""
    return {
        k: v
        for k, v in hf.state_dict().items()
        if not any(p in k for p in ("hyper_connection", ".indexer.", ".ple."))
    }


def gguf_keys(hf) -> dict:
    """The metadata llama.cpp's converter writes for `hf` (its first PLE layer's)."""
    c = hf.config
    ple_layer = c.ple_layer_ids[0] - 1 if c.ple_layer_ids else None
    keys = {
        "{arch}.block_count": c.num_hidden_layers,
        "{arch}.context_length": c.max_position_embeddings,
        "{arch}.embedding_length": c.hidden_size,
        "{arch}.attention.head_count": c.num_attention_heads,
        "{arch}.attention.head_count_kv": c.num_key_value_heads,
        "{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        "{arch}.attention.key_length": c.head_dim,
        "{arch}.attention.value_length": c.head_dim,
        "{arch}.rope.freq_base": c.rope_parameters["rope_theta"],
        "{arch}.rope.dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
        # conversion/qwen.py's _Qwen35MRopeMixin, as rope_parameters has no mrope_section
        "{arch}.rope.dimension_sections": [11, 11, 10, 0],
        "{arch}.expert_count": c.num_experts,
        "{arch}.expert_used_count": c.num_experts_per_tok,
        "{arch}.expert_feed_forward_length": c.moe_intermediate_size,
        "{arch}.expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
        "{arch}.ssm.conv_kernel": c.linear_conv_kernel_dim,
        "{arch}.ssm.state_size": c.linear_key_head_dim,
        "{arch}.ssm.group_count": c.linear_num_key_heads,
        "{arch}.ssm.time_step_rank": c.linear_num_value_heads,
        "{arch}.ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
        "{arch}.attention.recurrent_layers": [t == "linear_attention" for t in c.layer_types],
        "{arch}.full_attention_interval": 4,
        qwen4exp.HC_COUNT: c.hc_count,
        qwen4exp.HC_LOW_RANK: c.hc_lowrank,
        qwen4exp.INDEXER_HEADS: c.indexer_n_heads,
        qwen4exp.INDEXER_KEY_LENGTH: c.indexer_head_dim,
        qwen4exp.INDEXER_TOP_K: c.indexer_budget,
        # The converter's test is layer_types[i] == "full_attention", as the Hub's
        # config.json names them (transformers renames them indexed_attention).
        qwen4exp.COMPRESS_RATIOS: [
            0 if kind == "linear_attention" else c.indexer_compress_ratio for kind in c.layer_types
        ],
    }
    if ple_layer is not None:
        table = hf.model.layers[ple_layer].ple.ple_embedding
        keys.update(
            {
                qwen4exp.PLE_LAYERS: [ple_layer],
                qwen4exp.PLE_NGRAM_SIZE: c.ngram_size,
                qwen4exp.PLE_HEADS_PER_NGRAM: c.heads_per_ngram,
                qwen4exp.PLE_CONV_KERNEL: c.ple_conv_kernel_size,
                # the converter writes the last of a list (transformers hashes with the first)
                qwen4exp.PLE_EOS: eos[-1] if isinstance(eos := c.eos_token_id, list) else eos,
                "{arch}.embedding_length_per_layer_input": table.ngram_embedding.embedding_dim,
                # uint64 arrays, as gguf-py's _add_u64_array writes them
                qwen4exp.PLE_MULTIPLIERS: table.layer_multipliers.numpy().astype(np.uint64),
                qwen4exp.PLE_OFFSETS: table.ngram_heads_offsets.numpy().astype(np.uint64),
                qwen4exp.PLE_VOCAB_SIZES: table.ngram_heads_vocab_sizes.numpy().astype(np.uint64),
            }
        )
    return keys


KEEP_F32 = ("conv1d",)  # the converter's SSM_CONV1D; the PLE's [channels, 4] has no Q8_0 row


def write_qwen4_exp_gguf(path, hf, qtype=None, round_trip=None, **override):
    """The model as llama.cpp's converter writes Qwen4-Exp (its first PLE layer alone: a
    file holds one): gguf_keys' metadata (`override`: keys, with their {arch} template,
    to write instead; None leaves one out), the tensors converted (test_qwen3_5's
    converter for those Qwen3.5-MoE has), 2-D weights in `qtype` (the routers and
    convolutions F32, and matrices whose rows are not whole blocks), or F32 rounded
    through `round_trip` alike. Returns `path`."""
    c = hf.config
    ple_layer = c.ple_layer_ids[0] - 1 if c.ple_layer_ids else None
    keys = {**gguf_keys(hf), **override}
    tensors = {**converted_tensors(hf, state=_qwen35_part(hf)), **_qwen4_tensors(hf, ple_layer)}
    if round_trip is not None:
        block = gguf.GGML_QUANT_SIZES[round_trip][0]
        for name, x in tensors.items():
            kept = "ffn_gate_inp" in name or any(part in name for part in KEEP_F32)
            if x.ndim >= 2 and not kept and x.shape[-1] % block == 0:
                raw = gguf.quants.quantize(np.ascontiguousarray(x, np.float32), round_trip)
                tensors[name] = gguf.quants.dequantize(raw, round_trip).reshape(x.shape)
    return write_keyed_gguf(
        path,
        qwen4exp.ARCH,
        keys,
        tensors,
        qtype,
        whole_blocks=True,
        keep_f32=KEEP_F32,
    )


@pytest.fixture(scope="module")
def one_ple():
    """A model with one PLE layer, as a GGUF holds (llama.cpp reads one)."""
    hf = hf_model(ple_layer_ids=[1])
    return hf, reference(hf)


def test_a_gguf_matches_transformers(one_ple, tmp_path):
    hf, expected = one_ple
    loaded = load_model(write_qwen4_exp_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "qwen4_exp" and config["tiled_value_heads"]
    assert config["ple_layer_ids"] == [1] and config["indexer_compress_ratio"] == 2
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_without_ple_matches_transformers(tmp_path):
    """ple_layer_ids empty: the converter writes no PLE keys, the model has no n-grams."""
    hf = hf_model(ple_layer_ids=[])
    loaded = load_model(write_qwen4_exp_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config.get("ple_layer_ids") is None
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_holds_its_dequantized_weights(one_ple, tmp_path):
    hf, _ = one_ple
    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = load_model(write_qwen4_exp_gguf(tmp_path / "q.gguf", hf, qtype=q8), CPU, "f32")
    exact = load_model(write_qwen4_exp_gguf(tmp_path / "r.gguf", hf, round_trip=q8), CPU, "f32")
    assert max_diff(cached_logits(quantized.model, IDS), cached_logits(exact.model, IDS)) < 1e-4


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({qwen4exp.PLE_LAYERS: [0, 2]}, UnsupportedError, "one PLE table"),
        ({qwen4exp.COMPRESS_RATIOS: [0, 0, 0, 0]}, UnsupportedError, "compress ratio"),
        ({qwen4exp.HC_COUNT: None}, ModelFormatError, "hyper_connection.count"),
    ],
)
def test_files_llmrun_cannot_run_are_refused(one_ple, tmp_path, override, error, message):
    path = write_qwen4_exp_gguf(tmp_path / "m.gguf", one_ple[0], **override)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_llmrun_run_and_show(one_ple, tmp_path):
    hf, _ = one_ple
    path = write_qwen4_exp_gguf(tmp_path / "q4.gguf", hf)
    check_run_and_show(hf, path, "qwen4exp")
    info = inspect.describe(path)
    # Keys (with the index key) and values of the one attention layer: 2 heads of 32 + 32, f32.
    assert info["kv_cache_bytes_8k"] == 8192 * 2 * 2 * (32 + 32) * 4
    assert 0 < info["active_parameters"] < info["parameters"]


def test_serve_gives_concurrent_requests_transformers_greedy_text(one_ple, tmp_path):
    """serve's scheduler: three prompts of different lengths decoded together, each
    given the text transformers' greedy search gives it alone."""
    hf, _ = one_ple
    path = write_qwen4_exp_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), device="cpu", ctx_size=128)
    prompts = ["Once upon a time", "The cat", "One day, a little girl named Lily went"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)

"""Mamba and Falcon Mamba against transformers' MambaForCausalLM and
FalconMambaForCausalLM, from a config.json and from "mamba" GGUFs written as llama.cpp's
converter writes them (conversion/mamba.py MambaModel: A_log stored as A = -exp(A_log),
the convolution [inner, 1, K] squeezed to [inner, K], the output matrix left out where
it is the embedding's; Falcon Mamba as "mamba" with ssm.dt_b_c_rms true).

The family's features each move the logits by far more than the tolerance, and llmrun
follows each: the convolution's state and the scan's state carried from one forward to
the next (the cached and chunked checks), D's skip, the gate, and Falcon Mamba's norms
of dt, B and C (test_each_feature_moves_the_logits). The prefix scan equals the
per-token recurrence (test_the_prefix_scan_is_the_recurrence).

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers: whole, or
through the cache's state (prefills in chunks, then one token at a time), contiguous or
paged, rows of a batch padded on the right. A Q8_0 GGUF: 1e-4 against transformers run
on the weights gguf dequantizes. A Falcon Mamba GGUF: against transformers with
mixer_rms_eps = layer_norm_epsilon, the eps llama.cpp's norms of dt, B and C use.
"""

import math

import gguf
import numpy as np
import pytest
import torch
from family_checks import (
    check_run_and_show,
    check_show,
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
from in_process import llmrun

from llmrun import api
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.generate import CHECKPOINT_MARGIN, stream_generate
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import mamba
from llmrun.sampling import Sampler, SamplingParams

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
CONFIGS = {
    "mamba": dict(
        model_type="mamba",
        hidden_size=64,  # inner 128, time_step_rank ceil(64 / 16) = 4
        num_hidden_layers=3,
        state_size=16,
        conv_kernel=4,
        vocab_size=512,  # stories260K's tokenizer
        layer_norm_epsilon=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
}
CONFIGS["falcon_mamba"] = dict(CONFIGS["mamba"], model_type="falcon_mamba", mixer_rms_eps=1e-6)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(name: str = "mamba", **overrides):
    """transformers' model of CONFIGS[name] (and `overrides`), f32 and eval, with
    randomize()'s weights but A_log near log(1 .. state_size) (as the checkpoints
    initialize it: decays from slow to fast) and time-step biases of softplus^-1 of
    0.01 .. 0.5, so the state carries tokens far."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIGS[name], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        for layer in model.backbone.layers:
            mixer = layer.mixer
            n = mixer.A_log.shape[1]
            mixer.A_log.copy_(torch.log(torch.arange(1, n + 1.0)).expand_as(mixer.A_log))
            mixer.A_log.add_(torch.randn_like(mixer.A_log) * 0.1)
            dt = torch.empty_like(mixer.dt_proj.bias).uniform_(math.log(0.01), math.log(0.5))
            mixer.dt_proj.bias.copy_(dt.exp() + torch.log(-torch.expm1(-dt.exp())))
    return model


def reference(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request):
    hf = hf_model(request.param)
    return hf, reference(hf)


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, as MambaModel.modify_tensors writes them."""
    names = {
        "backbone.embeddings.weight": "token_embd.weight",
        "backbone.norm_f.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "norm.weight": "attn_norm.weight",
        "mixer.in_proj.weight": "ssm_in.weight",
        "mixer.conv1d.weight": "ssm_conv1d.weight",
        "mixer.conv1d.bias": "ssm_conv1d.bias",
        "mixer.x_proj.weight": "ssm_x.weight",
        "mixer.dt_proj.weight": "ssm_dt.weight",
        "mixer.dt_proj.bias": "ssm_dt.bias",
        "mixer.A_log": "ssm_a",
        "mixer.D": "ssm_d",
        "mixer.out_proj.weight": "ssm_out.weight",
    }
    out = {}
    embedding = hf.backbone.embeddings.weight
    for key, value in hf.state_dict().items():
        if key == "lm_head.weight" and torch.equal(value, embedding):
            continue  # the converter leaves out an output matrix equal to the embedding
        if key.startswith("backbone.layers."):
            _, _, layer, part = key.split(".", 3)
            name = f"blk.{layer}.{layer_names[part]}"
        else:
            name = names[key]
        if key.endswith("A_log"):
            value = -torch.exp(value)
        if key.endswith("conv1d.weight"):
            value = value.squeeze()
        out[name] = value.numpy()
    return out


def write_mamba_gguf(path, hf, qtype=None, keys: dict | None = None):
    """A "mamba" GGUF of `hf` as llama.cpp's converter writes it (conversion/mamba.py),
    with stories260K's vocabulary and every key llama.cpp's loader reads; `keys`
    ("{arch}.…" templates -> value) replaces some (None leaves one out)."""
    config = hf.config
    written = {
        gguf.Keys.LLM.CONTEXT_LENGTH: 2**20,
        gguf.Keys.LLM.EMBEDDING_LENGTH: config.hidden_size,
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: 0,
        gguf.Keys.Attention.HEAD_COUNT: 0,
        gguf.Keys.LLM.BLOCK_COUNT: config.num_hidden_layers,
        gguf.Keys.SSM.CONV_KERNEL: config.conv_kernel,
        gguf.Keys.SSM.INNER_SIZE: config.intermediate_size,
        gguf.Keys.SSM.STATE_SIZE: config.state_size,
        gguf.Keys.SSM.TIME_STEP_RANK: config.time_step_rank,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: config.layer_norm_epsilon,
        gguf.Keys.SSM.DT_B_C_RMS: config.model_type == "falcon_mamba",
    }
    written.update(keys or {})
    return write_keyed_gguf(path, "mamba", written, gguf_tensors(hf), qtype, whole_blocks=True)


def dequantized(hf, qtype):
    """`hf` with the weights a `qtype` GGUF of it holds: its matrices whose rows are
    whole blocks rounded through gguf's quantizer (A, the convolution and the narrow
    dt_proj stay F32, as the converter keeps them)."""
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if p.dim() == 2 and not key.endswith("A_log") and p.shape[1] % 32 == 0:
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    return hf


def test_whole_cached_and_chunked_forwards_match_transformers(family):
    hf, expected = family
    model = ours(hf)
    with torch.no_grad():
        whole = model(IDS, torch.arange(SEQ)[None])
    assert max_diff(whole, expected) < 1e-4
    for chunks in ((16, 1, 5), (SEQ,), (1,)):
        assert max_diff(cached_logits(model, IDS, chunks), expected) < 1e-4


def test_a_long_prompt_scans_in_chunks_as_transformers_runs_it():
    """150 tokens: the scan's chunks of SCAN_CHUNK carry the state from one to the next."""
    hf = hf_model("falcon_mamba")
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = ours(hf)(ids, torch.arange(150)[None])
    assert 150 > 2 * mamba.SCAN_CHUNK
    assert max_diff(whole, reference(hf, ids)) < 1e-4


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 100])
def test_the_prefix_scan_is_the_recurrence(tokens):
    generator = torch.Generator().manual_seed(tokens)
    decay = torch.rand(2, tokens, 8, 4, generator=generator)
    inputs = torch.randn(2, tokens, 8, 4, generator=generator)
    h = torch.randn(2, 8, 4, generator=generator)
    states, last = mamba.selective_scan(decay, inputs, h)
    for t in range(tokens):
        h = decay[:, t] * h + inputs[:, t]
        assert max_diff(states[:, t], h) < 1e-5
    assert torch.equal(last, states[:, -1])


def test_each_feature_moves_the_logits(family):
    """What the checks above would miss if llmrun dropped it moves the logits by far
    more than their tolerance: the carried states (zeroed after a prefill), D's skip,
    the gate, and Falcon Mamba's norms of dt, B and C."""
    hf, expected = family
    model = ours(hf)
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    with torch.no_grad():
        model(IDS[:, :20], torch.arange(20)[None], cache)
        for layer in range(len(model.backbone.layers)):
            conv, h = cache.recurrent.read(layer)
            cache.recurrent.write(layer, [torch.zeros_like(conv), h])
        no_conv_state = model(IDS[:, 20:], torch.arange(20, SEQ)[None], cache)
        assert max_diff(no_conv_state, expected[:, 20:]) > 1e-2
        model(IDS[:, :20], torch.arange(20)[None], cache)
        for layer in range(len(model.backbone.layers)):
            conv, h = cache.recurrent.read(layer)
            cache.recurrent.write(layer, [conv, torch.zeros_like(h)])
        no_scan_state = model(IDS[:, 20:], torch.arange(20, SEQ)[None], cache)
        assert max_diff(no_scan_state, expected[:, 20:]) > 1e-2
        for mixer in (block.mixer for block in model.backbone.layers):
            mixer.D.zero_()
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) > 1e-2
    falcon = hf.config.model_type == "falcon_mamba"
    other = ours(hf)
    for block in other.backbone.layers:
        block.mixer.rms_eps = None if falcon else 1e-6
    with torch.no_grad():
        assert max_diff(other(IDS, torch.arange(SEQ)[None]), expected) > 1e-2


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
def test_a_typed_cache_changes_nothing(cache_type):
    """The cache holds no keys or values, and the state stays f32 whatever the type:
    the logits are the f32 cache's exactly."""
    hf = hf_model("mamba")
    model = ours(hf)
    typed = model.new_cache(1, 64, cache_type, "cpu")
    assert typed.recurrent.dtype == torch.float32
    assert len(typed.buffers[0][0]) == 0  # no layer of keys
    f32 = model.new_cache(1, 64, torch.float32, "cpu")
    assert torch.equal(
        cached_logits_through(model, IDS, typed), cached_logits_through(model, IDS, f32)
    )


def cached_logits_through(model, ids, cache):
    with torch.no_grad():
        first = model(ids[:, :30], torch.arange(30)[None], cache)
        rest = [model(ids[:, t : t + 1], torch.tensor([[t]]), cache) for t in range(30, SEQ)]
    return torch.cat([first, *rest], dim=1)


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, _ = family
    if hf.config.model_type == "falcon_mamba":
        # llama.cpp's norms of dt, B and C take the file's layer_norm_rms_eps.
        hf = hf_model("falcon_mamba", mixer_rms_eps=CONFIGS["mamba"]["layer_norm_epsilon"])
    loaded = load_model(write_mamba_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == hf.config.model_type
    assert config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4
    # Neither the native decode step nor CUDA graphs' static step takes the family.
    assert loaded.model.decode_step is None
    check_no_static_decode(loaded.model)


def test_an_untied_gguf_reads_its_output_matrix(tmp_path):
    hf = hf_model("mamba", tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.normal_(0, 0.2)
    loaded = load_model(write_mamba_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert not loaded.checkpoint.config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_q8_0_gguf_matches_its_dequantized_weights(name, tmp_path):
    hf = hf_model(name, mixer_rms_eps=1e-5) if name == "falcon_mamba" else hf_model(name)
    path = write_mamba_gguf(tmp_path / "q.gguf", hf, Q8_0)
    kinds = {info.name: info.ggml_type for info in read_gguf(path).tensors.values()}
    assert kinds["blk.0.ssm_in.weight"] == Q8_0 and kinds["blk.0.ssm_x.weight"] == Q8_0
    loaded = load_model(path, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(dequantized(hf, Q8_0))) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_hf_folder_loads_as_transformers_runs_it(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_serves_concurrent_requests_with_transformers_greedy_text(tmp_path):
    """serve's scheduler decodes prompts of different lengths together (padded prefills,
    a state row each), more prompts than rows: each gets transformers' greedy text."""
    hf = hf_model("falcon_mamba", mixer_rms_eps=1e-5)
    path = write_mamba_gguf(tmp_path / "m.gguf", hf)
    engine = api.load(str(path), "cpu", ctx_size=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=3)


def test_a_chat_turn_goes_on_from_the_state_kept_before_the_prompt_end(tmp_path):
    """run's and chat's prefix reuse with no KV layers at all: a next prompt that agrees
    with the last up to CHECKPOINT_MARGIN tokens before its end goes on from the state
    kept there, and gets the greedy text a fresh state gives it."""
    hf = hf_model("mamba")
    engine = api.load(str(write_mamba_gguf(tmp_path / "m.gguf", hf)), "cpu", ctx_size=128)
    sampler = Sampler(SamplingParams(temperature=0))

    def text(state, prompt):
        replies = list(stream_generate(engine.model, engine.tokenizer, state, prompt, sampler, 8))
        return "".join(r.text for r in replies), replies[-1].stats.prompt_processed

    first = engine.tokenizer.encode("Once upon a time there was a little dog who")
    state = engine.new_state(96)
    text(state, first)
    kept = len(first) - CHECKPOINT_MARGIN
    follow_up = first[:kept] + engine.tokenizer.encode(" The end. Then")
    reply, processed = text(state, follow_up)
    assert processed == len(follow_up) - kept
    assert reply == text(engine.new_state(96), follow_up)[0]


def test_llmrun_run_prints_transformers_greedy_text_and_show_names_it(tmp_path):
    hf = hf_model("mamba")
    path = write_mamba_gguf(tmp_path / "mamba.gguf", hf)
    check_run_and_show(hf, path, "mamba")
    check_show(path, "mamba", 0)  # no attention: no keys or values
    shown = llmrun("show", str(path)).stdout
    assert "none (no attention layers)" in shown  # not "-", which says "unknown"


def test_show_counts_no_kv_cache():
    """inspect's torch-free count is the cache the model allocates: none."""
    from llmrun.loading.inspect import kv_cache_bytes
    from llmrun.models import kv_cache_bytes as allocated

    for name in CONFIGS:
        assert kv_cache_bytes(CONFIGS[name], 8192) == allocated(CONFIGS[name], 8192) == 0


@pytest.mark.parametrize(
    "keys, message",
    [
        ({gguf.Keys.SSM.STATE_SIZE: None}, "ssm.state_size' is missing"),
        ({gguf.Keys.Attention.LAYERNORM_RMS_EPS: None}, "layer_norm_rms_epsilon' is missing"),
    ],
)
def test_a_gguf_without_a_key_llama_cpp_requires_is_refused(keys, message, tmp_path):
    path = write_mamba_gguf(tmp_path / "m.gguf", hf_model("mamba"), keys=keys)
    with pytest.raises(ModelFormatError, match=message):
        load_model(path, CPU, "f32")


def test_an_activation_other_than_silu_is_refused():
    with pytest.raises(UnsupportedError, match="hidden_act 'gelu'"):
        our_model({**CONFIGS["mamba"], "hidden_act": "gelu"}, {})

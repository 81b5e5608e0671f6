"""Mamba-2 (mamba2: the Mamba-2 models, Mamba-Codestral) against transformers'
Mamba2ForCausalLM, from a config.json (transformers 5's and the Hub's names: backbone.,
the older embedding.) and from a "mamba2" GGUF written as llama.cpp's converter writes
it (conversion/mamba.py Mamba2Model: ssm.conv_kernel, inner_size, state_size,
time_step_rank (the heads), group_count, attention.layer_norm_rms_epsilon, a context of
2^20 and zero feed-forward length and heads; A_log stored as -exp(A_log) [heads, 1], D
[heads, 1], the convolution squeezed to [channels, d_conv], the gated norm's weight as
[n_groups, inner / n_groups], dt_bias as ssm_dt.bias).

No layer attends: the cache holds no keys or values, only each layer's state, and run,
the paged server path and the scheduler work on it as on the hybrids' (tests below).

The tiny model: 2 layers (3 where said), hidden 64, 8 heads of 16 (inner 128), 2 groups
of B/C, a state of 16, a kernel of 4, stories260K's 512-token vocabulary.

Tolerances: f32 logits 1e-4 max abs against transformers: whole, through the cache
(prefills in chunks, then one token at a time), rows of different lengths padded on the
right in scattered cache rows, serve's paged path with a state row, the scheduler's
greedy text. A Q8_0 GGUF (its matrices Q8_0, the small Mamba-2 tensors F32 as llama.cpp
keeps them) against transformers on the dequantized weights: 1e-4. A typed cache type
changes nothing (the state stays f32, and there are no keys). The chunked SSD itself is
held to the one-token recurrence in test_granitemoehybrid.py (the same mixer).
"""

import numpy as np
import pytest
import torch
from family_checks import (
    PROMPT,
    cache_logits,
    check_run_prints_greedy_tokens,
    check_show,
    check_whole_and_cached,
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
from llmrun.loading import inspect
from llmrun.loading import mamba2 as loading
from llmrun.loading.loader import Weight, load_model
from llmrun.models import kv_cache_bytes, mamba2, recurrent_state_bytes
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="mamba2",
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    num_heads=8,
    head_dim=16,
    expand=2,
    n_groups=2,
    state_size=16,
    conv_kernel=4,
    chunk_size=8,  # transformers' SSD chunks, shorter than the prompts
    layer_norm_epsilon=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """A tiny random Mamba2ForCausalLM (f32, eval), CONFIG with `overrides`: randomize()'s
    weights, the final norm (norm_f, which randomize does not take for a norm) near 1."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        model.backbone.norm_f.weight.normal_(1.0, 0.1)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf) -> torch.nn.Module:
    weights = loading.hf_weights({k: Weight(v) for k, v in hf.state_dict().items()})
    return our_model(hf.config.to_dict(), {k: w.tensor for k, w in weights.items()})


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


# ---- the converter's GGUF -----------------------------------------------------------

_NAMES = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
}
_GLOBAL = {
    "backbone.embeddings.weight": "token_embd.weight",
    "backbone.norm_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# What llama.cpp's quantizer keeps in F32 (2-D in the file, but not matrices).
_FLOAT = ("ssm_a", "ssm_d", "ssm_conv1d", "ssm_norm")
# The transformers parameters a Q8_0 file rounds.
_QUANTIZED = ("in_proj.weight", "out_proj.weight", "embeddings.weight", "lm_head.weight")


def converted(hf) -> dict[str, np.ndarray]:
    """hf's tensors under the GGUF names and in the shapes Mamba2Model.modify_tensors
    writes (the output matrix left out where the embedding is tied)."""
    config = hf.config
    inner = config.num_heads * config.head_dim
    out = {}
    for name, t in hf.state_dict().items():
        t = t.detach().float()
        if name in _GLOBAL:
            if name != "lm_head.weight" or not config.tie_word_embeddings:
                out[_GLOBAL[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mixer.A_log":
            t = -torch.exp(t).reshape(-1, 1)
        elif rest == "mixer.D":
            t = t.reshape(-1, 1)
        elif rest == "mixer.conv1d.weight":
            t = t.squeeze()
        elif rest == "mixer.norm.weight":
            t = t.reshape(config.n_groups, inner // config.n_groups)
        out[f"blk.{layer}.{_NAMES[rest]}"] = t
    return {k: np.ascontiguousarray(v.numpy()) for k, v in out.items()}


def write_mamba2_gguf(path, hf, qtype=None, **keys):
    """hf as llama.cpp's converter writes Mamba-2: Mamba2Model.set_gguf_parameters' keys
    (`keys` changing them: "{arch}.…" -> value, None leaves one out), stories260K's
    vocabulary, converted(hf)'s tensors, the matrices in `qtype` (default F32)."""
    config = hf.config
    inner = config.num_heads * config.head_dim
    metadata = {
        "{arch}.context_length": 2**20,  # "arbitrary value", says the converter
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": 0,
        "{arch}.attention.head_count": 0,
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.ssm.conv_kernel": config.conv_kernel,
        "{arch}.ssm.inner_size": inner,
        "{arch}.ssm.state_size": config.state_size,
        "{arch}.ssm.time_step_rank": inner // config.head_dim,
        "{arch}.ssm.group_count": config.n_groups,
        "{arch}.attention.layer_norm_rms_epsilon": float(config.layer_norm_epsilon),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        **keys,
    }
    return write_keyed_gguf(path, "mamba2", metadata, converted(hf), qtype, keep_f32=_FLOAT)


# ---- the model ----------------------------------------------------------------------

VARIANTS = {
    "groups-2": {},
    "groups-1": dict(n_groups=1),
    "three-layers-kernel-3": dict(num_hidden_layers=3, conv_kernel=3),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 2
    check_whole_and_cached(model, IDS, expected)
    assert max_diff(cached_logits(model, IDS, chunks=(3, 11, 9)), expected) < 1e-4


def test_a_prompt_longer_than_an_ssd_chunk(family):
    """150 tokens run through llmrun's SSD in chunks of 64 (granitemoehybrid.SSD_CHUNK)
    and transformers' in chunks of 8, whole and as a prefill of 100 then decode steps."""
    hf, _ = family
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(2))
    expected = reference(hf, ids)
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(ids, torch.arange(150)[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, ids, chunks=(100,), capacity=160), expected) < 1e-4


def test_each_feature_moves_the_logits_and_llmrun_follows(family):
    """D, dt_bias, the convolution's bias and A each move transformers' logits by far
    more than the tolerance when zeroed, and llmrun follows each; so does the gated
    norm's grouping (n_groups 2 against 1 on the same weights)."""
    _, expected = family
    for suffix in ("mixer.D", "mixer.dt_bias", "mixer.conv1d.bias", "mixer.A_log"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        moved = reference(changed)
        assert max_diff(moved, expected) > 0.1, suffix
        assert max_diff(cached_logits(ours(changed), IDS), moved) < 1e-4, suffix
    model = ours(hf_model())
    for layer in model.model.layers:
        layer.mixer.norm.groups = 1
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_the_cache_holds_no_keys_only_each_layers_state(family):
    """Nothing attends: the KV cache has no layers, the recurrent state one per layer
    (the convolution's last inputs and the SSD state, in f32), and a frame no mask."""
    model = ours(family[0])
    cache = model.new_cache(2, 64, torch.float16, "cpu")
    assert cache.nbytes == recurrent_state_bytes(model.args) * 2
    assert sorted(cache.recurrent.tensors) == [0, 1]
    conv, ssd = cache.recurrent.tensors[0]
    assert conv.shape == (2, 128 + 2 * 2 * 16, 3) and ssd.shape == (2, 8, 16, 16)
    assert conv.dtype == ssd.dtype == torch.float32
    assert kv_cache_bytes(family[0].config.to_dict(), 4096) == 0
    assert inspect.kv_cache_bytes(family[0].config.to_dict(), 4096) == 0


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_a_typed_cache_changes_nothing(family, cache_type):
    """--cache-type types keys and values, of which there are none: the logits are the
    f32 cache's exactly (the state is f32 whatever the type)."""
    hf, expected = family
    model = ours(hf)
    typed = cache_logits(model, IDS, model.new_cache(1, 64, cache_type, "cpu"))
    assert torch.equal(typed, cache_logits(model, IDS, model.new_cache(1, 64, "f32", "cpu")))
    assert max_diff(typed, expected) < 1e-4


def test_padded_rows_in_scattered_slots_keep_their_own_state(family):
    hf, _ = family
    check_padded_rows_in_scattered_slots(
        ours(hf), lambda ids: reference(hf, ids), IDS, padding_repeats=True
    )


def test_padded_rows_decoded_together(family):
    hf, _ = family
    check_padded_rows_decoded_together(ours(hf), lambda ids: reference(hf, ids), IDS)


def test_serves_from_the_paged_path_with_a_state_row(family):
    """serve's path: a paged view (of no layers) with the Mamba-2 state in a row of the
    scheduler's kind (RecurrentState), in chunked prefills and decode steps."""
    hf, expected = family
    check_paged_with_a_state_row(ours(hf), IDS, expected)


def test_no_static_decode_and_no_native_decode_step(family, tmp_path):
    """CUDA graphs' static step refuses the recurrent cache; the native decode step knows
    no Mamba-2 and is not attached."""
    check_no_static_decode(ours(family[0]))
    loaded = load_model(write_mamba2_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(ours(family[0]))


def test_unsupported_configs_are_refused():
    with pytest.raises(UnsupportedError, match="hidden_act 'gelu'"):
        mamba2.ModelArgs.from_config({**CONFIG, "hidden_act": "gelu"})
    with pytest.raises(ModelFormatError, match="heads do not fit"):
        mamba2.ModelArgs.from_config({**CONFIG, "head_dim": 8})
    with pytest.raises(ModelFormatError, match="do not split into 3 groups"):
        mamba2.ModelArgs.from_config({**CONFIG, "n_groups": 3})


# ---- files --------------------------------------------------------------------------


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "mamba2"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_the_older_embedding_name_loads():
    """transformers' load hook renames backbone.embedding. (older checkpoints) to
    embeddings.; so does the loader."""
    weights = {"backbone.embedding.weight": 1, "backbone.layers.0.norm.weight": 2}
    assert loading.hf_weights(weights) == {
        "model.embeddings.weight": 1,
        "model.layers.0.norm.weight": 2,
    }


@pytest.mark.parametrize("variant", ["groups-2", "tied"])
def test_a_gguf_matches_transformers(variant, tmp_path):
    hf = hf_model(**VARIANTS[variant])
    path = write_mamba2_gguf(tmp_path / "m.gguf", hf)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "mamba2"
    assert (config["num_heads"], config["head_dim"], config["n_groups"]) == (8, 16, 2)
    assert config["tie_word_embeddings"] == (variant == "tied")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    loaded = load_model(write_mamba2_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(_QUANTIZED):
                blocks = gguf.quants.quantize(p.numpy(), q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, q8)))
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"{arch}.ssm.group_count": None}, "ssm.group_count' is missing"),
        ({"{arch}.attention.layer_norm_rms_epsilon": None}, "layer_norm_rms_epsilon' is missing"),
        ({"{arch}.ssm.time_step_rank": 7}, "not a multiple of ssm.time_step_rank 7"),
    ],
)
def test_bad_ggufs_are_refused(family, tmp_path, keys, message):
    path = write_mamba2_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(ModelFormatError, match=message):
        load_model(path, CPU, "f32")


def test_a_quantized_small_tensor_is_refused(family, tmp_path):
    """llama.cpp keeps A, D, the convolution and the norm in float; llmrun reads no
    quantized form of them."""
    path = tmp_path / "m.gguf"
    tensors = converted(family[0])
    tensors["blk.0.ssm_norm.weight"] = np.ones((2, 64), np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    keys = {"{arch}.block_count": 2, "{arch}.embedding_length": 64}
    keys.update({
        "{arch}.ssm.conv_kernel": 4, "{arch}.ssm.inner_size": 128, "{arch}.ssm.state_size": 16,
        "{arch}.ssm.time_step_rank": 8, "{arch}.ssm.group_count": 2,
        "{arch}.attention.layer_norm_rms_epsilon": 1e-5,
    })  # fmt: skip
    keep = tuple(p for p in _FLOAT if p != "ssm_norm")
    write_keyed_gguf(path, "mamba2", keys, tensors, q8, keep_f32=keep)
    with pytest.raises(ModelFormatError, match="ssm_norm|mixer.norm.weight is quantized"):
        load_model(path, CPU, "f32")


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_mamba2_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_mamba2_gguf(family, tmp_path):
    check_show(write_mamba2_gguf(tmp_path / "m.gguf", family[0]), "mamba2", 0)


def test_served_requests_equal_transformers_greedy_text(tmp_path):
    """serve's scheduler over a model with no KV layers, two state rows and more requests
    than rows, of different lengths: each request's greedy text is transformers' for its
    prompt alone."""
    hf = hf_model(num_hidden_layers=3)
    path = write_mamba2_gguf(tmp_path / "served.gguf", hf)
    engine = api.load(str(path), device="cpu", dtype="f32", ctx_size=128)
    prompts = [PROMPT, "One day", "The little dog ran to the park and then"]
    check_served_greedy_text(engine, hf, path, prompts, parallel=2)


def test_a_chat_turn_goes_on_from_the_state_kept_before_the_prompt_end(tmp_path):
    """run's and chat's prefix reuse with no KV layers: a next prompt that agrees with
    the last up to CHECKPOINT_MARGIN tokens before its end goes on from the state kept
    there (prefilling the rest alone) and continues as transformers' greedy decoding of
    the whole prompt."""
    from llmrun.generate import CHECKPOINT_MARGIN, stream_generate
    from llmrun.sampling import Sampler, SamplingParams

    hf = hf_model()
    engine = api.load(str(write_mamba2_gguf(tmp_path / "m.gguf", hf)), device="cpu", dtype="f32")
    tokenizer, sampler = engine.tokenizer, Sampler(SamplingParams(temperature=0))
    state = engine.new_state(96)
    first = tokenizer.encode("Once upon a time there was a little girl who liked to play")[:20]
    list(stream_generate(engine.model, tokenizer, state, first, sampler, 8))
    follow_up = first[: len(first) - CHECKPOINT_MARGIN] + tokenizer.encode(" The end. Then")
    replies = list(stream_generate(engine.model, tokenizer, state, follow_up, sampler, 8))
    kept = len(first) - CHECKPOINT_MARGIN
    assert replies[-1].stats.prompt_processed == len(follow_up) - kept
    with torch.no_grad():
        out = hf.generate(torch.tensor([follow_up]), max_new_tokens=8, do_sample=False)
    new = out[0, len(follow_up) :].tolist()
    new = new[: new.index(2)] if 2 in new else new
    text = tokenizer.decode(follow_up + new)[len(tokenizer.decode(follow_up)) :]
    assert "".join(r.text for r in replies) == text

"""GPT-2 against transformers' GPT2LMHeadModel, from a config.json (transformers 5's
state dict, and the Hub's oldest files without the "transformer." prefix and with the
attention's mask buffers) and from a "gpt2" GGUF written as llama.cpp's converter writes
it (conversion/gpt2.py GPT2Model: block count, context length (the Hub's n_ctx, which is
n_positions), embedding length, feed-forward length 4 * n_embd, head count,
attention.layer_norm_epsilon; the Conv1D matrices transposed, no output matrix where the
checkpoint ties it).

Its features each move the logits by far more than the tolerance (asserted below): the
learned position embeddings, the Conv1D matrices' transposition, the LayerNorms' biases,
scale_attn_by_inverse_layer_idx and scale_attn_weights; the GELU's form (tanh "gelu_new"
against the exact "gelu") by more than it.

The tiny model: 2 layers, hidden 64, 4 heads of 16, a feed-forward of 256, 128 learned
positions, stories260K's 512-token vocabulary.

Tolerances: f32 logits (within about ±7) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache that stores the values rounded
to the type, and DRIFT from f32. A Q8_0 GGUF against transformers run on the weights
gguf dequantizes: 1e-4.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_show,
    check_static_decode,
    check_typed_cache,
    dequantize_2d_weights,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model, randomize

from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError
from llmrun.loading import gpt2 as loading
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import Weight, load_model
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
GPT2 = dict(
    model_type="gpt2",
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    n_positions=128,
    layer_norm_epsilon=1e-5,
    activation_function="gelu_new",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits: f16 about 1e-3, bf16 about 1e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random GPT2LMHeadModel (f32, eval), GPT2 with `overrides`."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**GPT2, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    # randomize() knows norms by "norm.weight"; GPT-2's are ln_1, ln_2, ln_f: scales near 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith(".weight"):
                p.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    weights = loading.hf_weights({k: Weight(v) for k, v in hf.state_dict().items()}, Weight)
    return our_model(hf.config.to_dict(), {k: w.tensor for k, w in weights.items()})


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping for gpt2).
_NAMES = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_GLOBAL = {
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "lm_head": "output",
}


def converted(hf, transpose: bool = True) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names, the Conv1D matrices transposed as
    GPT2Model.modify_tensors transposes them (unless not `transpose`); no output matrix
    where it is tied (the checkpoint the converter reads holds none)."""
    out = {}
    for name, t in hf.state_dict().items():
        module, _, suffix = name.rpartition(".")
        data = t.detach().float()
        if module == "lm_head" and hf.config.tie_word_embeddings:
            continue
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = data.numpy()
            continue
        _, _, layer, rest = module.split(".", 3)
        if suffix == "weight" and transpose:
            data = data.t()
        out[f"blk.{layer}.{_NAMES[rest]}.{suffix}"] = np.ascontiguousarray(data.numpy())
    return out


def write_gpt2_gguf(path, hf, qtype=None, transpose=True, **keys):
    """The model as llama.cpp's converter writes GPT-2: GPT2Model's keys, the Conv1D
    matrices transposed, 2-D weights in `qtype` (default F32; the position embeddings
    too, as the converter quantizes every 2-D weight), stories260K's vocabulary. `keys`:
    metadata to change ("{arch}.…" -> value, None leaves one out)."""
    config = hf.config
    metadata = {
        "{arch}.block_count": config.n_layer,
        "{arch}.context_length": config.n_positions,
        "{arch}.embedding_length": config.n_embd,
        "{arch}.feed_forward_length": 4 * config.n_embd,
        "{arch}.attention.head_count": config.n_head,
        "{arch}.attention.layer_norm_epsilon": float(config.layer_norm_epsilon),
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    return write_keyed_gguf(path, "gpt2", metadata, converted(hf, transpose), qtype)


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


VARIANTS = {
    "default": {},
    "exact-gelu": dict(activation_function="gelu"),
    "inner-96": dict(n_inner=96),
    "inverse-layer-scale": dict(scale_attn_by_inverse_layer_idx=True),
    "unscaled": dict(scale_attn_weights=False),
    "untied": dict(tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**VARIANTS[variant])
    expected = reference(hf)
    model = ours(hf)
    assert expected.abs().max() > 3
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS, chunks=(3, 11, 9)), expected) < 1e-4


def test_each_feature_moves_the_logits(family):
    """The score scales and the exact GELU change transformers' logits (llmrun follows
    each, above); so do the position embeddings and the LayerNorms' biases, which llmrun
    must take."""
    hf, expected = family
    for variant in ("inverse-layer-scale", "unscaled"):
        assert max_diff(reference(hf_model(**VARIANTS[variant])), expected) > 0.1, variant
    # The two GELUs differ by at most 1e-3 an activation: 10 times the tolerance here.
    assert max_diff(reference(hf_model(**VARIANTS["exact-gelu"])), expected) > 1e-3
    for suffix in ("wpe.weight", "ln_1.bias", "ln_f.bias"):
        changed = hf_model()
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        assert max_diff(reference(changed), expected) > 0.1, suffix


def test_the_hubs_oldest_names_and_buffers_load_as_transformers_runs_it(tmp_path):
    """openai-community/gpt2's files name the modules without "transformer." and hold
    the attention's mask buffers, which are not weights; lm_head is tied."""
    from safetensors.torch import load_file, save_file

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(file).items()}
    assert "lm_head.weight" not in tensors
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, file)
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gpt2"
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("variant", ["default", "untied"])
def test_a_gguf_matches_transformers(variant, tmp_path):
    hf = hf_model(**VARIANTS[variant])
    path = write_gpt2_gguf(tmp_path / "m.gguf", hf)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu_new"
    assert config["tie_word_embeddings"] == (variant == "default")
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_gguf_written_without_the_transposition_reads_wrong(family, tmp_path):
    """The converter's transposition of the Conv1D matrices is what the loader expects."""
    hf, expected = family
    path = write_gpt2_gguf(tmp_path / "u.gguf", hf, transpose=False)
    # Square matrices load either way (c_proj), the others by shape not at all.
    with pytest.raises((ModelFormatError, RuntimeError, ValueError)):
        load_model(path, CPU, "f32")


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    path = write_gpt2_gguf(tmp_path / "q.gguf", hf, q8)
    loaded = load_model(path, CPU, "f32")
    assert read_gguf(path, with_tensors=False).tensors["blk.0.attn_qkv.weight"].ggml_type == q8
    # The file quantizes the transposed Conv1D matrices: round those, then transpose back.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                data = p.t() if name.endswith(".weight") and ".h." in name else p
                blocks = gguf.quants.quantize(data.contiguous().numpy(), q8)
                rounded = torch.from_numpy(gguf.quants.dequantize(blocks, q8))
                p.copy_(rounded.t() if data is not p else rounded)
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_dequantize_2d_weights_is_not_the_files_rounding(tmp_path):
    """Rounding the untransposed Conv1D matrices (in the wrong blocks) is not the file's
    rounding: the Q8_0 check above would catch a loader that skipped the transposition."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_gpt2_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) > 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    """As test_cache_types.py: the logits of an f32 cache whose writes are rounded to
    the type (1e-5), drifting from f32 by the rounding (DRIFT)."""
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_the_static_decode_step_gives_the_ordinary_logits(family, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does): the
    position embeddings are looked up at the step's position."""
    check_static_decode(ours(family[0]), monkeypatch)


def test_the_native_decode_step_is_not_attached(family, tmp_path):
    """The native step knows no LayerNorm, fused projection or position embedding: the
    loader leaves GPT-2 to the torch layers."""
    loaded = load_model(write_gpt2_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None
    assert not decode_step.attach(ours(family[0]))


def test_positions_past_the_learned_ones_are_refused(family):
    model = ours(family[0])
    with pytest.raises(ContextOverflowError, match="128 learned positions"):
        model(IDS[:, :2], torch.tensor([[127, 128]]))


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.context_length": None}, ModelFormatError, "context_length"),
        ({"{arch}.attention.head_count_kv": 2}, UnsupportedError, "as many KV heads"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_gpt2_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_cross_attention_is_refused():
    from llmrun.models import gpt2

    with pytest.raises(UnsupportedError, match="cross-attention"):
        gpt2.ModelArgs.from_config({**GPT2, "add_cross_attention": True})


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_gpt2_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_gpt2_gguf(family, tmp_path):
    path = write_gpt2_gguf(tmp_path / "m.gguf", family[0])
    # Two layers of 8192 positions: 4 KV heads of 16 floats, keys and values.
    check_show(path, "gpt2", 2 * 2 * 4 * 16 * 4 * 8192)

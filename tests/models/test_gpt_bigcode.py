"""GPT-BigCode (StarCoder 1, SantaCoder) against transformers' GPTBigCodeForCausalLM,
from a config.json and from a "starcoder" GGUF written as llama.cpp's converter writes
it (conversion/starcoder.py StarCoderModel: context length n_positions, embedding and
feed-forward (4 * embedding) lengths, block and head counts, head_count_kv 1, the
LayerNorms' epsilon; tensors as they are, position_embd included, the fused attn_qkv
already all queries then the key and value heads; no output tensor where the embeddings
are tied).

Its features each move the logits by far more than the tolerance (asserted below):
learned positions, the multi-query split of c_attn (against the per-head split of a
model without multi_query), scale_attn_weights.

Tolerances: f32 logits 1e-4 max abs against transformers, whole or through the KV cache
(prefills in chunks, then one token at a time), contiguous or paged. An f16 or bf16
cache: 1e-5 against an f32 cache that stores the values rounded to the type, and DRIFT
from f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_show,
    check_typed_cache,
    dequantize_2d_weights,
    hf_model_of,
    max_diff,
    write_keyed_gguf,
)
from helpers import cached_logits, our_model

from llmrun import static_decode
from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError
from llmrun.loading import gpt_bigcode as gpt_bigcode_loading
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
GPT_BIGCODE = dict(
    model_type="gpt_bigcode",
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,  # stories260K's tokenizer, so the model can be run end to end
    n_positions=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured like MPT's: f16 ~1e-4, bf16 ~1e-3.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}


def hf_model(**overrides):
    """A tiny random GPTBigCodeForCausalLM (f32, eval), GPT_BIGCODE with `overrides`."""
    model = hf_model_of({**GPT_BIGCODE, **overrides})
    # randomize() draws N(0, 0.2) for the scales of norms it does not know by name (ln_1,
    # ln_2, ln_f): such scales make attention near uniform and hide position bugs.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(hf) -> torch.nn.Module:
    return our_model(hf.config.to_dict(), gpt_bigcode_loading.hf_weights(hf.state_dict()))


# transformers' module -> llama.cpp's tensor (gguf-py's tensor_mapping).
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


def gguf_tensor_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def write_gpt_bigcode_gguf(path, hf, qtype=None, **keys):
    """The model as llama.cpp's converter writes GPT-BigCode (arch "starcoder"):
    StarCoderModel's keys, the tensors as they are, 2-D weights but position_embd in
    `qtype` (default F32), no output tensor where tied. `keys`: metadata to change ("{arch}.…" -> value, None
    leaves one out)."""
    config = hf.config
    metadata = {
        "{arch}.context_length": config.n_positions,
        "{arch}.embedding_length": config.n_embd,
        "{arch}.feed_forward_length": 4 * config.n_embd,
        "{arch}.block_count": config.n_layer,
        "{arch}.attention.head_count": config.n_head,
        "{arch}.attention.head_count_kv": 1,
        "{arch}.attention.layer_norm_epsilon": config.layer_norm_epsilon,
        "general.file_type": 0 if qtype is None else int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.add_bos_token": False,
        **keys,
    }
    tied = config.tie_word_embeddings
    tensors = {
        gguf_tensor_name(name): t.detach().float().numpy()
        for name, t in hf.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    # The converter keeps position_embd in F32 whatever the file type (conversion/base.py).
    return write_keyed_gguf(
        path, "starcoder", metadata, tensors, qtype, keep_f32=("position_embd",)
    )


@pytest.fixture(scope="module")
def family():
    hf = hf_model()
    return hf, reference(hf)


@pytest.mark.parametrize(
    "variant",
    [{}, {"multi_query": False}, {"scale_attn_weights": False}, {"tie_word_embeddings": False},
     {"n_inner": 96, "activation_function": "gelu"}],
    ids=["plain", "multi-head", "unscaled", "untied", "n_inner-gelu"],
)  # fmt: skip
def test_config_json_matches_transformers_whole_chunked_and_decoded(variant):
    hf = hf_model(**variant)
    expected = reference(hf)
    model = ours(hf)
    with torch.no_grad():
        assert max_diff(model(IDS, torch.arange(SEQ)[None]), expected) < 1e-4
    assert max_diff(cached_logits(model, IDS), expected) < 1e-4


def test_each_feature_moves_the_logits(family):
    """Learned positions (against none), the multi-query split and scale_attn_weights
    (against the other setting, in transformers) each change the logits by far more than
    the tolerance."""
    hf, expected = family
    for variant in ({"multi_query": False}, {"scale_attn_weights": False}):
        assert max_diff(reference(hf_model(**variant)), expected) > 0.1, variant
    model = ours(hf)
    with torch.no_grad():
        model.model.embed_positions.weight.zero_()
    assert max_diff(cached_logits(model, IDS), expected) > 0.1


def test_a_gguf_matches_transformers(family, tmp_path):
    hf, expected = family
    loaded = load_model(write_gpt_bigcode_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "gpt_bigcode" and config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_untied_gguf_matches_transformers(tmp_path):
    hf = hf_model(tie_word_embeddings=False)
    loaded = load_model(write_gpt_bigcode_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert not loaded.checkpoint.config["tie_word_embeddings"]
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    f32 = reference(hf)
    loaded = load_model(write_gpt_bigcode_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    positions = hf.transformer.wpe.weight.detach().clone()
    dequantize_2d_weights(hf, q8)
    with torch.no_grad():
        hf.transformer.wpe.weight.copy_(positions)  # F32 in the file
    expected = reference(hf)
    assert max_diff(expected, f32) > 1e-3  # the blocks round the weights
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_an_hf_folder_loads_as_transformers_runs_it(family, tmp_path):
    hf, expected = family
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gpt_bigcode"
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_serves_from_paged_blocks_as_every_family_does(family):
    """test_paged.py's checks of serve's paged KV cache: one sequence on shuffled blocks
    (f32, f16) and rows of a batch sharing prefix blocks."""
    hf, expected = family
    check_paged(ours(hf), IDS, expected)


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_a_typed_cache_holds_its_rounded_values(family, cache_type):
    hf, expected = family
    check_typed_cache(ours(hf), IDS, expected, cache_type, DRIFT[cache_type])


def test_neither_the_static_nor_the_native_decode_step_takes_it(family, tmp_path):
    """Both leave out the learned positions: GPT-BigCode decodes through its torch layers."""
    model = ours(family[0])
    assert not static_decode.supported(model, model.new_cache(1, 32, torch.float32, "cpu"))
    assert not decode_step.attach(model)
    loaded = load_model(write_gpt_bigcode_gguf(tmp_path / "m.gguf", family[0]), CPU, "f32")
    assert loaded.model.decode_step is None


def test_positions_past_the_learned_table_are_refused(family):
    model = ours(family[0])
    ids = torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(ContextOverflowError, match="256 learned positions"):
        model(ids, torch.tensor([[256]]))


@pytest.mark.parametrize(
    "keys,error,message",
    [
        ({"{arch}.attention.layer_norm_epsilon": None}, ModelFormatError, "layer_norm_epsilon"),
        ({"{arch}.attention.head_count_kv": 2}, UnsupportedError, "2 KV heads"),
        ({"{arch}.attention.head_count_kv": 4}, UnsupportedError, "without multi-query"),
        ({"{arch}.context_length": None}, ModelFormatError, "context_length"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(family, tmp_path, keys, error, message):
    path = write_gpt_bigcode_gguf(tmp_path / "m.gguf", family[0], **keys)
    with pytest.raises(error, match=message):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_a_gguf_without_learned_positions_is_refused(family, tmp_path):
    config = family[0].config
    keys = {
        "{arch}.context_length": 256,
        "{arch}.embedding_length": config.n_embd,
        "{arch}.feed_forward_length": 4 * config.n_embd,
        "{arch}.block_count": 2,
        "{arch}.attention.head_count": 4,
        "{arch}.attention.head_count_kv": 1,
        "{arch}.attention.layer_norm_epsilon": 1e-5,
    }
    embed = family[0].transformer.wte.weight.detach().numpy()
    path = write_keyed_gguf(tmp_path / "p.gguf", "starcoder", keys, {"token_embd.weight": embed})
    with pytest.raises(ModelFormatError, match="position_embd"):
        config_from_gguf(read_gguf(path, with_tensors=False))


def test_llmrun_run_prints_transformers_greedy_text(family, tmp_path):
    hf = family[0]
    check_run_prints_greedy_tokens(hf, write_gpt_bigcode_gguf(tmp_path / "m.gguf", hf))


def test_show_describes_a_starcoder_gguf(family, tmp_path):
    path = write_gpt_bigcode_gguf(tmp_path / "m.gguf", family[0])
    # Two layers of 8192 positions: 1 KV head of 16 floats, keys and values.
    check_show(path, "starcoder", 2 * 2 * 1 * 16 * 4 * 8192)


@pytest.mark.parametrize("multi_query,kv_heads", [(True, 1), (False, 4)])
def test_show_describes_an_hf_folder(tmp_path, multi_query, kv_heads):
    """config.json names the sizes n_layer, n_head, n_embd; show reads them."""
    hf_model(multi_query=multi_query).save_pretrained(tmp_path / "hf")
    check_show(tmp_path / "hf", "gpt_bigcode", 2 * 2 * kv_heads * 16 * 4 * 8192)

"""Cohere Command-R (cohere) and Cohere 2 (cohere2) against transformers' CohereForCausalLM
and Cohere2ForCausalLM, from a config.json and from GGUFs written as llama.cpp's
converter writes them (conversion/command_r.py: arch "command-r" or "cohere2", q/k
unpermuted, the layer norm's epsilon, logit_scale, Cohere 2's sliding window and no
pattern key). The features a config switches (q/k norms, logit_scale, windows) are
shown to move the logits; those in the code (adjacent-pair RoPE, the parallel block,
LayerNorm's mean, per-head q/k norm scales, no RoPE in global layers, logit_scale,
windows) were each removed once by hand, and test_matches_transformers_three_ways failed.

Tolerance: 1e-4 max abs difference in float32 on logits within about ±3.4
(logit_scale 0.5). Measured, from config.json and from the GGUFs alike: the forward
alone 1.8e-6..2.6e-6, the cached ways (a prefill of 3, then decode steps; chunked
prefills across the windows of 5) 1.9e-6..4.1e-6. A Q8_0 GGUF is held to the same 1e-4
against transformers run on its dequantized weights. The paged pool, the KV cache types
and the static decode step are held to test_paged's, test_cache_types' and
test_static_decode's bounds.
"""

import numpy as np
import pytest
import torch
from family_checks import (
    check_rounded_cache,
    check_run_prints_greedy_tokens,
    check_served_as_alone,
    check_show,
)
from helpers import (
    STORIES_GGUF,
    VOCAB_DIR,
    cached_logits,
    gguf_name,
    needs_vocab,
    our_model,
    randomize,
    save_hf_dir,
)
from test_cache_types import TOLERANCE
from test_paged import contiguous_logits, pool_for
from test_static_decode import decode_logits, ordinary

from llmrun import api, static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.kv_blocks import KVBlocks
from llmrun.loading import inspect
from llmrun.loading.gguf_config import config_from_gguf
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.models import kv_cache_bytes, model_module
from llmrun.models.paged import PagedKVCache
from llmrun.quant import decode_step
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

BASE = dict(
    vocab_size=512,  # stories260K's tokenizer, so the GGUFs run end to end
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    layer_norm_eps=1e-5,
    logit_scale=0.5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Cohere 2: four layers, so llama.cpp's default pattern (every fourth layer global) has a
# global layer; windows of 5 under 40 tokens, so local and global layers differ.
CONFIGS = {
    "cohere": dict(model_type="cohere"),
    "cohere-qk-norm": dict(model_type="cohere", use_qk_norm=True),
    "cohere2": dict(model_type="cohere2", num_hidden_layers=4, sliding_window=5, rotary_pct=1.0),
}
SEQ = 40
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(name: str, **overrides):
    config = transformers.AutoConfig.for_model(**{**BASE, **CONFIGS[name], **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ours(hf):
    return our_model(hf.config.to_dict(), hf.state_dict())


def moved(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def three_ways(model) -> list[torch.Tensor]:
    """llmrun's logits of IDS: one forward, a prefill of 3 then decode steps, and chunked
    prefills (helpers.CHUNKS, across the windows of 5) then decode steps."""
    with torch.no_grad():
        whole = model(IDS, torch.arange(SEQ)[None])
    return [whole, cached_logits(model, IDS, (3,)), cached_logits(model, IDS)]


def write_cohere_gguf(path, hf, qtype=None):
    """The model as llama.cpp's converter writes it: CommandR2Model ("command-r") or
    Cohere2Model ("cohere2"); q/k as they are; norms in F32, matrices in `qtype`; the
    tied output left to token_embd; stories260K's vocabulary."""
    config = hf.config
    cohere2 = config.model_type == "cohere2"
    writer = gguf.GGUFWriter(str(path), "cohere2" if cohere2 else "command-r")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_eps(config.layer_norm_eps)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_logit_scale(config.logit_scale)
    if cohere2:
        writer.add_sliding_window(config.sliding_window)
        writer.add_vocab_size(config.vocab_size)
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(config.rotary_pct * head_dim))
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    ftype = (
        gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType[f"MOSTLY_{qtype.name}"]
    )
    writer.add_file_type(ftype)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if data.ndim == 1 or name.endswith("norm.weight") or qtype is None:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_three_ways(name):
    hf = hf_model(name)
    expected = reference(hf)
    assert expected.abs().max() > 2  # logits of some size, so 1e-4 means something
    for logits in three_ways(ours(hf)):
        assert moved(logits, expected) < 1e-4


def test_each_feature_of_the_configs_matters():
    """The q/k norms, the logit scale and Cohere 2's windows each move the logits."""
    expected = reference(hf_model("cohere-qk-norm"))
    assert moved(expected, reference(hf_model("cohere"))) > 0.5
    assert moved(reference(hf_model("cohere", logit_scale=1.0)), reference(hf_model("cohere"))) > 2
    windowed = reference(hf_model("cohere2"))
    assert moved(windowed, reference(hf_model("cohere2", sliding_window=64))) > 0.5


def test_cohere2_global_layers_take_no_rope():
    """Without RoPE, attention sees the earlier tokens as a set: in one global layer, two
    tokens swapped leave the logits after them as they were, in transformers and in
    llmrun; in a rotating one (a window longer than the tokens), they move."""
    swapped = IDS.clone()
    swapped[0, [3, 4]] = IDS[0, [4, 3]]
    positions = torch.arange(SEQ)[None]
    hf = hf_model("cohere2", num_hidden_layers=1, layer_types=["full_attention"])
    model = ours(hf)
    with torch.no_grad():
        logits = model(IDS, positions)
        assert moved(logits, reference(hf)) < 1e-4
        assert moved(logits[:, 5:], model(swapped, positions)[:, 5:]) < 1e-4
        rotated = ours(
            hf_model(
                "cohere2", num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=64
            )
        )
        assert moved(rotated(IDS, positions)[:, 5:], rotated(swapped, positions)[:, 5:]) > 0.1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_gguf_as_llama_cpp_writes_it(name, tmp_path):
    hf = hf_model(name)
    loaded = load_model(write_cohere_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"))
    config = loaded.checkpoint.config
    assert config["model_type"] == CONFIGS[name]["model_type"]
    assert config["use_qk_norm"] == (name == "cohere-qk-norm")
    if name == "cohere2":
        assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert loaded.model.decode_step is None  # the native step knows neither family
    expected = reference(hf)
    for logits in three_ways(loaded.model):
        assert moved(logits, expected) < 1e-4


@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2"])
def test_a_hugging_face_folder(name, tmp_path):
    """config.json and safetensors as save_pretrained writes them (the tied lm_head left out)."""
    hf = hf_model(name)
    loaded = load_model(save_hf_dir(hf, tmp_path / "hf"), torch.device("cpu"))
    assert loaded.checkpoint.config["model_type"] == CONFIGS[name]["model_type"]
    assert moved(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2"])
def test_a_q8_0_gguf_gives_transformers_logits_of_its_dequantized_weights(name, tmp_path):
    qtype = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model(name)
    path = write_cohere_gguf(tmp_path / "q.gguf", hf, qtype)
    f32 = reference(hf)
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            if p.dim() == 2 and not param_name.endswith("norm.weight"):
                raw = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    expected = reference(hf)
    assert moved(expected, f32) > 1e-3  # the blocks round the weights
    model = load_model(path, torch.device("cpu")).model
    for logits in three_ways(model):
        assert moved(logits, expected) < 1e-4


@needs_vocab
def test_the_header_of_a_real_command_r_gguf():
    """llama.cpp's ggml-vocab-command-r.gguf carries Command-R 35B's metadata as its
    converter wrote it: the model it describes has 35B parameters."""
    config = config_from_gguf(
        read_gguf(VOCAB_DIR / "ggml-vocab-command-r.gguf", with_tensors=False)
    )
    assert config["model_type"] == "cohere"
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (
        40,
        8192,
        128,
    )
    assert (config["logit_scale"], config["use_qk_norm"]) == (0.0625, False)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 8000000.0}
    module = model_module("cohere")
    with torch.device("meta"):
        model = module.Model(module.ModelArgs.from_config(config))
    tied = model.model.embed_tokens.weight.numel()  # lm_head is this matrix once loaded
    assert round((sum(p.numel() for p in model.parameters()) - tied) / 1e9, 1) == 35.0


def test_llama_cpp_defaults_where_a_command_r_gguf_says_nothing(tmp_path):
    """No logit_scale: llama.cpp leaves the logits unscaled; no rope.freq_base: 10000."""
    gg = read_gguf(write_cohere_gguf(tmp_path / "m.gguf", hf_model("cohere")), with_tensors=False)
    assert config_from_gguf(gg)["logit_scale"] == 0.5
    del gg.metadata["command-r.logit_scale"], gg.metadata["command-r.rope.freq_base"]
    config = config_from_gguf(gg)
    assert config["logit_scale"] == 1.0
    assert config["rope_parameters"]["rope_theta"] == 10000.0


def test_a_cohere2_pattern_key_is_read_as_llama_cpp_reads_it(tmp_path):
    """Without a key, every fourth layer global (load_swa_pattern(ml, 4)); a count or a
    list of flags where the file has one."""
    key = "cohere2.attention.sliding_window_pattern"
    gg = read_gguf(write_cohere_gguf(tmp_path / "m.gguf", hf_model("cohere2")), with_tensors=False)
    local, full = "sliding_attention", "full_attention"
    assert config_from_gguf(gg)["layer_types"] == [local, local, local, full]
    gg.metadata[key] = 2
    assert config_from_gguf(gg)["layer_types"] == [local, full, local, full]
    gg.metadata[key] = [False, True, True, False]
    assert config_from_gguf(gg)["layer_types"] == [full, local, local, full]


def edited_gguf(tmp_path, name: str, **changes):
    """A GGUF of CONFIGS[name] read back with metadata keys set (None: removed)."""
    gg = read_gguf(write_cohere_gguf(tmp_path / "m.gguf", hf_model(name)), with_tensors=False)
    for key, value in changes.items():
        if value is None:
            del gg.metadata[key]
        else:
            gg.metadata[key] = value
    return gg


@pytest.mark.parametrize(
    "name,changes,error,message",
    [
        ("cohere", {"command-r.rope.dimension_count": 8}, UnsupportedError, "rotates 8 of 16"),
        ("cohere2", {"cohere2.rope.dimension_count": 8}, UnsupportedError, "rotates 8 of 16"),
        ("cohere2", {"cohere2.logit_scale": None}, ModelFormatError, "logit_scale"),
        ("cohere2", {"cohere2.attention.sliding_window": None}, ModelFormatError, "sliding_window"),
        ("cohere", {"command-r.attention.layer_norm_epsilon": None}, ModelFormatError, "epsilon"),
        (
            "cohere2",
            {"cohere2.attention.key_length": 32, "cohere2.attention.value_length": 32},
            UnsupportedError,
            "hidden size / heads",
        ),
        ("cohere2", {"cohere2.rope.freq_base_swa": 5.0}, UnsupportedError, "one RoPE base"),
    ],
)
def test_what_a_gguf_cannot_mean_is_refused(tmp_path, name, changes, error, message):
    with pytest.raises(error, match=message):
        config_from_gguf(edited_gguf(tmp_path, name, **changes))


def test_a_separate_output_matrix_is_refused(tmp_path):
    gg = edited_gguf(tmp_path, "cohere")
    gg.tensors["output.weight"] = gg.tensors["token_embd.weight"]
    with pytest.raises(UnsupportedError, match="output.weight"):
        config_from_gguf(gg)


def test_partial_rope_in_a_config_is_refused():
    with pytest.raises(UnsupportedError, match="partial RoPE"):
        model_module("cohere2").ModelArgs.from_config(
            {**BASE, **CONFIGS["cohere2"], "rotary_pct": 0.5}
        )
    with pytest.raises(UnsupportedError, match="use_qk_norm"):
        model_module("cohere2").ModelArgs.from_config(
            {**BASE, **CONFIGS["cohere2"], "use_qk_norm": True}
        )


@pytest.mark.parametrize("name,theta", [("cohere", 500000.0), ("cohere2", 10000.0)])
def test_a_config_without_rope_theta_takes_transformers_default(name, theta):
    config = {k: v for k, v in {**BASE, **CONFIGS[name]}.items() if k != "rope_theta"}
    assert transformers.AutoConfig.for_model(**config).rope_parameters["rope_theta"] == theta
    args = model_module(name).ModelArgs.from_config(config)
    assert args.rope_parameters["rope_theta"] == theta


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_paged_cache_gives_the_contiguous_logits(name):
    """serve's path: one sequence on shuffled blocks (f32 and f16), then two rows
    decoded together whose tables share their first block."""
    model = ours(hf_model(name))
    sizes = [7, 20] + [1] * (SEQ - 27)
    with torch.inference_mode():
        for cache_type, tolerance in (("f32", 1e-4), ("f16", 2e-3)):
            pool = pool_for(model, cache_type)
            out, start = [], 0
            for n in sizes:
                positions = torch.arange(start, start + n)[None]
                out.append(model(IDS[:, start : start + n], positions, pool.view([[9, 2, 14]]))[0])
                start += n
            expected = contiguous_logits(model, IDS[0], sizes, cache_type)
            torch.testing.assert_close(torch.cat(out), expected, rtol=tolerance, atol=tolerance)
        ids = torch.cat([IDS, IDS.flip(1)])
        ids[1, :16] = ids[0, :16]
        pool = pool_for(model)
        tables = [[5, 0, 11], [5, 3, 7]]
        model(ids[:, :20], torch.arange(20).expand(2, 20), pool.view(tables))
        decoded = [
            model(ids[:, p : p + 1], torch.tensor([[p], [p]]), pool.view(tables))[:, -1]
            for p in range(20, 30)
        ]
        for row in range(2):
            expected = contiguous_logits(model, ids[row], [20] + [1] * 10)[20:]
            got = torch.stack([d[row] for d in decoded])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_cohere2_windowed_layers_in_a_pool_of_their_own():
    """serve keeps the local layers' keys in a pool of window blocks that a sequence lets
    go of as they leave its window (KVBlocks): the logits are the contiguous cache's."""
    model = ours(hf_model("cohere2"))
    like = model.new_cache(1, 1, "f32", "cpu")
    pool = PagedKVCache(like, 16, 16, 256, window_blocks=5)
    assert pool.window_k is not None
    kv = KVBlocks(16, 16, window=5, window_blocks=5)
    seq = kv.allocate(IDS[0, :20].tolist(), 20)[0]
    sizes, fed, got = [20] + [1] * 20, [], []
    with torch.inference_mode():
        for n in sizes:
            start = len(fed)
            assert kv.grow(seq, start + n)
            view = pool.view([seq.full.blocks], None, [seq.window.blocks])
            positions = torch.arange(start, start + n)[None]
            got.append(model(IDS[:, start : start + n], positions, view)[0, -1])
            fed.extend(IDS[0, start : start + n].tolist())
            kv.commit(seq, fed)
        expected = contiguous_logits(model, IDS[0], sizes)[torch.tensor(sizes).cumsum(0) - 1]
    torch.testing.assert_close(torch.stack(got), expected, rtol=1e-4, atol=1e-4)
    kv.release(seq)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2"])
def test_cache_types_round_only_what_they_store(name, cache_type):
    """--cache-type: the logits of an f32 cache whose writes are rounded alike, and
    near the f32 cache's (test_cache_types' bounds)."""
    model = ours(hf_model(name, num_attention_heads=2, num_key_value_heads=1))  # q8_0: 32
    check_rounded_cache(model, cache_type, TOLERANCE[cache_type])


def test_the_static_decode_step_takes_command_r_only(monkeypatch):
    """Command-R's frames are CausalLM's, so the static step (CUDA graphs) applies and
    gives the ordinary logits; Cohere 2's windows keep it to the ordinary forward."""
    monkeypatch.setattr(static_decode, "FIRST_BUCKET", 8)
    model = ours(hf_model("cohere-qk-norm"))
    static_cache = model.new_cache(1, 32, torch.float32, "cpu")
    assert static_decode.supported(model, static_cache)
    got = decode_logits(model, static_decode.step(model, static_cache), static_cache)
    cache = model.new_cache(1, 32, torch.float32, "cpu")
    expected = decode_logits(model, ordinary(model, cache), cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    cohere2 = ours(hf_model("cohere2"))
    assert not static_decode.supported(cohere2, cohere2.new_cache(1, 32, torch.float32, "cpu"))


@pytest.mark.parametrize("name", ["cohere", "cohere2"])
def test_the_native_decode_step_is_not_attached(name):
    assert not decode_step.attach(ours(hf_model(name)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_show_counts_the_kv_cache_as_the_model_allocates_it(name):
    config = hf_model(name).config.to_dict()
    for context in (1, 4, 5, 12, 8192):
        assert inspect.kv_cache_bytes(config, context) == kv_cache_bytes(config, context)


def test_show_describes_a_cohere2_gguf(tmp_path):
    path = write_cohere_gguf(tmp_path / "m.gguf", hf_model("cohere2"))
    # Three layers of 5 positions, one of 8192: 2 KV heads of 16 floats, keys and values.
    check_show(path, "cohere2", 2 * 2 * 16 * 4 * (3 * 5 + 8192))


@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2"])
def test_llmrun_run_prints_transformers_greedy_text(name, tmp_path):
    hf = hf_model(name)
    path = write_cohere_gguf(tmp_path / "m.gguf", hf)
    check_run_prints_greedy_tokens(hf, path)


@pytest.mark.parametrize("name", ["cohere", "cohere2"])
def test_serves_concurrent_requests_as_it_runs_them_alone(name, tmp_path):
    """serve's scheduler (a paged pool; Cohere 2's local layers in window blocks) decodes
    four requests together, each getting the text it gets alone."""
    engine = api.load(
        str(write_cohere_gguf(tmp_path / "m.gguf", hf_model(name))), "cpu", ctx_size=128
    )
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "The sun was"]
    cases = [
        (
            engine.tokenizer.encode(p),
            SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i, temperature=0.9),
        )
        for i, p in enumerate(prompts)
    ]
    check_served_as_alone(engine, cases, 20, parallel=4)

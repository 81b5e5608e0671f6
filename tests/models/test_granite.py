"""IBM Granite 3.x (granite, granitemoe, granitemoeshared) against transformers: the four
muP multipliers, each shown to matter; the MoE routers and the shared expert; from a
Hugging Face directory as the Hub has it (fused experts, split by the loader) and from
GGUFs written as llama.cpp's converter writes them (conversion/granite.py: arch
"granite" or "granitemoe", Llama's permuted q/k, the multipliers as *_scale keys, the
experts' fused gate/up rows split and stacked). Logits within 1e-4 of transformers in f32
(measured ~1e-5, on logits within about ±4); a Q8_0 GGUF within 1e-4 of transformers
running the Q8_0-rounded weights. The paged KV cache, --cache-type and CUDA's static
decode step give the contiguous f32 cache's logits (test_paged.py's,
test_cache_types.py's and test_static_decode.py's tolerances); the native decode step
takes the dense family's decoded tokens (tests/quant/test_decode_step.py), not the MoE
families'. `llmrun run` prints transformers' greedy text and
`llmrun show` describes the files. Granite's adapter GGUFs (the sliding-window ones:
test_granite_swa.py), NoPE Granite and a GGUF without logit_scale are refused (Granite 4.0-H: test_granitemoehybrid.py)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, Keys
from gguf.quants import dequantize, quantize
from helpers import BASE, STORIES_GGUF, TEMPLATES_DIR, _permute, cached_logits, randomize
from in_process import llmrun
from safetensors.torch import load_file
from test_cache_types import logits_of
from test_paged import contiguous_logits, pool_for
from test_paged import test_batched_rows_sharing_prefix_blocks_give_their_own_logits as batched
from test_static_decode import decode_logits, ordinary

from llmrun import static_decode
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

# head_dim 32 (two heads, one KV head), so a q8_0 cache can hold the keys.
MULTIPLIERS = dict(
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.4,  # not head_dim^-0.5 (0.177)
    logits_scaling=2.0,
)
DEFAULTS = dict(
    embedding_multiplier=1.0,
    residual_multiplier=1.0,
    attention_multiplier=32**-0.5,
    logits_scaling=1.0,
)
MOE = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
CONFIGS = {
    "granite": dict(model_type="granite", rope_theta=10000.0, tie_word_embeddings=True),
    "granitemoe": dict(model_type="granitemoe", **MOE),
    "granitemoeshared": dict(model_type="granitemoeshared", shared_intermediate_size=64, **MOE),
}
FAMILIES = list(CONFIGS)
IDS = torch.randint(3, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
CPU = torch.device("cpu")


def hf_model(family: str, **overrides):
    config = transformers.AutoConfig.for_model(
        **{
            **BASE,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            **MULTIPLIERS,
            **CONFIGS[family],
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def saved(family, tmp_path_factory):
    """The transformers model, its folder (save_pretrained: the Hub's fused keys) and
    its logits of IDS."""
    hf = hf_model(family)
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return hf, path, reference(hf)


def check_three_ways(model, expected: torch.Tensor) -> None:
    """Whole, prefilled in chunks across the sequence, and a prefill of 10 then one token
    at a time: each within 1e-4 of `expected`."""
    with torch.no_grad():
        whole = model(IDS, torch.arange(IDS.shape[1])[None])
    assert (whole - expected).abs().max() < 1e-4
    assert (cached_logits(model, IDS) - expected).abs().max() < 1e-4
    assert (cached_logits(model, IDS, chunks=(10,)) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("name", list(MULTIPLIERS))
def test_each_multiplier_matters(name):
    """A multiplier left at its default (Llama's) moves the logits by far more than the
    tolerance: tests that pass cannot have dropped one."""
    expected = reference(hf_model("granitemoeshared"))
    plain = reference(hf_model("granitemoeshared", **{name: DEFAULTS[name]}))
    assert (plain - expected).abs().max() > 0.1


def test_the_shared_expert_matters():
    expected = reference(hf_model("granitemoeshared"))
    without = reference(hf_model("granitemoeshared", shared_intermediate_size=0))
    assert (without - expected).abs().max() > 0.1


def test_hf_folder_matches_transformers(saved, family):
    hf, path, expected = saved
    loaded = load_model(path, CPU)
    assert loaded.checkpoint.config["model_type"] == family
    assert (loaded.model.decode_step is not None) == (family == "granite")  # dense only
    check_three_ways(loaded.model, expected)


@pytest.mark.parametrize("moe", ["granitemoe", "granitemoeshared"])
def test_the_moe_routes_to_every_expert(moe):
    """The tokens reach every expert of the first layer (so every expert's split rows are
    checked), two per token."""
    hf = hf_model(moe)
    seen = []
    block = hf.model.layers[0].block_sparse_moe
    hook = block.router.register_forward_hook(lambda m, i, out: seen.append(out[2]))
    reference(hf)
    hook.remove()
    assert seen[0].shape[-1] == 2 and set(seen[0].flatten().tolist()) == set(range(8))


# ---- GGUF as llama.cpp's converter writes it -------------------------------------------

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.router.layer": "ffn_gate_inp",
    "block_sparse_moe.output_linear": "ffn_down_exps",
    "shared_mlp.output_linear": "ffn_down_shexp",
}
# Fused gate/up rows: split in two, gate first (GraniteMoeModel.modify_tensors).
_SPLIT = {
    "block_sparse_moe.input_linear": ("ffn_gate_exps", "ffn_up_exps"),
    "shared_mlp.input_linear": ("ffn_gate_shexp", "ffn_up_shexp"),
}


def converted(config: dict, hub: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """GGUF tensors of a Hub state dict, as llama.cpp's converter names and shapes them."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = {}
    for key, tensor in hub.items():
        data = tensor.float().numpy()
        module, _, suffix = key.rpartition(".")
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{suffix}"] = data
            continue
        _, _, layer, rest = module.split(".", 3)
        if rest in _SPLIT:
            gate, up = np.split(data, 2, axis=-2)
            for name, part in zip(_SPLIT[rest], (gate, up), strict=True):
                out[f"blk.{layer}.{name}.{suffix}"] = part
            continue
        if rest == "self_attn.q_proj":
            data = _permute(data, heads)
        elif rest == "self_attn.k_proj":
            data = _permute(data, kv_heads)
        out[f"blk.{layer}.{_LAYER[rest]}.{suffix}"] = data
    return out


def write_granite_gguf(
    path, config: dict, hub: dict, qtype=None, arch: str | None = None, drop=(), extra=None
):
    """The GGUF llama.cpp writes for `config` (GraniteModel/GraniteMoeModel's keys; no
    key_length: the converter drops head_dim), 2-D and 3-D matrices in `qtype` but the
    router in F32. `drop`: keys left out; `extra`: {key template: (value, GGUF type)}."""
    import gguf

    experts = config.get("num_local_experts")
    arch = arch or ("granitemoe" if experts else "granite")
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    keys = {
        Keys.LLM.BLOCK_COUNT: (config["num_hidden_layers"], "uint32"),
        Keys.LLM.CONTEXT_LENGTH: (config["max_position_embeddings"], "uint32"),
        Keys.LLM.EMBEDDING_LENGTH: (config["hidden_size"], "uint32"),
        Keys.LLM.FEED_FORWARD_LENGTH: (config["intermediate_size"], "uint32"),
        Keys.Attention.HEAD_COUNT: (config["num_attention_heads"], "uint32"),
        Keys.Attention.HEAD_COUNT_KV: (config["num_key_value_heads"], "uint32"),
        Keys.Attention.LAYERNORM_RMS_EPS: (config["rms_norm_eps"], "float32"),
        Keys.Rope.FREQ_BASE: (config["rope_parameters"]["rope_theta"], "float32"),
        Keys.Rope.DIMENSION_COUNT: (head_dim, "uint32"),
        Keys.LLM.VOCAB_SIZE: (config["vocab_size"], "uint32"),
        Keys.Attention.SCALE: (config["attention_multiplier"], "float32"),
        Keys.LLM.EMBEDDING_SCALE: (config["embedding_multiplier"], "float32"),
        Keys.LLM.RESIDUAL_SCALE: (config["residual_multiplier"], "float32"),
        Keys.LLM.LOGIT_SCALE: (config["logits_scaling"], "float32"),
    }
    if experts:
        keys[Keys.LLM.EXPERT_COUNT] = (experts, "uint32")
        keys[Keys.LLM.EXPERT_USED_COUNT] = (config["num_experts_per_tok"], "uint32")
    if config.get("shared_intermediate_size"):
        shared = config["shared_intermediate_size"]
        keys[Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH] = (shared, "uint32")
    keys.update(extra or {})
    for key, (value, kind) in keys.items():
        if key not in drop:
            getattr(writer, f"add_{kind}")(key.format(arch=arch), value)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, data in converted(config, hub).items():
        if qtype is None or data.ndim == 1 or ".ffn_gate_inp." in name:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            raw = quantize(np.ascontiguousarray(data), qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hub_state(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_gguf_matches_transformers(saved, family, tmp_path):
    hf, path, expected = saved
    gguf_path = write_granite_gguf(tmp_path / "m.gguf", hf.config.to_dict(), hub_state(path))
    loaded = load_model(gguf_path, CPU)
    assert loaded.checkpoint.config["model_type"] == family
    assert (loaded.model.decode_step is not None) == (family == "granite")
    check_three_ways(loaded.model, expected)


def test_q8_0_gguf_matches_transformers_on_the_rounded_weights(saved, family, tmp_path):
    """Every matrix but the router in Q8_0 (the embedding too: a QuantEmbedding, still
    scaled); the reference is transformers with those weights rounded through Q8_0."""
    hf, path, _ = saved
    q8 = GGMLQuantizationType.Q8_0
    gguf_path = write_granite_gguf(tmp_path / "q.gguf", hf.config.to_dict(), hub_state(path), q8)
    rounded = hf_model(family)
    with torch.no_grad():
        for key, p in rounded.named_parameters():
            if p.dim() >= 2 and "router" not in key:
                data = dequantize(quantize(p.detach().numpy(), q8), q8)
                p.copy_(torch.from_numpy(data.reshape(p.shape)))
    expected = reference(rounded)
    assert (expected - reference(hf)).abs().max() > 1e-3  # the rounding shows
    loaded = load_model(gguf_path, CPU)
    check_three_ways(loaded.model, expected)


def test_paged_cache_gives_the_contiguous_logits(saved):
    """A prefill in chunks ending inside blocks, then decoding, on shuffled blocks of
    serve's paged cache, and two rows sharing prefix blocks prefilled and decoded
    together (test_paged.py's check): the contiguous cache's logits (1e-4)."""
    _, path, _ = saved
    model = load_model(path, CPU).model
    sizes = [7, 20] + [1] * (IDS.shape[1] - 27)
    pool = pool_for(model)
    out, start = [], 0
    with torch.inference_mode():
        reference_logits = contiguous_logits(model, IDS[0], sizes)
        for n in sizes:
            positions = torch.arange(start, start + n)[None]
            out.append(model(IDS[:, start : start + n], positions, pool.view([[9, 2, 14]]))[0])
            start += n
    torch.testing.assert_close(torch.cat(out), reference_logits, rtol=1e-4, atol=1e-4)
    batched(model)


def test_the_static_decode_step_gives_the_ordinary_logits(saved, family, monkeypatch):
    """CUDA's static decode step (llmrun.static_decode) takes dense Granite, whose forward
    passes it on: the ordinary forward's logits (test_static_decode.py's 1e-5). It
    leaves the MoE models to the ordinary forward."""
    _, path, _ = saved
    model = load_model(path, CPU).model
    static_cache = model.new_cache(1, 32, torch.float32, "cpu")
    if family != "granite":
        assert not static_decode.supported(model, static_cache)
        return
    monkeypatch.setattr(static_decode, "FIRST_BUCKET", 8)
    assert static_decode.supported(model, static_cache)
    got = decode_logits(model, static_decode.step(model, static_cache), static_cache)
    cache = model.new_cache(1, 32, torch.float32, "cpu")
    expected = decode_logits(model, ordinary(model, cache), cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# Dense Granite's drift from the f32 cache, measured (max abs diff over test_cache_types'
# 40 positions, logits within ±3.2): f16 1.1e-2, bf16 6.5e-2, q8_0 1.5e-1, twice
# test_cache_types' Qwen3 figures: the attention multiplier here scores 2.3x sharper than
# head_dim^-0.5 would. The MoE models' drift is no bound to test: a rounding sends a
# token to other experts (bf16 moves granitemoe's logits by 1.8).
DENSE_DRIFT = {"f16": 2e-2, "bf16": 1.3e-1, "q8_0": 3e-1}


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])
def test_cache_types_store_the_rounded_keys(saved, family, cache_type):
    """--cache-type: the logits of an f32 cache holding the type's rounded values
    (test_cache_types.py's 1e-5), and for dense Granite near the f32 cache's."""
    _, path, _ = saved
    model = load_model(path, CPU).model
    logits = logits_of(model, cache_type)
    # The reference's layers round what they write (cache.encode); the native step, which
    # decodes dense Granite's tokens above, writes the f32 cache as it is.
    step, model.decode_step = model.decode_step, None
    expected = logits_of(model, torch.float32, rounded=cache_type)
    model.decode_step = step
    # 1e-5 where both round the same f32 values; the native step computes a key in
    # another order than the layers, which can tip its rounding to the type's next value
    # (the AVX2 kernels on a Zen 3: 5.8e-5 for f16, against an f32 cache's 5.8e-6).
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    drift = (logits - logits_of(model, torch.float32)).abs().max()
    assert drift > 0  # the storage rounds
    if family == "granite":
        assert drift < DENSE_DRIFT[cache_type]


# ---- what llmrun refuses, and what llama.cpp assumes ----------------------------------


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A dense Granite's config and Hub weights."""
    hf = hf_model("granite")
    path = tmp_path_factory.mktemp("dense")
    hf.save_pretrained(path)
    return hf.config.to_dict(), hub_state(path)


def test_absent_scale_keys_take_llama_cpps_defaults(tmp_path):
    """Without attention.scale llama.cpp scales by head_dim^-0.5; without the embedding
    and residual scales it scales by nothing."""
    hf = hf_model("granite", **DEFAULTS)
    hf.save_pretrained(tmp_path / "hf")
    config = hf.config.to_dict()
    drop = (Keys.Attention.SCALE, Keys.LLM.EMBEDDING_SCALE, Keys.LLM.RESIDUAL_SCALE)
    path = write_granite_gguf(tmp_path / "m.gguf", config, hub_state(tmp_path / "hf"), drop=drop)
    loaded = load_model(path, CPU)
    check_three_ways(loaded.model, reference(hf))


def test_a_gguf_without_logit_scale_is_refused(tmp_path, dense):
    drop = (Keys.LLM.LOGIT_SCALE,)
    gguf_path = write_granite_gguf(tmp_path / "m.gguf", *dense, drop=drop)
    with pytest.raises(ModelFormatError, match="logit_scale' is missing"):
        load_model(gguf_path, CPU)


def test_granite_without_rope_is_refused(tmp_path, dense):
    """rope.scaling.finetuned false: llama.cpp's granite then runs without RoPE."""
    extra = {Keys.Rope.SCALING_FINETUNED: (False, "bool")}
    gguf_path = write_granite_gguf(tmp_path / "nope.gguf", *dense, extra=extra)
    with pytest.raises(UnsupportedError, match="without RoPE"):
        load_model(gguf_path, CPU)


@pytest.mark.parametrize("arch", ["graniteswitch"])  # granite_swa: test_granite_swa.py
def test_other_granite_architectures_are_refused_by_name(tmp_path, dense, arch):
    gguf_path = write_granite_gguf(tmp_path / "m.gguf", *dense, arch=arch)
    with pytest.raises(UnsupportedError, match=f"'{arch}'.*not supported"):
        load_model(gguf_path, CPU)


def test_granite_chat_template_renders():
    """The template Granite 3.3's GGUFs carry (tokenizer.chat_template), in llmrun's
    sandbox, with the date and thinking switches it reads."""
    from llmrun.chat_template import ChatTemplate

    source = TEMPLATES_DIR / "ibm-granite-granite-3.3-2B-Instruct.jinja"
    if not source.exists():
        pytest.skip(f"{source} is not fetched")
    template = ChatTemplate(source.read_text(), bos_token="", eos_token="<|end_of_text|>")
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>" in text
    assert text.endswith("<|start_of_role|>assistant<|end_of_role|>")


# ---- the CLI ----------------------------------------------------------------------------


def test_llmrun_run_prints_transformers_greedy_text(saved, family, tmp_path):
    """`llmrun run` on the model's GGUF (stories260K's vocabulary) prints the text of
    transformers' greedy generate."""
    from llmrun import api

    hf, path, _ = saved
    gguf_path = write_granite_gguf(tmp_path / "m.gguf", hf.config.to_dict(), hub_state(path))
    tokenizer = api.load(str(gguf_path), device="cpu").tokenizer
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0
        )
    tokens = out[0, len(ids) :].tolist()
    tokens = tokens[: tokens.index(2)] if 2 in tokens else tokens
    assert len(tokens) > 3
    result = llmrun("run", str(gguf_path), prompt, "-n", "16", "--temperature", "0", "--raw")
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.decode(tokens)


def test_llmrun_show_describes_the_gguf(saved, family, tmp_path):
    hf, path, _ = saved
    gguf_path = write_granite_gguf(tmp_path / "m.gguf", hf.config.to_dict(), hub_state(path))
    result = llmrun("show", str(gguf_path))
    assert result.returncode == 0, result.stderr
    assert f"architecture   {'granite' if family == 'granite' else 'granitemoe'}\n" in result.stdout
    folder = llmrun("show", str(path))
    assert folder.returncode == 0, folder.stderr
    assert f"architecture   {family}\n" in folder.stdout
    for shown in (result.stdout, folder.stdout):  # the experts one token uses: 2 of 8
        assert ("active a token" in shown) == (family != "granite")
